"""
gemma.py: DiffusionGemma (google/diffusiongemma-26B-A4B-it): tokens -> logits, text only.

One Gemma 4 mixture-of-experts stack (the official classes: huggingface/transformers v5.23.0,
src/transformers/models/diffusion_gemma/modeling_diffusion_gemma.py; docs/diffusiongemma.md), run two ways over one
KV cache (cache.KVCache, whose layers here have two shapes):

- encode(): the causal ENCODER. Committed tokens (the prompt, then each finished canvas) go through it; it writes
  their keys/values at their cache slots and makes no logits.
- decode(): the bidirectional DECODER. The canvas (the random tokens being denoised) attends to the committed keys/
  values and to itself, and returns float32 logits, softcapped. Its own keys/values go to the canvas's slots, where
  the next encode() of the committed canvas overwrites them (the official keeps them out of its cache instead).

Both share every weight but each layer's scalar (the encoder has its own). A layer: attention (sliding-window layers
with their head size and key/value heads, full layers with a wider head, fewer key/value heads, no V projection:
V is the K projection, RMS-normed without scale and not rotated), q/k/v RMSNorm and an attention scale of 1; then a
dense GeGLU MLP beside a mixture of experts, each with its own norms, summed, normed, added to the residual, and the
sum scaled by the layer scalar. The decoder's input adds the self-conditioning signal: the previous step's logits
as a soft embedding through a small MLP. What the sliding layers see (docs/diffusiongemma.md): in the encoder, the
`window` tokens up to the query (itself included); in the decoder, the last window - 1 committed tokens and the
whole canvas, as the official cache keeps them. Both are masks over our full-length cache: the shapes never change.

Positions count a row's real tokens (valid), so a left-padded row computes as it would alone (the official code
does not shift them: docs/parity.md). The decode loop is fastdllm.py's; tests/reference_gemma.py is the naive one.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from model import MLP, MoE, apply_rope


def gelu(x):
    return F.gelu(x, approximate="tanh")     # config.json's hidden_activation "gelu_pytorch_tanh"


class Norm(nn.Module):
    """Gemma's RMSNorm: normalise and scale in float32, then cast (model.RMSNorm casts before scaling, which rounds
    differently in bf16). scale=False: no weight (the v norm, the router's, the self-conditioning output's)."""

    def __init__(self, dim: int, eps: float, scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None

    def forward(self, x):
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (h if self.weight is None else h * self.weight.float()).to(x.dtype)


def rope_cos_sin(pos, head_dim: int, rotated: int, theta: float, dtype):
    """cos/sin (B, 1, T, head_dim) for positions pos (B, T), computed in float32 and cast to `dtype` (the official casts
    them to the activations'), sin's first half negated (model.apply_rope). head_dim / 2 frequencies; the first
    `rotated` are theta^(-2i / head_dim), the rest 0 (those pairs never turn). rotated = head_dim / 2 is the usual
    RoPE (the sliding layers'); fewer is the proportional RoPE of the full layers: the exponent still divides by the
    whole head, and the pairs are (i, i + head_dim / 2) over the whole head, unlike model.py's partial rotary."""
    inv_freq = 1.0 / theta ** (torch.arange(0, 2 * rotated, 2, device=pos.device).float() / head_dim)
    inv_freq = torch.cat([inv_freq, inv_freq.new_zeros(head_dim // 2 - rotated)])
    angles = pos.float()[..., None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)[:, None]
    sin = emb.sin()
    return emb.cos().to(dtype), torch.cat((-sin[..., :head_dim // 2], sin[..., head_dim // 2:]), dim=-1).to(dtype)


def positions(valid):
    """(B, S) bool, the cache slots that hold a real token -> (B, S) long, each slot's position: the real tokens
    before it in its row (a pad slot takes its neighbour's; no query ever attends to it)."""
    return valid.long().cumsum(-1) - 1


class GeGLU(MLP):
    def forward(self, x):
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)             # gate and up held as one (model.MLP)
        return self.w_down(gelu(gate) * up)


class GemmaAttention(nn.Module):
    def __init__(self, cfg, i: int):
        super().__init__()
        g, D = cfg.gemma, cfg.dim
        self.hd, self.n_heads, kv = g.head_dims[i], cfg.n_heads, g.kv_heads[i]
        self.wq = nn.Linear(D, self.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(D, kv * self.hd, bias=False)
        self.wv = nn.Linear(D, kv * self.hd, bias=False) if g.sliding[i] else None    # full layers: V from K
        self.wo = nn.Linear(self.n_heads * self.hd, D, bias=False)
        self.q_norm, self.k_norm = Norm(self.hd, cfg.norm_eps), Norm(self.hd, cfg.norm_eps)
        self.v_norm = Norm(self.hd, cfg.norm_eps, scale=False)

    def forward(self, x, cos, sin, kv, mask):
        B, T, _ = x.shape
        q = self.q_norm(self.wq(x).view(B, T, -1, self.hd))
        k = self.wk(x).view(B, T, -1, self.hd)
        v = self.v_norm(k if self.wv is None else self.wv(x).view(B, T, -1, self.hd))   # K = V: the un-normed K
        q, k, v = q.transpose(1, 2), self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin, False), apply_rope(k, cos, sin, False)
        cache, layer, slots = kv
        k, v = cache.update(layer, k, v, slots)                         # (B, nkv, S, hd): the whole cache
        # Scale 1: the q/k norms stand in for 1/sqrt(head_dim). A query with no key (a left pad in the encoder) is 0.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=k.shape[1] != q.shape[1])
        y = y.masked_fill(~mask.any(-1, keepdim=True), 0.0)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class GemmaMoE(MoE):
    """The experts beside the dense MLP (model.MoE's stacks and its two fixed-shape paths, GeGLU experts). The
    router reads the residual stream itself: RMS-normed without weight, times its learned scale and hidden^-0.5,
    softmax in float32, top-k, renormalised to sum 1, times each chosen expert's per_expert_scale. The experts read
    the residual through their own norm (pre_feedforward_layernorm_2)."""
    act = staticmethod(gelu)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.expert_norm = Norm(cfg.dim, cfg.norm_eps)
        self.router_norm = Norm(cfg.dim, cfg.norm_eps, scale=False)
        self.router_scale = nn.Parameter(torch.ones(cfg.dim))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.moe.n_experts))

    def route(self, x):
        h = self.router_norm(x) * self.router_scale * x.shape[-1] ** -0.5
        weights, ids = F.softmax(self.router(h), dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        return weights / weights.sum(-1, keepdim=True) * self.per_expert_scale[ids], ids

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(B * T, D)
        return self.mix(self.expert_norm(x), *self.route(x)).view(B, T, D)


class GemmaBlock(nn.Module):
    def __init__(self, cfg, i: int):
        super().__init__()
        D, eps = cfg.dim, cfg.norm_eps
        self.attn_norm, self.attn, self.post_attn_norm = Norm(D, eps), GemmaAttention(cfg, i), Norm(D, eps)
        self.mlp_norm, self.mlp, self.post_mlp_norm = Norm(D, eps), GeGLU(D, cfg.ffn_dim), Norm(D, eps)
        self.moe, self.post_moe_norm = GemmaMoE(cfg), Norm(D, eps)
        self.post_ffn_norm = Norm(D, eps)
        self.scalar = nn.Parameter(torch.ones(1))             # the decoder's
        self.encoder_scalar = nn.Parameter(torch.ones(1))     # the encoder's own

    def forward(self, x, rope, kv, mask, encoder: bool):
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), *rope, kv, mask))
        ffn = self.post_mlp_norm(self.mlp(self.mlp_norm(x))) + self.post_moe_norm(self.moe(x))
        return (x + self.post_ffn_norm(ffn)) * (self.encoder_scalar if encoder else self.scalar)


class SelfConditioning(nn.Module):
    """The decoder's input: norm(embedding + GeGLU(pre_norm(signal))), the output norm without weight. The signal
    is the previous step's logits as a soft embedding (DiffusionGemma.decode), zeros at a canvas's first step."""

    def __init__(self, cfg):
        super().__init__()
        self.pre_norm = Norm(cfg.dim, cfg.norm_eps)
        self.mlp = GeGLU(cfg.dim, cfg.ffn_dim)
        self.post_norm = Norm(cfg.dim, cfg.norm_eps, scale=False)

    def forward(self, emb, signal):
        return self.post_norm(emb + self.mlp(self.pre_norm(signal)))


class DiffusionGemma(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=torch.zeros(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleList(GemmaBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = Norm(cfg.dim, cfg.norm_eps)
        self.self_cond = SelfConditioning(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight                   # tied: the head is the embedding

    def kv_shapes(self) -> list:
        """Each layer's (key/value heads, head size), for cache.KVCache.for_model."""
        g = self.config.gemma
        return list(zip(g.kv_heads, g.head_dims))

    def embed_scale(self):
        """sqrt(hidden) rounded to the weights' dtype, as the official embedding casts it (53.0 in bf16 for 2816): a
        0-dim tensor made by an op, not from a Python value (a constant under torch.compile, a scalar for any device's
        tensors, nothing a CUDA graph reads from outside it)."""
        return torch.full((), self.config.dim ** 0.5, dtype=torch.float32).to(self.embed.weight.dtype)

    def encode(self, ids, cache, slots, valid, pos=None):
        """The causal encoder. ids (B, T): committed tokens at cache slots `slots` (T,); valid (B, S): the cache slots
        that hold real tokens, these included (False: padding); pos (B, S): each slot's RoPE position (default
        positions(valid)). Writes the chunk's keys/values into `cache` (a cache.KVCache of S slots) and returns its
        hidden states before the final norm (B, T, dim): the decode needs no encoder logits."""
        return self.layers_forward(self.embed(ids) * self.embed_scale(), cache, slots, valid, pos, encoder=True)

    def decode(self, canvas, cache, slots, valid, pos=None, sc_logits=None, sc_rows=None):
        """The bidirectional decoder: canvas (B, C) at cache slots `slots` (C,) attends to every real committed slot
        (the sliding layers: the last window - 1 of them) and to the whole canvas. sc_logits (B, C, V): the previous
        step's (temperature-scaled) logits, cast to the weights' dtype as the official step does, then their
        softmax as an embedding; None: a zero signal (a canvas's first step); sc_rows (B,) bool: the rows whose
        signal is used (others zero). Returns float32 logits (B, C, V), softcapped. Its keys/values are written at
        `slots` (the next encode() of the committed canvas overwrites them)."""
        return self.logits(self.decoder(canvas, cache, slots, valid, pos, sc_logits, sc_rows))

    def decoder(self, canvas, cache, slots, valid, pos=None, sc_logits=None, sc_rows=None):
        """decode()'s hidden states (B, C, dim), before the final norm."""
        W, scale = self.embed.weight, self.embed_scale()
        emb = self.embed(canvas) * scale
        if sc_logits is None:
            signal = torch.zeros_like(emb)
        else:
            signal = F.softmax(sc_logits.to(W.dtype), dim=-1, dtype=torch.float32).to(W.dtype) @ W * scale
            signal = signal if sc_rows is None else signal * sc_rows.to(signal.dtype)[:, None, None]
        return self.layers_forward(self.self_cond(emb, signal), cache, slots, valid, pos, encoder=False)

    def hidden(self, ids, pos, kv, slots, mask, valid, positions, sc, sc_on):
        """The loop's model call (fastdllm.Plan.layers; eager, replayed from CUDA graphs or compiled as
        model.Transformer.hidden is, graphs.py), a function of tensors alone: the fed span (B, T) at cache slots
        `slots` (T,) ends with the canvas, its last C = sc.shape[1] positions, and what comes before them is committed
        and goes through the encoder first. pos and mask are the loop's and unread: valid and positions (B, S) say
        each cache slot's (uniform.GemmaCall). sc (B, C, V): the last step's logits; sc_on (B,) bool: the rows that
        read them (False at a canvas's first step: a zero signal), a flag, not None, so that every call of one width
        runs the same ops. -> hidden states (B, T, dim)."""
        T, C = ids.shape[1], sc.shape[1]
        committed = self.encode(ids[:, :T - C], kv, slots[:T - C], valid, positions) if T > C else None
        canvas = self.decoder(ids[:, T - C:], kv, slots[T - C:], valid, positions, sc, sc_on)
        return canvas if committed is None else torch.cat([committed.to(canvas.dtype), canvas], 1)

    def logits(self, h, rows=None):
        """Hidden states (B, T, dim) -> float32 logits at rows `rows` (None: all), softcapped: cap * tanh(logits / cap)."""
        cap = self.config.gemma.softcap
        return cap * torch.tanh(self.lm_head(self.norm(h if rows is None else h[:, rows])).float() / cap)

    def masks(self, valid, slots, pos, encoder: bool):
        """The chunk at `slots` (T,) -> its attention masks (B, 1, T, S), True = attend: (sliding layers', full
        layers'). Full: the real slots up to the query (encoder, causal) or up to the canvas's end (decoder). Sliding:
        of those, the keys less than `window` positions before the query (encoder), or before the canvas's first
        position (decoder: every canvas query sees the last window - 1 committed tokens, as the official cache
        keeps them, and the whole canvas)."""
        key = torch.arange(valid.shape[1], device=valid.device)
        last = slots[:, None] if encoder else slots[-1:, None]                     # (T or 1, 1)
        here = pos[:, slots] if encoder else pos[:, slots[:1]]                     # (B, T or 1)
        full = valid[:, None, :] & (key <= last)                                   # (B, T or 1, S)
        sliding = full & (pos[:, None, :] > here[..., None] - self.config.gemma.window)
        T = len(slots)
        return sliding.expand(-1, T, -1)[:, None], full.expand(-1, T, -1)[:, None]

    def layers_forward(self, x, cache, slots, valid, pos, encoder: bool):
        cfg, g = self.config, self.config.gemma
        pos = positions(valid) if pos is None else pos
        here = pos[:, slots]
        masks, rope = self.masks(valid, slots, pos, encoder), {}
        for i, layer in enumerate(self.layers):
            s, hd = g.sliding[i], g.head_dims[i]
            if (s, hd) not in rope:    # default RoPE on sliding layers, proportional on full ones
                rotated = hd // 2 if s else int(g.full_rope_fraction * hd // 2)
                rope[s, hd] = rope_cos_sin(here, hd, rotated, cfg.rope_theta if s else g.full_rope_theta, x.dtype)
            x = layer(x, rope[s, hd], (cache, i, slots), masks[0] if s else masks[1], encoder)
        return x


# ----------------------------------------------------------------------------------------------------------
# Refusals, one line each: what the checkpoint and the decode settings allow (docs/errors.md).

def check_text_only(cfg, prompt):
    """A prompt with the checkpoint's image token: the vision tower is not loaded (text only)."""
    image = cfg.gemma.image_token
    if image is not None and (prompt == image).any():
        raise ValueError(f"the prompt contains the image token id {image}: fastdllm runs DiffusionGemma on text only "
                         f"(its vision tower is not loaded); remove the image from the prompt")


def check_decode(steps, entropy_bound, t_min, t_max, stability_threshold=None, confidence_threshold=None,
                 name=lambda key: key):
    """DiffusionGemma's decode settings (the official generation config's rules, with a message naming the fix; name:
    the caller's word for a setting, a flag say)."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    lo, hi, stab, conf = name("t_min"), name("t_max"), name("stability_threshold"), name("confidence_threshold")
    if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
        raise ValueError(f"{name('steps')} must be an integer >= 1 (got {steps!r}): the most denoising steps per "
                         f"canvas (the release's generation_config.json: 48)")
    if not (number(entropy_bound) and entropy_bound > 0):
        raise ValueError(f"{name('entropy_bound')} must be a number > 0 (got {entropy_bound!r}): the lowest-entropy "
                         f"token is always accepted, and a larger bound accepts more per step (the release's: 0.1)")
    if (t_min is None) != (t_max is None):
        raise ValueError(f"set both {lo} and {hi}, or neither (got {lo} {t_min!r}, {hi} {t_max!r}): both None (on "
                         f"the command line: none) turn the temperature schedule off")
    if t_min is not None and not (number(t_min) and number(t_max) and 0 <= t_min < t_max):
        raise ValueError(f"the temperature runs from {hi} down to {lo}: need 0 <= {lo} < {hi} (got {lo} {t_min!r}, "
                         f"{hi} {t_max!r}; the release's: 0.4 and 0.8)")
    if (stability_threshold is None) != (confidence_threshold is None):
        raise ValueError(f"set both {stab} and {conf}, or neither: adaptive stopping needs both (both None, on the "
                         f"command line none, turn it off)")
    if stability_threshold is not None and not (isinstance(stability_threshold, int) and stability_threshold >= 0
                                                and number(confidence_threshold) and confidence_threshold > 0):
        raise ValueError(f"{stab} must be an integer >= 0 and {conf} a number > 0 (got {stability_threshold!r}, "
                         f"{confidence_threshold!r}; the release's: 1 and 0.005)")
