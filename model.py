"""
model.py: tokens -> logits for the masked-diffusion LLM families we run and for the small causal model that
guides them, and nothing else.

- LLaDA-8B / LLaDA-1.5 (config.json `model_type: "llada"`): a Llama-style "llama" block model, plain multi-head
  attention, no biases, SwiGLU MLP, untied LM head, RMSNorm, rotate-half RoPE (theta 500000).
- LLaDA-MoE-7B-A1B (`model_type: "lladamoe"`, or `"llada"` with `LLaDAMoEModelLM`): the same diffusion LM with an
  OLMoE-style block: q/k RMSNorm per head, and a sparse mixture of experts (a router's top-k of 64 experts)
  in place of the MLP (`MoE`, docs/official.md 8).
- LLaDA2.0 / LLaDA2.1 (`model_type: "llada2_moe"`): block diffusion on a BailingMoeV2 block: one fused q/k/v
  projection, q/k RMSNorm, partial RoPE, grouped-query attention, and a sigmoid router limited to the best groups
  of experts (`GroupedMoE`, tests/golden/llada2-README.md); the caller passes the block-causal mask.
- Dream-7B (`model_type: "Dream"`): the Qwen2.5-7B layout with grouped-query attention and q/k/v biases,
  and a next-token LM head, hence the one-position logits shift (see `Transformer.logits`).
- The guide of FlashDLM's guided diffusion (arXiv 2505.21467; docs/official.md 7.2; Qwen2.5-1.5B-Instruct for Dream-7B,
  `model_type: "qwen2"`): the same Qwen2 blocks as Dream, but an ordinary autoregressive LM: causal attention,
  no logits shift, and usually a tied LM head. guided.Guide holds its state (the KV cache of committed text).
- DiffusionGemma (`model_type: "diffusion_gemma"`): a network of its own, gemma.py (a Gemma 4 MoE stack run as a
  causal encoder and a bidirectional decoder), which `build` makes from its row of ARCHS.

The diffusion families are run *bidirectionally*: a diffusion LM predicts every masked position from the whole
canvas, so attention has no causal mask; only the guide masks the future. What each checkpoint architecture needs
(how its config.json reads, its tensor names, what we refuse) is one row of archs.py's `ARCHS`; weights are read
straight from the Hugging Face safetensors, with no `transformers` and no remote code (where each tensor goes:
layout.py). Decoding policies live in sampler.py, the loop in fastdllm.py, the KV cache in cache.py.
"""
import importlib
import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from archs import (ARCHS, TRANSPOSED, WEIGHT_MAP, GemmaConfig, MoEConfig, added_token_id, arch_of,  # noqa: F401
                   read_json)  # (model.WEIGHT_MAP, model.read_json: for callers)
from hub import check_readable, resolve_model_dir  # noqa: F401  (model.resolve_model_dir: the README's import)
from layout import checkpoint_names, fused_parts, stored_at  # noqa: F401  (model.checkpoint_names for callers)


@dataclass
class ModelConfig:
    family: str = "llada"      # the decoding family: "llada" | "dream" | "qwen2" | "llada2" (sampler, chat, checks)
    vocab_size: int = 1024     # rows of the embedding / LM head (LLaDA: `embedding_size`, larger than the tokenizer)
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 4        # < n_heads means grouped-query attention (Dream-7B: 28 query heads, 4 kv heads)
    ffn_dim: int = 64          # the dense MLP's width (LLaDA-MoE: its dense layers', dense_intermediate_size)
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False     # Dream's q/k/v projections have biases, LLaDA's do not
    max_seq_len: int = 4096    # LLaDA `max_sequence_length`, Dream `max_position_embeddings`
    mask_id: int | None = 1000 # the [MASK] token the diffusion process denoises (None: the causal guide has none)
    eos_id: int | None = None
    eos_ids: tuple = ()        # every end-of-text id: config.json may list several (eos_id is the first)
    pad_id: int | None = None
    bos_id: int | None = None
    tie_embeddings: bool = False   # the LM head *is* the embedding matrix (Qwen2.5 <= 3B: tie_word_embeddings)
    arch: str = ""             # the row of ARCHS that reads this checkpoint (default: the family's own)
    qk_norm: bool = False      # RMSNorm over each head's q and k before RoPE (LLaDA-MoE qk_layernorm)
    clip_qkv: float | None = None  # clamp q, k, v to [-c, c] (LLaDA-MoE clip_qkv)
    rope_fraction: float = 1.0     # RoPE rotates the first head_dim * this dims (partial_rotary_factor)
    moe: MoEConfig | None = None
    gemma: GemmaConfig | None = None   # DiffusionGemma's own settings (its row of ARCHS builds gemma.DiffusionGemma)
    head_dim: int = 0          # one head's width (0: dim / n_heads; SDAR's config.json sets its own)
    block: int = 0             # a block-diffusion model's trained block (Fast-dLLM v2 bd_size, SDAR block_size); 0: none
    # The architecture's facts (its row of ARCHS, when not given): the logits shift (Dream, Fast-dLLM v2 keep the
    # AR model's next-token head: hidden state p predicts token p + shift), a causal LM (the guide), float32 RoPE.
    shift: int | None = None
    causal: bool | None = None
    rope_fp32: bool | None = None
    fused_qkv: bool | None = None  # q, k, v stored as one projection (LLaDA2's attention.query_key_value)

    def __post_init__(self):
        if not self.eos_ids and self.eos_id is not None:
            self.eos_ids = (self.eos_id,)
        self.arch = self.arch or self.family
        if not self.head_dim and type(self.dim) is int and type(self.n_heads) is int and self.n_heads > 0:
            self.head_dim = self.dim // self.n_heads      # (read_config refuses sizes that are not ints)
        a = ARCHS[self.arch]
        self.shift = int(a.shift_logits) if self.shift is None else self.shift
        self.causal = a.causal if self.causal is None else self.causal
        self.rope_fp32 = a.rope_fp32 if self.rope_fp32 is None else self.rope_fp32
        self.fused_qkv = a.fused_qkv if self.fused_qkv is None else self.fused_qkv

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope_fraction)    # as HF's default RoPE init rounds it

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Translate a Hugging Face config.json dict through its row of ARCHS (never a folder name)."""
        name = arch_of(hf)
        if name is None:
            known = ", ".join(f"{a.title} (model_type {a.model_types[0]!r})" for a in ARCHS.values())
            raise ValueError(f"unknown model_type {hf.get('model_type')!r} in config.json: fastdllm runs {known} "
                             f"checkpoints")
        a = ARCHS[name]
        for key, value in a.fixed.items():
            if hf.get(key, value) != value:   # an architecture variant we would otherwise load silently wrong
                raise ValueError(f"config.json sets {key} = {hf[key]!r}; fastdllm implements {a.title} with "
                                 f"{key} = {value!r} only")
        # eos_token_id may be a list (Qwen2.5's generation config lists two): every one of them ends the text.
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,)
        return cls(family=a.family, arch=name, eos_id=eos_ids[0] if eos_ids else None, eos_ids=eos_ids,
                   pad_id=hf.get("pad_token_id"), bos_id=hf.get("bos_token_id"), **a.read(hf))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Every official model normalises in float32, casts back, *then* scales by the weight: torch's rms_norm is
        # that round trip in one op, bit for bit (its own weight would scale before the cast: other bits).
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


def rope_cos_sin(pos: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """cos and sin (B, T, 1, rotary_dim) in `dtype` for positions `pos` (B, T), once per call, in float32; sin's first
    half negated (apply_rope)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=pos.device, dtype=torch.float32) / rotary_dim))
    angles = pos.float()[..., None] * inv_freq                      # (B, T, rotary_dim/2)
    emb = torch.cat((angles, angles), dim=-1)[:, :, None]            # (B, T, 1, rotary_dim): rotate-half layout
    cos, sin = emb.cos(), emb.sin()
    half = rotary_dim // 2
    return cos.to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).to(dtype)


def apply_rope(x, cos, sin, fp32: bool):
    """Rotate-half (NeoX / HF Llama) RoPE, as every checkpoint was trained: x * cos + rotate_half(x) * sin, where
    rotate_half(x) = (-x2, x1); with the sign in sin (rope_cos_sin) that is (x2, x1) * sin, the same bits (a product's
    sign is exact). fp32: rotated in float32 and cast back (LLaDA's official RoPE; cos/sin are then float32)."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:   # partial rotary (LLaDA-MoE partial_rotary_factor < 1): the rest of the head passes as is
        return torch.cat((apply_rope(x[..., :rd], cos, sin, fp32), x[..., rd:]), dim=-1)
    dtype = x.dtype
    if fp32:
        x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((x2, x1), dim=-1) * sin).to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        # q, k, v as one matmul: the q heads, the k heads, the v heads (LLaDA2 stores it so; load_model fills it)
        self.parts = {"wqkv": {"wq": cfg.n_heads * hd, "wk": cfg.n_kv_heads * hd, "wv": cfg.n_kv_heads * hd}}
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        if cfg.qk_norm:    # LLaDA-MoE: one head_dim-wide RMSNorm weight, shared by every head
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.norm_eps), RMSNorm(hd, cfg.norm_eps)

    def forward(self, x, cos, sin, kv=None, start=0, mask=None, empty=None):
        B, T, _ = x.shape
        cfg, nh = self.cfg, self.cfg.n_heads
        qkv = self.wqkv(x).view(B, T, -1, cfg.head_dim)              # (B, T, nh + 2 nkv, hd)
        qk, v = qkv[:, :, :nh + cfg.n_kv_heads], qkv[:, :, nh + cfg.n_kv_heads:]
        if cfg.qk_norm:    # per head, before RoPE (docs/official.md 8)
            qk = torch.cat((self.q_norm(qk[:, :, :nh]), self.k_norm(qk[:, :, nh:])), dim=2)
        if cfg.clip_qkv is not None:   # after the q/k norm, as the official attention clamps
            qk, v = qk.clamp(-cfg.clip_qkv, cfg.clip_qkv), v.clamp(-cfg.clip_qkv, cfg.clip_qkv)
        qk = apply_rope(qk, cos, sin, cfg.rope_fp32).transpose(1, 2)    # q's and k's heads rotated together
        q, k, v = qk[:, :nh], qk[:, nh:], v.transpose(1, 2)             # (B, heads, T, hd)
        if kv is not None:
            # Keys are stored after RoPE: a position's rotation never changes, so this equals the official
            # "store raw, rotate every call" bit for bit and saves the re-rotation. kv = (KVCache, layer, slots).
            cache, layer, slots = kv
            k, v = cache.update(layer, k, v, slots)                  # (B, nkv, L, hd): the whole canvas
        if cfg.causal:
            # The guide: the chunk at [start, start+T) sees the cached text [0, start) and itself causally, and
            # nothing after it (cache rows past the chunk hold stale drafts from earlier verifications).
            # SDPA's is_causal aligns the diagonal top-left, which is only right when start == 0; the offset
            # mask tril(diagonal=start) is right for any chunk.
            if kv is not None:
                k, v = k[:, :, :start + T], v[:, :, :start + T]
            causal = torch.ones(T, k.shape[2], dtype=torch.bool, device=x.device).tril(k.shape[2] - T)
            mask = causal if mask is None else mask & causal
        # Otherwise no causal mask: every position sees the whole canvas (the diffusion model is bidirectional).
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
        y = y if empty is None else y.masked_fill(empty, 0.0)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.parts = {"w_gate_up": {"w_gate": hidden, "w_up": hidden}}    # gate and up as one matmul (Attention)
        self.w_gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)                          # SwiGLU


class MoE(nn.Module):
    """
    LLaDA-MoE's sparse block, as its official forward computes it (docs/official.md 8; the remote code's
    LLaDAMoESparseMoeBlock): router probabilities softmax(router(x)) in float32 whatever the dtype, plus the expert
    bias if any (added *before* the top-k and kept in the weights: an official quirk), the top-k of them as weights,
    never renormalised (the official block sets norm_topk_prob = False itself and never reads the config key),
    cast to the activations' dtype; out = sum over the k experts of weight * down(silu(gate(x)) * up(x)), plus the
    shared expert's output if the config has one. The experts are stacked, (experts, ffn, dim) each, so the block
    is a few fixed-shape matmuls: no loop over experts, no shape that depends on the routing, no host sync.
    """
    stacks = ("w_gate", "w_up", "w_down")
    transposed = TRANSPOSED    # (experts, ffn, dim): each expert's down_proj (dim, ffn) is loaded transposed
    act = staticmethod(F.silu)   # SwiGLU experts (DiffusionGemma's are GeGLU)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.top_k = m.top_k
        self.router = nn.Linear(cfg.dim, m.n_experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(m.n_experts, m.ffn_dim, cfg.dim))
        self.w_up = nn.Parameter(torch.empty(m.n_experts, m.ffn_dim, cfg.dim))
        self.w_down = nn.Parameter(torch.empty(m.n_experts, m.ffn_dim, cfg.dim))
        self.expert_bias = nn.Parameter(torch.zeros(m.n_experts)) if m.expert_bias else None
        self.shared = MLP(cfg.dim, m.shared_ffn_dim) if m.shared_ffn_dim else None

    def route(self, x):
        """(N, D) tokens -> their experts' weights (N, k) in float32 and ids (N, k)."""
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)   # (N, E)
        if self.expert_bias is not None:
            probs = probs + self.expert_bias.float()
        return probs.topk(self.top_k, dim=-1)

    def forward(self, x):
        B, T, D = x.shape
        x = x.reshape(B * T, D)                                           # (N, D): routing is per token
        y = self.mix(x, *self.route(x))
        return (y if self.shared is None else y + self.shared(x)).view(B, T, D)

    def mix(self, x, weights, ids):
        """(N, D) tokens, their experts' weights and ids (N, k) each -> the weighted sum of those experts (N, D)."""
        E, Fe, _ = self.w_gate.shape
        weights = weights.to(x.dtype)
        if ids.numel() < E:
            # Fewer (token, expert) pairs than experts (a step of a few tokens): gather the chosen experts' weights
            # by index, as gpt-fast's mixtral-moe does, and read only those.
            w_gate, w_up, w_down = (self.stack(name, ids) for name in MoE.stacks)      # (N, k, ffn, D)
            h = self.act(torch.einsum("nd,nkfd->nkf", x, w_gate)) * torch.einsum("nd,nkfd->nkf", x, w_up)
            y = torch.einsum("nkf,nkfd->nd", h * weights[..., None], w_down)
        else:
            # Otherwise gathered copies (N, k, ffn, D) would move more bytes than the experts themselves: run every
            # expert on every token as one SwiGLU of width E * ffn, weight 0 where a token did not choose it. It
            # reads each expert once; the union of a step's routed experts may be fewer (docs/benchmarks.md).
            combine = x.new_zeros(x.shape[0], E).scatter(1, ids, weights)   # (N, E)
            w_gate, w_up, w_down = (self.stack(name).flatten(0, 1) for name in MoE.stacks)   # (E * ffn, D)
            h = self.act(F.linear(x, w_gate)) * F.linear(x, w_up)                              # (N, E * ffn)
            y = (h.view(-1, E, Fe) * combine[..., None]).flatten(1) @ w_down
        return y

    def stack(self, name: str, ids=None):
        """The stacked weight `name`, the experts `ids` gathered if given. An int8 stack (quantize="int8") is
        dequantized here, after the gather, by its scale per output channel (`name`_scale, (experts, outputs))."""
        w, scale = getattr(self, name), getattr(self, name + "_scale", None)
        if ids is not None:
            w, scale = w[ids], None if scale is None else scale[ids]
        return w if scale is None else w.to(scale.dtype) * scale.unsqueeze(-2 if name in MoE.transposed else -1)


# ----------------------------------------------------------------------------------------------------------
# LLaDA2 (BailingMoeV2): its router. The experts, their two fixed-shape paths and the shared expert are MoE's.

class GroupedMoE(MoE):
    """
    LLaDA2's sparse block (modeling_llada2_moe.py, LLaDA2MoeGate; tests/golden/llada2-README.md): the router's
    logits in float32, sigmoid scores; the expert bias is added for the *choice* only: the experts split into n_group
    groups, a group scores the sum of its two best biased scores, the topk_group best groups stay, and the top-k
    biased scores among their experts are the choice. The weights are the chosen experts' unbiased scores, divided
    by their sum (+1e-20; when more than one is chosen, whatever norm_topk_prob says), times routed_scaling_factor.
    Every step is a fixed-shape tensor op (topk, scatter, masked_fill): no shape depends on the routing, no host sync.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        m = cfg.moe
        self.n_group, self.topk_group, self.scale = m.n_group, m.topk_group, m.scale

    def route(self, x):
        scores = torch.sigmoid(F.linear(x.float(), self.router.weight.float()))      # (N, E), float32
        biased = scores + self.expert_bias.float()
        groups = biased.view(x.shape[0], self.n_group, -1)                            # (N, G, E/G)
        best = groups.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices   # (N, topk_group)
        keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter(1, best, True)     # (N, G)
        ids = biased.masked_fill(~keep.repeat_interleave(groups.shape[-1], dim=1), float("-inf")).topk(
            self.top_k, dim=-1).indices                                                # (N, k)
        weights = scores.gather(1, ids)
        if self.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        sparse = cfg.moe is not None and cfg.moe.sparse[i]
        self.mlp = (GroupedMoE if cfg.moe.router == "sigmoid" else MoE)(cfg) if sparse else MLP(cfg.dim, cfg.ffn_dim)

    def forward(self, x, cos, sin, kv=None, start=0, mask=None, empty=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, kv, start, mask, empty)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # _weight skips nn.Embedding's N(0, 1) init, which on the meta device (load_model) imports torch._dynamo:
        # 2-4 s and 75 MB per process. Loading (and demo/train.py's init) sets every weight anyway.
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=torch.zeros(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight    # one parameter, two uses (Qwen2.5-1.5B: 233M values)

    def forward(self, idx, pos=None, cache=None, start=0, mask=None, logits_range=None):
        """
        idx: (B, T) token ids that sit at canvas positions [start, start+T).
        pos: (B, T) RoPE positions; default start..start+T-1 (padded batches pass their own).
        cache: a cache.KVCache; the chunk's keys/values are written at its canvas slots and the queries attend
            over the whole cached canvas. None = attend over the chunk alone.
        start: the chunk's first canvas position (an int), or its slots as a long tensor: (T,) for every row, or
            (B, T) per row (a slot may be the cache's discard slot). Tensors keep the shapes of a call fixed
            whatever the block, so one compiled graph serves every block (fastdllm.py, compile=True).
        mask: optional bool (B, 1, T, keys) attention mask, True = attend (left padding).
        logits_range: (a, b), or a 1-D tensor of chunk positions, to return logits there only (the LM head
            is the largest matmul of a cached step, and the decoder only needs the block's positions).
        Returns logits (B, T', vocab), row i the output at position i: the token there (LLaDA, SDAR), or the next
        one (a shifted family: Dream, Fast-dLLM v2; the causal guide).
        """
        return self.logits(self.hidden(idx, pos, cache, start, mask), logits_range)

    def hidden(self, idx, pos=None, cache=None, slots=0, mask=None):
        """The chunk through every layer -> hidden states (B, T, dim), before the final norm (forward's arguments).
        Each layer writes the chunk's keys/values into `cache` at `slots` (cache.KVCache.update: an int, the chunk's
        first canvas position; or the slots, (T,) or per row (B, T)) and attends over all the cache holds.
        compile=True and the CUDA graphs run this part: its shapes are the fed span's, whatever the block."""
        B, T = idx.shape
        start = slots                           # the guide's causal offset (an int; Attention)
        slots = slots if isinstance(slots, torch.Tensor) else torch.arange(slots, slots + T, device=idx.device)
        if pos is None:
            pos = slots.expand(B, T)
        cos, sin = rope_cos_sin(pos, self.config.rotary_dim, self.config.rope_theta,
                                torch.float32 if self.config.rope_fp32 else self.embed.weight.dtype)
        # A query row with nothing to attend to (a left pad under Dream's 4D mask) is defined as zero, as torch's CPU
        # kernel returns; some GPU kernels return NaN there instead. Those rows, found once for every layer:
        empty = None if mask is None else ~mask.any(-1, keepdim=True)
        x = self.embed(idx)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, None if cache is None else (cache, i, slots), start, mask, empty)
        return x

    def logits(self, x, rows=None):
        """Hidden states (B, T, dim) -> the LM head's logits at the chunk rows `rows` (a 1-D tensor, (a, b), or None:
        all). Row i is the output at the chunk's position i: for a shifted family (config.shift) that predicts the
        token at i + shift, and the plan asks for the rows that predict its positions (fastdllm.Plan.feed)."""
        if isinstance(rows, tuple):
            rows = torch.arange(*rows, device=x.device)
        return self.lm_head(self.norm(x if rows is None else x[:, rows]))


def skeleton(cfg: ModelConfig) -> nn.Module:
    """The config's network on the meta device: its parameters' names and shapes, and no memory."""
    with torch.device("meta"):
        return build(cfg)


def build(cfg: ModelConfig) -> nn.Module:
    """The network of the config's row of ARCHS: Transformer, or the class the row names (DiffusionGemma)."""
    where, _, name = ARCHS[cfg.arch].module.rpartition(".")
    return getattr(importlib.import_module(where), name)(cfg) if name else Transformer(cfg)


# ----------------------------------------------------------------------------------------------------------
# Loading: a local folder or a Hugging Face repo id -> Transformer, strict, shard by shard, no float32 copy.

def read_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    check_readable(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: {model_dir!r} is not a Hugging Face model folder "
                                f"(it needs config.json and *.safetensors)")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): re-download the checkpoint") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path} is not a config object: re-download the checkpoint")
    arch = ARCHS.get(arch_of(hf))
    if "mask_token_id" not in hf and arch and arch.mask_token:   # the release's config.json names no mask id
        mask = added_token_id(model_dir, arch.mask_token)
        hf = hf if mask is None else dict(hf, mask_token_id=mask)
    generation = read_json(os.path.join(model_dir, "generation_config.json")) if arch and arch.generation_ids else {}
    generation = generation | (generation.get("sampler_config") or {}) if isinstance(generation.get(
        "sampler_config"), dict) else generation              # DiffusionGemma's entropy bound sits in it
    hf = dict(hf, **{k: generation[k] for k in arch.generation_ids if k in generation}) if generation else hf
    hf = dict(hf, eos_token_id=end_ids(model_dir, hf.get("eos_token_id")))
    try:
        cfg = ModelConfig.from_hf(hf)
    except KeyError as e:
        raise ValueError(f"{path} lacks the field {e.args[0]!r} that a {hf.get('model_type')} config has: "
                         f"re-download the checkpoint") from None
    # A size that is not a positive int would fail later as a TypeError deep inside torch.
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
        value = getattr(cfg, name)
        if type(value) is not int or value < 1:
            raise ValueError(f"{path} gives the model {name} = {value!r}, not a positive integer: "
                             f"re-download the checkpoint")
    if cfg.head_dim * cfg.n_heads != cfg.dim and not (hf.get("text_config") or hf).get("head_dim") or \
            cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(f"{path}: a width of {cfg.dim} does not split into {cfg.n_heads} heads, or {cfg.n_heads} "
                         f"heads into {cfg.n_kv_heads} key/value heads: re-download the checkpoint")
    if cfg.rotary_dim < 2 or cfg.rotary_dim % 2:
        raise ValueError(f"{path}: RoPE would rotate {cfg.rotary_dim} of a head's {cfg.head_dim} dims "
                         f"(partial_rotary_factor {cfg.rope_fraction}), not a positive even number: fix the config")
    if not (cfg.causal or arch.uniform) and (type(cfg.mask_id) is not int or not 0 <= cfg.mask_id < cfg.vocab_size):
        raise ValueError(f"{path}: mask_token_id {cfg.mask_id!r} is not a token id below {cfg.vocab_size}: "
                         f"re-download the checkpoint")
    if not all(type(i) is int and i >= 0 for i in cfg.eos_ids):
        raise ValueError(f"{path}: eos_token_id {hf.get('eos_token_id')!r} is not a token id or a list of them: "
                         f"re-download the checkpoint")
    # A string or null here would fail deep inside torch; a theta <= 0 would silently rotate by NaN.
    for key, value in (("rope_theta", cfg.rope_theta), ("rms_norm_eps", cfg.norm_eps)):
        if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{path} gives {key} = {value!r}, not a positive number: re-download the checkpoint")
    return cfg


def end_ids(model_dir: str, eos):
    """config.json's eos_token_id (generation_config.json's where archs.Arch.generation_ids says so), and the
    tokenizer's eos_token (tokenizer_config.json, else special_tokens_map.json) if it is not among them: LLaDA2's
    official generate() ends at <|endoftext|>, which no config.json of its names; Dream-Coder's answer at <|im_end|>."""
    named = [read_json(os.path.join(model_dir, f)).get("eos_token") for f in ("tokenizer_config.json",
                                                                                 "special_tokens_map.json")]
    token = next((t.get("content") if isinstance(t, dict) else t for t in named if t is not None), None)
    found = added_token_id(model_dir, token) if isinstance(token, str) else None
    ids = list(eos) if isinstance(eos, list) else [] if eos is None else [eos]
    return eos if found is None or found in ids else ids + [found]


def shard_files(model_dir: str) -> list[str]:
    """The safetensors files, in the order the index names them (or the single model.safetensors)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    check_readable(index)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError):
            raise ValueError(f"{index} is not a valid safetensors index (no weight_map): re-download it") from None
        files = [os.path.join(model_dir, n) for n in names]
        for p in files:
            check_readable(p)
            if not os.path.isfile(p):
                raise FileNotFoundError(f"shard {os.path.basename(p)} named in {index} is missing: "
                                        f"re-download the checkpoint")
        return files
    single = os.path.join(model_dir, "model.safetensors")
    check_readable(single)
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir!r}: "
                            f"fastdllm loads safetensors checkpoints only")


def load_model(name_or_path: str, device=None, dtype=None, progress=None, quantize=None) -> Transformer:
    """
    Build the model on the meta device (no memory), then read the safetensors shard by shard, tensor by
    tensor, converting each one straight to `dtype` on `device`: an 8B bf16 checkpoint never exists twice,
    nor as a float32 copy. When no conversion is needed (a bf16 checkpoint as bf16 on the CPU), safetensors
    hands out tensors that map the file copy-on-write: nothing is read until a forward pass touches it, and
    the files must not be rewritten in place while the model lives (replacing them is fine). LLaDA-MoE's
    experts are copied one by one into their stacked parameter, allocated once: no second copy either; and so are
    q, k, v (and gate, up) into the fused projection the model holds when a checkpoint stores them apart.
    Strict: a missing, unexpected or misshapen tensor is an error naming it.
    Default: bfloat16 on CUDA, float32 on CPU. progress(shard, n_shards, bytes_done, bytes_total), if given, is
    called after each tensor (bytes of the checkpoint's files; the CLI shows it on stderr).
    quantize="int8": weight-only int8 (quant.py), each weight quantized as it is read and its pages of the file
    let go: the whole model never exists in `dtype`.
    """
    from safetensors import safe_open
    from safetensors import SafetensorError
    try:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError):   # torch's words for "not built with it" / "no such device"
        raise ValueError(f"device {str(device)!r} is not available here: use 'cpu' (or 'cuda' on a machine "
                         f"with CUDA)") from None
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype {dtype!r} is not a torch float dtype: pass torch.float32, torch.bfloat16 or "
                         f"torch.float16")
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    from quant import int8_layout, int8_quantizer, int8_store, int8_targets, read_once
    int8 = int8_quantizer(quantize)      # before any file is read: an unknown quantize or no torchao is one line
    model_dir = resolve_model_dir(name_or_path)
    cfg = read_config(model_dir)
    with torch.device("meta"):
        model = build(cfg)
    params, parts = dict(model.named_parameters()), fused_parts(model)
    names = checkpoint_names(cfg, model)
    targets = int8_targets(model) if int8 else {}
    state, loaded, files, done = {}, set(), shard_files(model_dir), 0
    total = sum(os.path.getsize(p) for p in files)
    for shard, path in enumerate(files, 1):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for stored in f.keys():
                    if stored.startswith(ARCHS[cfg.arch].skip):     # (a vision tower) never read
                        continue
                    reader = lambda k=stored: f.get_tensor(k) if int8 is None else read_once(path, k)  # noqa: E731
                    for key, read in ARCHS[cfg.arch].unpack(stored, reader):   # one tensor, or those it packs
                        ours = names.get(key)
                        if ours is None and key == "lm_head.weight" and cfg.tie_embeddings:
                            raise ValueError("the checkpoint stores lm_head.weight but config.json sets "
                                             "tie_word_embeddings: true (the head is the embedding): set it to false")
                        if ours is None:
                            raise ValueError(f"unexpected tensor {key!r} in {os.path.basename(path)}: this is not a "
                                             f"{ARCHS[cfg.arch].title} checkpoint of the layout config.json describes")
                        if ours in loaded:
                            raise ValueError(f"tensor {key!r} is stored twice (again in {os.path.basename(path)}): "
                                             f"the checkpoint is inconsistent, re-download it")
                        target, where, shape, flip = stored_at(params, parts, ours)
                        # q, k, v, gate, up: copied into rows of a fused weight, through a handle of their own, so
                        # that their pages leave with them (a shard's handle keeps every page it has read)
                        t = read_once(path, key) if key == stored and type(where) is slice else read()
                        if tuple(t.shape) != shape:
                            raise ValueError(f"tensor {key!r} has shape {tuple(t.shape)}, config.json implies "
                                             f"{shape}: the checkpoint and its config disagree")
                        if not t.is_floating_point():
                            raise ValueError(f"tensor {key!r} has dtype {t.dtype}, not a float: this checkpoint is "
                                             f"quantized or corrupt; fastdllm loads float16/bfloat16/float32 weights")
                        if target in targets:
                            int8_store(state, params, target, where, t.to(device=device, dtype=dtype), int8, flip)
                        elif where is None:
                            state[ours] = t.to(device=device, dtype=dtype)
                        else:   # an expert (its row of a stack), or q, k, v, gate, up (rows of a fused weight):
                            if target not in state:      # filled into the one tensor, allocated at its first part
                                state[target] = torch.empty(params[target].shape, device=device, dtype=dtype)
                            state[target][where].copy_(t.t() if flip else t)
                        loaded.add(ours)
                        done += t.nbytes
                        del t
                        if progress:
                            progress(shard, len(files), done, total)
        except SafetensorError as e:
            raise ValueError(f"{os.path.basename(path)} is not a readable safetensors file ({e}): "
                             f"it is truncated or corrupt, re-download it") from None
    missing = [theirs for theirs, ours in names.items() if ours not in loaded]
    if "lm_head.weight" in missing and cfg.family == "qwen2":
        raise ValueError("tensor 'lm_head.weight' is missing from the checkpoint: if its head is the embedding, "
                         "config.json must set tie_word_embeddings: true")
    if missing:
        raise ValueError(f"tensor {missing[0]!r} is missing from the checkpoint ({len(missing)} missing in all): "
                         f"re-download the checkpoint")
    if cfg.tie_embeddings:
        # The head is the embedding: the same tensor under both names, then the same Parameter again
        # (assign=True wraps each name in its own Parameter, which would untie them for training).
        state["lm_head.weight"] = state["embed.weight"]
    int8_layout(model, targets)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval()
