"""
archs.py: what each checkpoint architecture needs, one row of ARCHS: which config.json it is (its `model_type`,
`architectures` or keys), how that file reads into the model's settings (model.ModelConfig), the checkpoint's
tensor names, and the config values we refuse because they would change the architecture. model.py dispatches on
this table and never on a folder name. A new checkpoint of a known architecture (LLaDA-1.5: LLaDA; Dream-Coder,
DiffuCoder: Dream) needs no row; a new architecture is a row with its reader and its weight table.
"""
import json
import os
from dataclasses import dataclass
from typing import Callable


# An expert stack stored transposed: each expert's down_proj (dim, ffn) is held in a stack of (experts, ffn, dim).
TRANSPOSED = ("w_down",)


@dataclass(frozen=True)
class MoEConfig:
    n_experts: int
    top_k: int                 # experts per token (num_experts_per_tok)
    ffn_dim: int               # one expert's SwiGLU width (expert_intermediate_size)
    sparse: tuple              # per layer: True = a sparse MoE block, False = a dense MLP of ModelConfig.ffn_dim
    shared_ffn_dim: int = 0    # a shared expert every token goes through beside its routed ones (0: none)
    expert_bias: bool = False  # a learned per-expert bias added to the router's probabilities
    # LLaDA2 (BailingMoeV2) routing: sigmoid scores, the bias for the choice only, the top-k limited to the best
    # `topk_group` of `n_group` groups, the chosen scores renormalised and scaled ("softmax": LLaDA-MoE's router).
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0         # routed_scaling_factor


@dataclass(frozen=True)
class Arch:
    title: str                 # for messages
    family: str                # the decoding family (ModelConfig.family)
    model_types: tuple         # config.json `model_type`s (lower case) it reads; the first is its own
    read: Callable             # config.json dict -> ModelConfig fields (a missing key raises KeyError)
    weights: dict              # our parameter name -> checkpoint tensor name ({} = layer index, then expert index)
    fixed: dict                # config.json keys whose other values change the architecture -> the value we run
    architectures: tuple = ()  # config.json `architectures` names that pick this row over its model_type's own
    keys: tuple = ()           # ... or config.json keys that do (converted copies without `architectures`)
    rope_fp32: bool = False
    shift_logits: bool = False
    causal: bool = False
    mask_token: str | None = None   # config.json names no mask id: this special token's id in the tokenizer files
    generation_ids: tuple = ()      # ids read from generation_config.json, not config.json (the official decode's)
    fused_qkv: bool = False    # q, k, v stored as one projection (LLaDA2's attention.query_key_value)
    module: str = ""           # the nn.Module class that runs it, "file.Class" ("": model.Transformer)
    uniform: bool = False      # uniform-state diffusion: the canvas starts as random tokens, there is no [MASK]
    skip: tuple = ()           # checkpoint tensor-name prefixes never read (a vision tower of a text-only model)
    unpack: Callable = lambda key, read: ((key, read),)   # (name, read) -> the tensors it stores, each (name, read)


def arch_of(hf: dict) -> str | None:
    """The row of ARCHS for a config.json: one named by its `architectures` or its keys, else its model_type's
    own. (LLaDA-MoE's release and dInfer's converted copies say model_type "llada", as the dense LLaDA does.)"""
    kind = str(hf.get("model_type", "")).lower()
    named = hf.get("architectures")
    named = set(named) if isinstance(named, list) and all(isinstance(n, str) for n in named) else set()
    rows = [n for n, a in ARCHS.items() if kind in a.model_types]
    for n in rows:
        if named & set(ARCHS[n].architectures) or ARCHS[n].keys and all(k in hf for k in ARCHS[n].keys):
            return n
    return next((n for n in rows if ARCHS[n].model_types[0] == kind), None)


def hf_sizes(hf: dict, ffn_key: str) -> dict:
    """The widths of a Qwen2 / OLMoE-style config.json (Dream, the guide, LLaDA-MoE)."""
    return dict(vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
                n_heads=hf["num_attention_heads"],
                n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                ffn_dim=hf[ffn_key], rope_theta=hf["rope_theta"], norm_eps=hf["rms_norm_eps"],
                max_seq_len=hf["max_position_embeddings"])


def read_llada(hf: dict) -> dict:
    return dict(vocab_size=hf.get("embedding_size") or hf["vocab_size"], dim=hf["d_model"], n_layers=hf["n_layers"],
                n_heads=hf["n_heads"], n_kv_heads=hf.get("n_kv_heads") or hf["n_heads"], ffn_dim=hf["mlp_hidden_size"],
                rope_theta=hf["rope_theta"], norm_eps=hf["rms_norm_eps"], qkv_bias=bool(hf.get("include_qkv_bias")),
                max_seq_len=hf["max_sequence_length"], mask_id=hf.get("mask_token_id", 126336))


# The checkpoint's small files, for the ids its config.json leaves out (model.read_config).

def read_json(path: str) -> dict:
    """A small JSON file of a checkpoint as a dict; {} if it is missing or unreadable (its owner reports that)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def added_token_id(model_dir: str, content: str) -> int | None:
    """The id of the special token `content` in the folder's tokenizer files (tokenizer.json, tokenizer_config.json,
    added_tokens.json), or None (no file, no such token)."""
    added = read_json(os.path.join(model_dir, "tokenizer.json")).get("added_tokens")
    found = [t.get("id") for t in added if isinstance(t, dict) and t.get("content") == content] if isinstance(
        added, list) else []
    decoder = read_json(os.path.join(model_dir, "tokenizer_config.json")).get("added_tokens_decoder")
    found += [int(i) for i, t in decoder.items() if isinstance(t, dict) and t.get("content") == content
              and str(i).isdigit()] if isinstance(decoder, dict) else []
    found.append(read_json(os.path.join(model_dir, "added_tokens.json")).get(content))
    return next((i for i in found if type(i) is int), None)


# LLaDA-MoE's configuration class stores routing switches its forward never reads (docs/official.md 8): the
# official block always scores with a float32 softmax and never renormalises, scales or groups the top-k. So a
# checkpoint that sets one of them is computed by the official code as if it had not, and its trainer may well
# have meant otherwise: we refuse it rather than guess. The values under which ignoring the key is exact:
MOE_UNREAD = {   # key: (values under which ignoring it is exact, what the official block does, the value to set)
    "moe_router_score_function": ((None, "softmax"), "always scores with a float32 softmax", "softmax"),
    "norm_topk_prob": ((None, False), "hard-codes norm_topk_prob = False (it never reads the key)", False),
    "routed_scaling_factor": ((None, 1), "never scales the routed weights", 1),
    "router_num_group": ((None, -2, -1, 0, 1), "never limits the top-k to groups of experts", None),
}


def read_lladamoe(hf: dict) -> dict:
    """LLaDA-MoE's config.json (configuration_lladamoe.py; docs/official.md 8): every switch the official
    forward reads is implemented; one it stores but ignores is refused unless ignoring it is exact (MOE_UNREAD)."""
    def refuse(key, why):
        raise ValueError(f"config.json sets {key} = {hf[key]!r}; {why}")
    for key, (values, why, fix) in MOE_UNREAD.items():
        if hf.get(key) not in values:
            refuse(key, f"the official LLaDA-MoE forward {why}, so what the checkpoint means is unknown: "
                        f"fastdllm runs {key} = {json.dumps(fix)} only")
    n, freq = hf["num_hidden_layers"], hf["moe_layer_freq"]
    if not (isinstance(freq, list) and len(freq) == n and all(f in (0, 1) for f in freq)):
        refuse("moe_layer_freq", f"it must list 0 (dense MLP) or 1 (sparse MoE) for each of the {n} layers")
    shared, clip, rope = hf.get("shared_expert_intermediate_size"), hf.get("clip_qkv"), hf["partial_rotary_factor"]
    if shared is not None and not (type(shared) is int and shared > 0):
        refuse("shared_expert_intermediate_size", "it must be null (no shared expert) or a positive width")
    if clip is not None and not (type(clip) in (int, float) and clip > 0):
        refuse("clip_qkv", "it must be null or a positive bound")
    if not (type(rope) in (int, float) and 0 < rope <= 1):
        refuse("partial_rotary_factor", "it must be a fraction of the head in (0, 1]")
    moe = MoEConfig(n_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                    ffn_dim=hf["expert_intermediate_size"],
                    sparse=tuple(bool(f) for f in freq), shared_ffn_dim=shared or 0,
                    expert_bias=bool(hf.get("moe_router_enable_expert_bias")))
    if not all(type(v) is int and v > 0 for v in (moe.n_experts, moe.top_k, moe.ffn_dim)) or moe.top_k > moe.n_experts:
        raise ValueError(f"config.json gives num_experts = {moe.n_experts!r}, num_experts_per_tok = {moe.top_k!r}, "
                         f"expert_intermediate_size = {moe.ffn_dim!r}: positive, and top-k at most the experts")
    # The release's config.json has no mask_token_id: read_config looks for "<|mask|>" in its tokenizer.json, and
    # 156895 is the model card's generate(mask_id=156895) (docs/models.md, LLaDA-MoE).
    return dict(hf_sizes(hf, "dense_intermediate_size"), mask_id=hf.get("mask_token_id", 156895),
                qk_norm=bool(hf.get("qk_layernorm")), clip_qkv=clip, rope_fraction=rope, moe=moe)


# Our parameter name -> checkpoint name. Mirrors the checkpoints; the traps are LLaDA's `ff_out` (MLP down-proj
# inside a block, LM head at top level) and `ff_proj` (= gate). A name our model does not have (a bias LLaDA
# does not use, a tied head, a dense layer's experts) is skipped: see checkpoint_names.
LLADA_WEIGHTS = {
    "embed.weight": "model.transformer.wte.weight",
    "layers.{}.attn_norm.weight": "model.transformer.blocks.{}.attn_norm.weight",
    "layers.{}.attn.wq.weight": "model.transformer.blocks.{}.q_proj.weight",
    "layers.{}.attn.wk.weight": "model.transformer.blocks.{}.k_proj.weight",
    "layers.{}.attn.wv.weight": "model.transformer.blocks.{}.v_proj.weight",
    "layers.{}.attn.wq.bias": "model.transformer.blocks.{}.q_proj.bias",      # only with include_qkv_bias
    "layers.{}.attn.wk.bias": "model.transformer.blocks.{}.k_proj.bias",
    "layers.{}.attn.wv.bias": "model.transformer.blocks.{}.v_proj.bias",
    "layers.{}.attn.wo.weight": "model.transformer.blocks.{}.attn_out.weight",
    "layers.{}.mlp_norm.weight": "model.transformer.blocks.{}.ff_norm.weight",
    "layers.{}.mlp.w_gate.weight": "model.transformer.blocks.{}.ff_proj.weight",
    "layers.{}.mlp.w_up.weight": "model.transformer.blocks.{}.up_proj.weight",
    "layers.{}.mlp.w_down.weight": "model.transformer.blocks.{}.ff_out.weight",
    "norm.weight": "model.transformer.ln_f.weight",
    "lm_head.weight": "model.transformer.ff_out.weight",
}
QWEN2_WEIGHTS = {   # Dream, the guide, and LLaDA-MoE's attention and dense layers
    "embed.weight": "model.embed_tokens.weight",
    "layers.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.attn.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attn.wq.bias": "model.layers.{}.self_attn.q_proj.bias",
    "layers.{}.attn.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attn.wk.bias": "model.layers.{}.self_attn.k_proj.bias",
    "layers.{}.attn.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attn.wv.bias": "model.layers.{}.self_attn.v_proj.bias",
    "layers.{}.attn.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.mlp_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "layers.{}.mlp.w_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.mlp.w_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.mlp.w_down.weight": "model.layers.{}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
LLADAMOE_WEIGHTS = QWEN2_WEIGHTS | {
    "layers.{}.attn.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",      # head_dim wide
    "layers.{}.attn.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
    "layers.{}.mlp.router.weight": "model.layers.{}.mlp.gate.weight",               # (experts, dim)
    "layers.{}.mlp.expert_bias": "model.layers.{}.mlp.expert_bias",                 # a buffer in the official model
    "layers.{}.mlp.w_gate.{}": "model.layers.{}.mlp.experts.{}.gate_proj.weight",   # expert e: row e of a stack
    "layers.{}.mlp.w_up.{}": "model.layers.{}.mlp.experts.{}.up_proj.weight",
    "layers.{}.mlp.w_down.{}": "model.layers.{}.mlp.experts.{}.down_proj.weight",   # stored transposed (MoE)
    "layers.{}.mlp.shared.w_gate.weight": "model.layers.{}.shared_expert.gate_proj.weight",
    "layers.{}.mlp.shared.w_up.weight": "model.layers.{}.shared_expert.up_proj.weight",
    "layers.{}.mlp.shared.w_down.weight": "model.layers.{}.shared_expert.down_proj.weight",
}

def read_block(hf: dict, block_key: str) -> dict:
    """A block-diffusion config.json (Fast-dLLM v2: Qwen2.5 with q/k/v biases; SDAR: Qwen3, q/k norm, no biases): its
    trained block, and each layer full attention (a sliding window is not implemented)."""
    kinds = hf.get("layer_types") or []
    if any(k != "full_attention" for k in kinds):
        raise ValueError(f"config.json sets layer_types with {sorted(set(kinds) - {'full_attention'})}; fastdllm "
                         f"implements full attention in every layer only")
    block = hf.get(block_key, 0) if block_key == "block_size" else hf[block_key]   # SDAR's releases name none
    if not (type(block) is int and block >= 0):
        raise ValueError(f"config.json sets {block_key} = {block!r}: the trained block must be a positive integer")
    tied = bool(hf.get("tie_word_embeddings", False))      # the 1.5B / 1.7B releases tie the head, 7B / 8B do not
    return dict(hf_sizes(hf, "intermediate_size"), block=block, tie_embeddings=tied, mask_id=hf.get("mask_token_id"))


def read_sdar(hf: dict) -> dict:
    """SDAR's config.json (JetAstra/SDAR, the JetLM/SDAR-*-Chat remote code configuration_sdar.py): Qwen3 blocks,
    RMSNorm over each head's q and k before RoPE, its own head_dim, no biases (attention_bias is refused)."""
    return dict(read_block(hf, "block_size"), qk_norm=True, head_dim=hf.get("head_dim") or 0,
                mask_id=hf.get("mask_token_id", 151669))


# ----------------------------------------------------------------------------------------------------------
# LLaDA2.0 / LLaDA2.1 (inclusionAI/LLaDA2.0-mini, -flash, LLaDA2.1-mini, -flash; config.json model_type "llada2_moe",
# the remote code's configuration_llada2_moe.py / modeling_llada2_moe.py; docs/models.md, tests/golden/llada2-README.md)

# Keys the release's config.json carries that the official forward never reads: ignoring one is exact only at the
# value the official code hard-codes, and at any other value what the checkpoint means is unknown, so it is refused.
LLADA2_UNREAD = {   # key: (values under which ignoring it is exact, what the official code does)
    "score_function": ((None, "sigmoid"), "always scores the experts with a sigmoid"),
    "norm_topk_prob": ((None, True), "always renormalises the chosen experts' scores (when it picks more than one)"),
    "router_dtype": ((None, "fp32"), "always computes the router in float32"),
    "moe_router_enable_expert_bias": ((None, True), "always adds its stored expert_bias to the scores"),
    "norm_head": ((None, False), "never normalises the LM head"),
    "norm_softmax": ((None, False), "never normalises the softmax"),
    "use_rmsnorm": ((None, True), "always uses RMSNorm"),
    "using_split_qkv_in_self_attention": ((None, False), "always uses the fused query_key_value projection"),
    "use_sliding_window": ((None, False), "never applies a sliding window"),
}


def read_llada2(hf: dict) -> dict:
    """LLaDA2's config.json: every switch the official forward reads is implemented (sigmoid routing with the expert
    bias for the choice only, group-limited top-k, routed_scaling_factor, shared experts, the first
    first_k_dense_replace layers dense, q/k RMSNorm, partial rotary, q/k/v bias); any other value is one line."""
    def refuse(key, why):
        raise ValueError(f"config.json sets {key} = {hf[key]!r}; {why}")
    for key, (values, why) in LLADA2_UNREAD.items():
        if hf.get(key) not in values:
            refuse(key, f"the official LLaDA2 forward {why}, so what the checkpoint means is unknown: fastdllm runs "
                        f"{key} = {json.dumps(values[1])} only")
    n, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    head_dim = hf["hidden_size"] // heads if type(hf["hidden_size"]) is int and type(heads) is int and heads else 0
    if hf.get("head_dim") not in (None, head_dim):
        refuse("head_dim", f"fastdllm runs LLaDA2 with head_dim = hidden_size / num_attention_heads ({head_dim}) only")
    rope = hf.get("partial_rotary_factor", 0.5)         # the official configuration's default
    if not (type(rope) in (int, float) and 0 < rope <= 1):
        refuse("partial_rotary_factor", "it must be a fraction of the head in (0, 1]")
    if hf.get("rotary_dim") not in (None, int(head_dim * rope)):
        refuse("rotary_dim", f"the official code rotates head_dim x partial_rotary_factor = {int(head_dim * rope)} "
                             f"dims and never reads rotary_dim: set it to that or remove it")
    experts, top_k, groups, topk_group = (hf.get(k) for k in ("num_experts", "num_experts_per_tok", "n_group",
                                                               "topk_group"))
    if not all(type(v) is int and v > 0 for v in (experts, top_k, groups, topk_group)):
        raise ValueError(f"config.json gives num_experts = {experts!r}, num_experts_per_tok = {top_k!r}, n_group = "
                         f"{groups!r}, topk_group = {topk_group!r}: each must be a positive integer")
    if experts % groups or experts // groups < 2 or topk_group > groups or top_k > topk_group * (experts // groups):
        raise ValueError(f"config.json's routing does not fit: {experts} experts in n_group = {groups} groups (at "
                         f"least 2 experts each), topk_group = {topk_group} of them, num_experts_per_tok = {top_k} "
                         f"within those: fix the config")
    dense = hf.get("first_k_dense_replace", 0)
    if not (type(dense) is int and 0 <= dense <= n):
        refuse("first_k_dense_replace", f"it must be a layer count in [0, {n}]")
    shared, ffn, scale = hf.get("num_shared_experts"), hf.get("moe_intermediate_size"), hf.get("routed_scaling_factor")
    if shared is not None and not (type(shared) is int and shared > 0):
        refuse("num_shared_experts", "it must be null (no shared expert) or a positive count (0 makes the official "
                                     "model a zero-width shared MLP)")
    if not (type(ffn) is int and ffn > 0):
        raise ValueError(f"config.json gives moe_intermediate_size = {ffn!r}: a positive width")
    if not (type(scale) in (int, float) and scale > 0):
        raise ValueError(f"config.json gives routed_scaling_factor = {scale!r}: a positive number")
    moe = MoEConfig(n_experts=experts, top_k=top_k, ffn_dim=ffn, sparse=tuple(i >= dense for i in range(n)),
                    shared_ffn_dim=ffn * (shared or 0), expert_bias=True, router="sigmoid", n_group=groups,
                    topk_group=topk_group, scale=float(scale))
    # The release's config.json names no mask: 156895 is the official generate()'s mask_id (the tokenizer's <|mask|>).
    return dict(hf_sizes(hf, "intermediate_size"), mask_id=hf.get("mask_token_id", 156895),
                qk_norm=bool(hf.get("use_qk_norm", True)), qkv_bias=bool(hf.get("use_qkv_bias", False)),
                rope_fraction=rope, moe=moe, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                block=32)   # config.json names no block: the official generate()'s default and the card's


# The official module names: word_embeddings, attention.query_key_value (q, k and v heads in that order, one
# tensor), attention.query_layernorm / key_layernorm (head_dim wide), attention.dense (the output), mlp.gate (the
# router, with its expert_bias buffer), mlp.experts.<e>, mlp.shared_experts; a dense layer's mlp is one SwiGLU.
LLADA2_WEIGHTS = {
    "embed.weight": "model.word_embeddings.weight",
    "layers.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.attn.wqkv.weight": "model.layers.{}.attention.query_key_value.weight",
    "layers.{}.attn.wqkv.bias": "model.layers.{}.attention.query_key_value.bias",          # only with use_qkv_bias
    "layers.{}.attn.q_norm.weight": "model.layers.{}.attention.query_layernorm.weight",
    "layers.{}.attn.k_norm.weight": "model.layers.{}.attention.key_layernorm.weight",
    "layers.{}.attn.wo.weight": "model.layers.{}.attention.dense.weight",
    "layers.{}.mlp_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "layers.{}.mlp.w_gate.weight": "model.layers.{}.mlp.gate_proj.weight",                  # the dense layers
    "layers.{}.mlp.w_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.mlp.w_down.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.mlp.router.weight": "model.layers.{}.mlp.gate.weight",                       # (experts, dim)
    "layers.{}.mlp.expert_bias": "model.layers.{}.mlp.gate.expert_bias",                    # a buffer there
    "layers.{}.mlp.w_gate.{}": "model.layers.{}.mlp.experts.{}.gate_proj.weight",           # expert e: row e
    "layers.{}.mlp.w_up.{}": "model.layers.{}.mlp.experts.{}.up_proj.weight",
    "layers.{}.mlp.w_down.{}": "model.layers.{}.mlp.experts.{}.down_proj.weight",           # stored transposed
    "layers.{}.mlp.shared.w_gate.weight": "model.layers.{}.mlp.shared_experts.gate_proj.weight",
    "layers.{}.mlp.shared.w_up.weight": "model.layers.{}.mlp.shared_experts.up_proj.weight",
    "layers.{}.mlp.shared.w_down.weight": "model.layers.{}.mlp.shared_experts.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}

# ----------------------------------------------------------------------------------------------------------
# DiffusionGemma (google/diffusiongemma-26B-A4B-it; config.json model_type "diffusion_gemma", its text model under
# text_config; the official classes: huggingface/transformers v5.23.0, src/transformers/models/diffusion_gemma/;
# docs/diffusiongemma.md). One Gemma 4 stack run two ways: a causal encoder that fills the KV cache and a
# bidirectional decoder that denoises a canvas of random tokens (gemma.py).

@dataclass(frozen=True)
class GemmaConfig:
    """What DiffusionGemma adds to ModelConfig (whose head_dim, n_kv_heads and rope_theta are its sliding layers')."""
    sliding: tuple             # per layer: True = sliding-window attention, False = full attention
    head_dims: tuple           # per layer: one head's width (a full layer's: global_head_dim)
    kv_heads: tuple            # per layer: key/value heads (a full layer's: num_global_key_value_heads)
    window: int                # sliding_window: a sliding layer's encoder query sees the `window` keys up to itself
    full_rope_theta: float
    full_rope_fraction: float  # proportional RoPE (full layers): the share of the head's frequency pairs that rotate
    softcap: float             # final_logit_softcapping: logits = softcap * tanh(logits / softcap)
    canvas: int                # canvas_length: the tokens one canvas denoises
    image_token: int | None    # image_token_id: refused in a prompt (text only)
    decode: tuple = ()         # generation_config.json's decode settings, (name, value) pairs: the call's defaults


# text_config keys -> the values fastdllm implements. The first six are Gemma 4 switches DiffusionGemma's classes never
# read: another value asks for a part (per-layer embeddings, shared KV layers, a double-wide MLP, attention
# softcapping, a V projection on full layers, a dense-only block) the official code does not build either, so what
# the checkpoint means is unknown. The others the official code reads, and another value would change it.
DG_FIXED = {"hidden_size_per_layer_input": (None, 0), "num_kv_shared_layers": (None, 0),
             "use_double_wide_mlp": (None, False), "attn_logit_softcapping": (None,), "attention_k_eq_v": (None, True),
             "enable_moe_block": (None, True), "attention_bias": (None, False),
             "hidden_activation": (None, "gelu_pytorch_tanh"), "tie_word_embeddings": (None, True),
             "use_bidirectional_attention": (None, "vision")}


# generation_config.json's decode settings -> generate()'s (the entropy bound sits in its sampler_config).
DG_DECODE = (("steps", "max_denoising_steps"), ("entropy_bound", "entropy_bound"), ("t_min", "t_min"),
             ("t_max", "t_max"), ("stability_threshold", "stability_threshold"),
             ("confidence_threshold", "confidence_threshold"))


def read_diffusion_gemma(hf: dict) -> dict:
    """DiffusionGemma's config.json: its text_config, the full layers' head size and key/value heads from
    per_layer_config (transformers 5.23 writes it, and it wins) or else the release's global_head_dim /
    num_global_key_value_heads, the two RoPE settings, the MoE sizes, the softcap and canvas_length. Every value
    the official forward reads is implemented; any other is one line naming the key."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("config.json has no text_config object: re-download the checkpoint")

    def refuse(key, why, where="text_config."):
        raise ValueError(f"config.json sets {where}{key} = {json.dumps(hf.get(key) if where == '' else text.get(key))}"
                         f"; {why}")
    if hf.get("tie_word_embeddings", True) is not True:
        refuse("tie_word_embeddings", "the official code then unties the encoder from the decoder, which no release "
                                      "does: fastdllm runs true only", where="")
    for key, values in DG_FIXED.items():
        if text.get(key) not in values:
            refuse(key, f"fastdllm implements DiffusionGemma with {key} = {json.dumps(values[-1])} only")
    n, ints = text["num_hidden_layers"], lambda *v: all(type(x) is int and x > 0 for x in v)
    kinds = text.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    if not (type(n) is int and isinstance(kinds, list) and len(kinds) == n and kinds[-1] == "full_attention"
            and set(kinds) <= {"sliding_attention", "full_attention"}):
        refuse("layer_types", f"it must give sliding_attention or full_attention for each of the {n} layers, the "
                              f"last one full_attention")
    rope = text.get("rope_parameters") or {}
    full, window = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    if not (full.get("rope_type") == "proportional" and full.get("factor", 1.0) == 1.0 and
            window.get("rope_type", "default") == "default" and window.get("partial_rotary_factor", 1.0) == 1.0 and
            0 < full.get("partial_rotary_factor", 1.0) <= 1 and type(full.get("rope_theta")) in (int, float)
            and full["rope_theta"] > 0):
        refuse("rope_parameters", "fastdllm runs proportional RoPE (factor 1) on full layers and default RoPE on "
                                  "sliding ones, as the release sets them")
    head_dim, kv = text["head_dim"], text["num_key_value_heads"]
    per_layer = text.get("per_layer_config")
    if per_layer is None:       # the release's keys: every full layer alike
        glob = {"head_dim": text.get("global_head_dim", 512),
                "num_key_value_heads": text.get("num_global_key_value_heads") or kv}
        per_layer = {str(i): glob for i, k in enumerate(kinds) if k == "full_attention"}
    if not (isinstance(per_layer, dict) and all(isinstance(v, dict) and set(v) <= {"head_dim", "num_key_value_heads"}
                                                and str(k).isdigit() and int(k) < n for k, v in per_layer.items())):
        refuse("per_layer_config", "it must map layer indices to head_dim and num_key_value_heads only")
    layer = [per_layer.get(str(i), {}) for i in range(n)]
    head_dims = tuple(c.get("head_dim", head_dim) for c in layer)
    kv_heads = tuple(c.get("num_key_value_heads", kv) for c in layer)
    heads, experts, top_k, ffn = (text.get(k) for k in ("num_attention_heads", "num_experts", "top_k_experts",
                                                        "moe_intermediate_size"))
    if not ints(heads, *head_dims, *kv_heads) or any(heads % h for h in kv_heads) or any(d % 2 for d in head_dims):
        raise ValueError(f"config.json's attention does not fit: {heads} query heads, head sizes {set(head_dims)}, "
                         f"key/value heads {set(kv_heads)} (each dividing the query heads, head sizes even)")
    if not ints(experts, top_k, ffn) or top_k > experts:
        raise ValueError(f"config.json gives num_experts = {experts!r}, top_k_experts = {top_k!r}, "
                         f"moe_intermediate_size = {ffn!r}: positive, and top-k at most the experts")
    canvas, softcap, sliding_window = hf.get("canvas_length", 256), text.get("final_logit_softcapping", 30.0), \
        text["sliding_window"]
    if not ints(canvas, sliding_window):
        raise ValueError(f"config.json gives canvas_length = {canvas!r}, text_config.sliding_window = "
                         f"{sliding_window!r}: each a positive integer")
    if not (type(softcap) in (int, float) and softcap > 0):
        refuse("final_logit_softcapping", "the official head always softcaps: it must be a positive number")
    gemma = GemmaConfig(sliding=tuple(k == "sliding_attention" for k in kinds), head_dims=head_dims,
                        kv_heads=kv_heads, window=sliding_window, full_rope_theta=full["rope_theta"],
                        full_rope_fraction=full.get("partial_rotary_factor", 1.0), softcap=float(softcap),
                        canvas=canvas, image_token=hf.get("image_token_id"), decode=tuple(
                            (key, hf[name]) for key, name in DG_DECODE if name in hf))
    moe = MoEConfig(n_experts=experts, top_k=top_k, ffn_dim=ffn, sparse=(True,) * n)
    return dict(vocab_size=text["vocab_size"], dim=text["hidden_size"], n_layers=n, n_heads=heads, n_kv_heads=kv,
                head_dim=head_dim, ffn_dim=text["intermediate_size"], rope_theta=window["rope_theta"],
                norm_eps=text["rms_norm_eps"], max_seq_len=text["max_position_embeddings"], mask_id=-1,
                tie_embeddings=True, moe=moe, gemma=gemma)


def unpack_gemma_experts(key: str, read):
    """DiffusionGemma stores each layer's experts stacked: experts.gate_up_proj (experts, 2 * ffn, dim), every
    expert's gate rows then its up rows, and experts.down_proj (experts, dim, ffn). Read once, handed on as one
    tensor per expert and projection, named as DG_WEIGHTS names them (the loader's per-expert path)."""
    if key.endswith(".experts.gate_up_proj"):
        t = read()
        f = t.shape[1] // 2
        return [(f"{key}[{e}].{half}", lambda e=e, h=h: t[e, h * f:(h + 1) * f])
                for e in range(t.shape[0]) for h, half in enumerate(("gate", "up"))]
    if key.endswith(".experts.down_proj"):
        t = read()
        return [(f"{key}[{e}]", lambda e=e: t[e]) for e in range(t.shape[0])]
    return ((key, read),)


# The official save writes the weights the encoder and decoder share once, under the decoder's names; only the
# encoder's layer scalars are its own. lm_head is the embedding (not stored).
DG = "model.decoder.layers.{}."
DG_WEIGHTS = {
    "embed.weight": "model.decoder.embed_tokens.weight",
    "norm.weight": "model.decoder.norm.weight",
    "self_cond.pre_norm.weight": "model.decoder.self_conditioning.pre_norm.weight",
    "self_cond.mlp.w_gate.weight": "model.decoder.self_conditioning.gate_proj.weight",
    "self_cond.mlp.w_up.weight": "model.decoder.self_conditioning.up_proj.weight",
    "self_cond.mlp.w_down.weight": "model.decoder.self_conditioning.down_proj.weight",
    "layers.{}.attn_norm.weight": DG + "input_layernorm.weight",
    "layers.{}.attn.wq.weight": DG + "self_attn.q_proj.weight",
    "layers.{}.attn.wk.weight": DG + "self_attn.k_proj.weight",
    "layers.{}.attn.wv.weight": DG + "self_attn.v_proj.weight",            # sliding layers only (full: V = K)
    "layers.{}.attn.wo.weight": DG + "self_attn.o_proj.weight",
    "layers.{}.attn.q_norm.weight": DG + "self_attn.q_norm.weight",
    "layers.{}.attn.k_norm.weight": DG + "self_attn.k_norm.weight",
    "layers.{}.post_attn_norm.weight": DG + "post_attention_layernorm.weight",
    "layers.{}.mlp_norm.weight": DG + "pre_feedforward_layernorm.weight",
    "layers.{}.mlp.w_gate.weight": DG + "mlp.gate_proj.weight",
    "layers.{}.mlp.w_up.weight": DG + "mlp.up_proj.weight",
    "layers.{}.mlp.w_down.weight": DG + "mlp.down_proj.weight",
    "layers.{}.post_mlp_norm.weight": DG + "post_feedforward_layernorm_1.weight",
    "layers.{}.moe.expert_norm.weight": DG + "pre_feedforward_layernorm_2.weight",
    "layers.{}.moe.router.weight": DG + "router.proj.weight",
    "layers.{}.moe.router_scale": DG + "router.scale",
    "layers.{}.moe.per_expert_scale": DG + "router.per_expert_scale",
    "layers.{}.moe.w_gate.{}": DG + "experts.gate_up_proj[{}].gate",       # unpack_gemma_experts' names
    "layers.{}.moe.w_up.{}": DG + "experts.gate_up_proj[{}].up",
    "layers.{}.moe.w_down.{}": DG + "experts.down_proj[{}]",               # (dim, ffn): loaded transposed
    "layers.{}.post_moe_norm.weight": DG + "post_feedforward_layernorm_2.weight",
    "layers.{}.post_ffn_norm.weight": DG + "post_feedforward_layernorm.weight",
    "layers.{}.scalar": DG + "layer_scalar",
    "layers.{}.encoder_scalar": "model.encoder.language_model.layers.{}.layer_scalar",
}

ARCHS = {
    "llada": Arch("LLaDA-8B", "llada", ("llada",), read_llada, LLADA_WEIGHTS, rope_fp32=True, fixed=dict(
        block_type="llama", layer_norm_type="rms", activation_type="silu", rope=True, alibi=False,
        include_bias=False, weight_tying=False, input_emb_norm=False, scale_logits=False,
        attention_layer_norm=False)),
    "lladamoe": Arch("LLaDA-MoE", "llada", ("lladamoe", "llada"), read_lladamoe, LLADAMOE_WEIGHTS,
                     architectures=("LLaDAMoEModelLM", "LLaDAMoEModel"), keys=("num_experts",), mask_token="<|mask|>",
                     fixed=dict(hidden_act="silu", rope_scaling=None, attention_bias=False, tie_word_embeddings=False)),
    "dream": Arch("Dream-7B", "dream", ("dream",), lambda hf: dict(
        hf_sizes(hf, "intermediate_size"), qkv_bias=True, mask_id=hf["mask_token_id"]), QWEN2_WEIGHTS,
        shift_logits=True, fixed=dict(hidden_act="silu", tie_word_embeddings=False, rope_scaling=None,
                                      use_sliding_window=False)),
    # The guide: Dream's blocks (Qwen2 hard-codes q/k/v biases; there is no attention_bias field), no mask.
    # tie_word_embeddings may be either: Qwen2.5-0.5B..3B tie the head, 7B and up do not.
    "qwen2": Arch("Qwen2.5 guide", "qwen2", ("qwen2",), lambda hf: dict(
        hf_sizes(hf, "intermediate_size"), qkv_bias=True, mask_id=None,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False))), QWEN2_WEIGHTS, causal=True,
        fixed=dict(hidden_act="silu", rope_scaling=None, use_sliding_window=False)),
    # Block diffusion (blockdiff.py): Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_7B and _1.5B, config.json and
    # the remote code modeling.py / configuration.py): Qwen2.5 exactly, made block-causal at inference; the mask id
    # is the tokenizer's |<MASK>| (151665; config.json has none), the pad the tokenizer's (151643).
    "fastdllm_v2": Arch("Fast-dLLM v2", "fastdllm_v2", ("fast_dllm_qwen",), lambda hf: dict(
        read_block(hf, "bd_size"), qkv_bias=True, mask_id=hf.get("mask_token_id", 151665)), QWEN2_WEIGHTS, shift_logits=True, mask_token="|<MASK>|",
        generation_ids=("pad_token_id",), fixed=dict(hidden_act="silu", rope_scaling=None, use_sliding_window=False)),
    # SDAR (JetLM/SDAR-1.7B/4B/8B-Chat; the TraDo models are SDAR checkpoints): Qwen3 made block-causal, no shift.
    "sdar": Arch("SDAR", "sdar", ("sdar",), read_sdar, QWEN2_WEIGHTS | {
        "layers.{}.attn.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
        "layers.{}.attn.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight"}, mask_token="<|MASK|>",
        generation_ids=("eos_token_id", "pad_token_id"),
        fixed=dict(hidden_act="silu", rope_scaling=None, use_sliding_window=False, attention_bias=False)),
    # LLaDA2.x: block diffusion (block 32) on a BailingMoeV2 mixture of experts; its decode is the "llada2" family's.
    # Its config.json names no mask and no end token: the tokenizer's <|mask|>, generation_config.json's eos.
    "llada2_moe": Arch("LLaDA2", "llada2", ("llada2_moe",), read_llada2, LLADA2_WEIGHTS, fused_qkv=True,
                       architectures=("LLaDA2MoeModelLM",), mask_token="<|mask|>", generation_ids=("eos_token_id",),
                       fixed=dict(hidden_act="silu", rope_scaling=None, use_bias=False)),
    # DiffusionGemma: text only. Its end and pad ids are generation_config.json's (the release's config.json also
    # lists the end ids; a converted copy may not).
    "diffusion_gemma": Arch("DiffusionGemma", "diffusion_gemma", ("diffusion_gemma",), read_diffusion_gemma,
                            DG_WEIGHTS, fixed={}, module="gemma.DiffusionGemma", uniform=True,
                            generation_ids=("eos_token_id", "pad_token_id", "max_denoising_steps", "t_min", "t_max",
                                            "stability_threshold", "confidence_threshold", "entropy_bound"),
                            unpack=unpack_gemma_experts,
                            skip=("model.encoder.vision_tower.", "model.encoder.embed_vision.")),
}
WEIGHT_MAP = {name: a.weights for name, a in ARCHS.items()}
