"""
shapes.py: random checkpoints of a given shape, in the real on-disk formats of LLaDA, Dream, LLaDA-MoE, Fast-dLLM v2,
SDAR and LLaDA2, for the benchmark (apps/bench.py: a model of a shape and not its knowledge) and the tests; the shape
flags' config (shape_config, flags.py), whether it fits this machine, and a folder that may hold it (--dir).
tools/checkpoint.py is the command line that writes them, and the released formats at tiny sizes.

A checkpoint goes into a new or empty folder only, and its last file, random_checkpoint.json, says that this
tool wrote it and with which settings: bench.py --dir reuses such a folder and refuses every other non-empty
one, so no file of anyone else's is ever overwritten.
"""
import json
import math
import os
import re
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from flags import writable
from layout import checkpoint_names, fused_parts, stored_at
from model import ModelConfig, Transformer, load_model, skeleton

ROOT = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(ROOT, "tests", "golden")
MARKER = "random_checkpoint.json"   # written last: a folder holding it is a whole checkpoint this tool wrote

# The real models' shapes (docs/official.md 1 and 3) and the small ones measured on a CPU.
SHAPES = {
    "llada-8b": dict(family="llada", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn=12288, vocab=126464),
    "dream-7b": dict(family="dream", d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn=18944, vocab=152064),
    "llada-tiny": dict(family="llada", d_model=64, n_layers=2, n_heads=2, n_kv_heads=2, ffn=192, vocab=1024),
    "dream-tiny": dict(family="dream", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=192, vocab=1024),
    # LLaDA-MoE-7B-A1B (docs/models.md: 16 layers, every one sparse, 64 experts of width 1024, top-8; `ffn` is
    # dense_intermediate_size, which no layer of the release uses).
    "lladamoe-7b": dict(family="lladamoe", d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16, ffn=8192,
                        vocab=157184, experts=64, top_k=8, expert_ffn=1024),
    # Fast-dLLM v2 7B: Qwen2.5-7B-Instruct's widths (Efficient-Large-Model/Fast_dLLM_v2_7B config.json).
    "fastdllm-v2-7b": dict(family="fastdllm_v2", d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn=18944,
                           vocab=152064),
    # SDAR-4B-Chat (JetLM/SDAR-4B-Chat config.json): Qwen3-4B's widths, heads of 128 (not 2560 / 32).
    "sdar-4b": dict(family="sdar", d_model=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn=9728, vocab=151936,
                    head_dim=128),
    "sdar-8b": dict(family="sdar", d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn=12288, vocab=151936,
                    head_dim=128),
    # LLaDA2.x-mini and -flash (their config.json: 256 experts of 512 / 1024, top-8 within 4 of 8 groups, one shared
    # expert, layer 0 dense of `ffn`, head_dim 128; docs/models.md).
    "llada2-mini": dict(family="llada2", d_model=2048, n_layers=20, n_heads=16, n_kv_heads=4, ffn=5120, vocab=157184,
                        experts=256, top_k=8, expert_ffn=512),
    "llada2-flash": dict(family="llada2", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=4, ffn=9216,
                         vocab=157184, experts=256, top_k=8, expert_ffn=1024),
}
# Special ids keep their distance from the end of the vocabulary, so the real vocabulary gets the real ids
# (LLaDA: mask 126336, eos = pad 126081; Dream: mask 151666, bos = eos = pad 151643).
SPECIALS_FROM_END = {"llada": dict(mask=128, eos=383), "dream": dict(mask=398, eos=421),
                     "lladamoe": dict(mask=289, eos=292),    # LLaDA-MoE: mask 156895, eos = pad 156892 of 157184
                     # Fast-dLLM v2: |<MASK>| 151665 (the tokenizer's), eos <|im_end|> 151645, pad/bos 151643
                     "fastdllm_v2": dict(mask=399, eos=419, pad=421),
                     # SDAR: <|MASK|> 151669, <|endoftext|> 151643 (bos = eos = pad) of 151936
                     "sdar": dict(mask=267, eos=293),
                     "llada2": dict(mask=289, eos=292)}      # LLaDA2: the same tokenizer and ids as LLaDA-MoE
REAL_VOCAB = {"llada": 126464, "dream": 152064, "lladamoe": 157184, "fastdllm_v2": 152064, "sdar": 151936,
              "llada2": 157184}   # embedding rows (LLaDA: embedding_size)
# Fast-dLLM v2's generation_config.json (Efficient-Large-Model/Fast_dLLM_v2_7B, Qwen2.5-7B-Instruct's; ids follow).
FASTDLLM_V2_GENERATION = dict(do_sample=True, repetition_penalty=1.05, temperature=0.7, top_k=20, top_p=0.8,
                              transformers_version="4.53.1")
# SDAR's generation_config.json (JetLM/SDAR-4B-Chat; ids follow): <|im_end|> and <|endoftext|> end the text.
SDAR_GENERATION = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95, transformers_version="4.51.0")
GOLDEN_CONFIG = {"llada": "llada-tiny", "dream": "dream-tiny", "lladamoe": "lladamoe-tiny", "fastdllm_v2": "fastdllm-v2-tiny",
                 "sdar": "sdar-tiny"}


def hf_config(family: str, d_model: int, n_layers: int, vocab: int, n_heads: int, n_kv_heads: int,
              ffn: int, head_dim: int | None = None) -> dict:
    """config.json with every field the real one has: the golden tiny checkpoint's (a copy of the real
    file at small sizes), resized."""
    if family == "lladamoe":
        return lladamoe_config(d_model, n_layers, vocab, n_heads, n_kv_heads, ffn)
    if family == "llada2":
        return llada2_config(d_model, n_layers, vocab, n_heads, n_kv_heads, ffn)
    with open(os.path.join(GOLDEN, GOLDEN_CONFIG[family], "config.json")) as f:
        cfg = json.load(f)
    mask, eos = vocab - SPECIALS_FROM_END[family]["mask"], vocab - SPECIALS_FROM_END[family]["eos"]
    if family == "fastdllm_v2":   # its config.json names no mask id (the tokenizer's |<MASK>| is), pad = eos
        pad = vocab - SPECIALS_FROM_END[family]["pad"]
        cfg.update(hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                   num_key_value_heads=n_kv_heads, intermediate_size=ffn, vocab_size=vocab, bos_token_id=pad,
                   eos_token_id=eos, pad_token_id=eos, layer_types=["full_attention"] * n_layers,
                   max_window_layers=n_layers)
    elif family == "sdar":       # the GitHub training copy's keys (block_size, mask_token_id; the Hub's lack them)
        cfg.update(hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                   num_key_value_heads=n_kv_heads, intermediate_size=ffn, vocab_size=vocab, mask_token_id=mask,
                   bos_token_id=eos, eos_token_id=eos, max_window_layers=n_layers,
                   head_dim=head_dim or max(2 * (d_model // n_heads), 2))
    elif family == "llada":   # mlp_ratio stays 4 as in the real file, whose mlp_hidden_size is 3x d_model
        cfg.update(d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, mlp_hidden_size=ffn,
                   embedding_size=vocab, vocab_size=vocab, mask_token_id=mask, eos_token_id=eos, pad_token_id=eos,
                   max_sequence_length=4096)
    else:
        cfg.update(hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                   num_key_value_heads=n_kv_heads, intermediate_size=ffn, vocab_size=vocab, mask_token_id=mask,
                   bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    return cfg


def lladamoe_config(d_model: int, n_layers: int, vocab: int, n_heads: int, n_kv_heads: int, ffn: int,
                    experts: int = 64, top_k: int = 8, expert_ffn: int | None = None, **switches) -> dict:
    """LLaDA-MoE's config.json: the golden tiny one's keys and values (written by the official classes), resized,
    every layer sparse as in the release; `switches` set any other key (qk_layernorm, clip_qkv, moe_layer_freq,
    moe_router_enable_expert_bias, shared_expert_intermediate_size, partial_rotary_factor, ...).
    Defaults: the release's 64 experts, top-8, each expert half as wide as the model (1024 of 2048)."""
    with open(os.path.join(GOLDEN, "lladamoe-tiny", "config.json")) as f:
        cfg = json.load(f)
    mask, eos = vocab - SPECIALS_FROM_END["lladamoe"]["mask"], vocab - SPECIALS_FROM_END["lladamoe"]["eos"]
    cfg.update(hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
               num_key_value_heads=n_kv_heads, dense_intermediate_size=ffn, vocab_size=vocab, num_experts=experts,
               num_experts_per_tok=top_k, expert_intermediate_size=expert_ffn or d_model // 2,
               moe_layer_freq=[1] * n_layers, mask_token_id=mask, eos_token_id=eos, pad_token_id=eos)
    return dict(cfg, **switches)


def llada2_config(d_model: int, n_layers: int, vocab: int, n_heads: int, n_kv_heads: int, ffn: int,
                  experts: int = 256, top_k: int = 8, expert_ffn: int | None = None, **switches) -> dict:
    """LLaDA2's config.json: the golden tiny one's keys and values (the release's file at small sizes: every key of
    it, written for the official classes), resized; `switches` set any other key (n_group, topk_group,
    num_shared_experts, first_k_dense_replace, use_qk_norm, use_qkv_bias, partial_rotary_factor, ...). The release
    names no mask id (the tokenizer's <|mask|> is 156895): below the real vocabulary mask_token_id says where it is.
    Defaults: the release's 256 experts, top-8, each expert a quarter as wide as the model (512 of 2048)."""
    with open(os.path.join(GOLDEN, "llada2-tiny", "config.json")) as f:
        cfg = json.load(f)
    head_dim = d_model // n_heads
    eos = vocab - SPECIALS_FROM_END["llada2"]["eos"]
    cfg.update(hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
               num_key_value_heads=n_kv_heads, head_dim=head_dim, intermediate_size=ffn, vocab_size=vocab,
               num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_ffn or d_model // 4,
               n_group=8, topk_group=4, pad_token_id=eos)
    if vocab != REAL_VOCAB["llada2"]:
        cfg["mask_token_id"] = vocab - SPECIALS_FROM_END["llada2"]["mask"]
    cfg = dict(cfg, **switches)
    cfg["rotary_dim"] = int(head_dim * cfg["partial_rotary_factor"])   # the release's: head_dim x the factor
    return cfg


def make_checkpoint(folder: str, family: str, d_model: int, n_layers: int, vocab: int, n_heads: int | None = None,
                    n_kv_heads: int | None = None, ffn: int | None = None, shards: int = 1, gain: float = 1.13,
                    logit_std: float = 13.0, seed: int = 0, device="cpu", **moe) -> int:
    """
    Write a random bf16 checkpoint in the real layout into `folder`: config.json, the real tensor names
    (model.WEIGHT_MAP, which the golden tests check against the official formats), one model.safetensors or
    `shards` files plus model.safetensors.index.json. Returns the weights' size in bytes.

    Weights are N(0, (gain / sqrt(d_model))^2) and norms 1; the LM head has std logit_std / sqrt(d_model),
    so logits have std ~logit_std. Why not the models' init_std 0.02 everywhere: at width 512 it makes
    attention flat, every masked position then gets the same hidden state and the same confidence, and a
    126k-way softmax at that scale never reaches 0.9; a parallel rule would commit all of a block or one
    token per step. These defaults (std 0.05 at width 512, ~0.018 at 4096, close to 0.02) spread them: on
    the 512-wide checkpoint of docs/benchmarks.md, the first step's confidences have deciles 0.41 (10%) to
    0.99 (90%), 30% of positions at >= 0.9, and threshold 0.9 commits ~2.5 tokens per call.
    device: where the random numbers are drawn ("cuda" writes an 8B checkpoint in seconds, not minutes).
    Defaults: head_dim 128 (both real models), ffn 3x d_model (LLaDA-8B's ratio).
    moe: LLaDA-MoE's experts, top_k, expert_ffn and any other config.json key (lladamoe_config). Its expert
    bias, if enabled, is N(0, 0.01^2) (the official buffer starts at zero; a trained one is not).
    """
    n_heads = n_heads or max(1, d_model // 128)
    shape = (d_model, n_layers, vocab, n_heads, n_kv_heads or n_heads, ffn or 3 * d_model)
    hf = (lladamoe_config(*shape, **moe) if family == "lladamoe" else llada2_config(*shape, **moe)
          if family == "llada2" else hf_config(family, *shape))
    if held_checkpoint(folder, folder) is not None:
        raise ValueError(f"{folder} already holds a checkpoint: pass a new or empty folder")
    total = write_weights(folder, hf, shards, gain, logit_std, seed, device)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if family == "fastdllm_v2":    # the mask id is the tokenizer's, the pad generation_config.json's
        write_fastdllm_v2_ids(folder, hf)
    if family == "sdar":           # the end ids the official decode stops at
        with open(os.path.join(folder, "generation_config.json"), "w") as f:
            json.dump(dict(SDAR_GENERATION, bos_token_id=hf["eos_token_id"], pad_token_id=hf["eos_token_id"],
                           eos_token_id=[hf["eos_token_id"] + 2, hf["eos_token_id"]]), f, indent=2)
    if family == "dream":   # Dream's from_pretrained requires it; its ids follow config.json
        with open(os.path.join(GOLDEN, "dream-tiny", "generation_config.json")) as f:
            gc = json.load(f)
        gc.update(bos_token_id=hf["bos_token_id"], eos_token_id=hf["eos_token_id"], pad_token_id=hf["pad_token_id"])
        with open(os.path.join(folder, "generation_config.json"), "w") as f:
            json.dump(gc, f, indent=2)
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump(dict(written_by="tools/checkpoint.py", **spec(hf, shards, gain, logit_std, seed)), f, indent=2)
    return total


def write_fastdllm_v2_ids(folder: str, hf: dict):
    """A random Fast-dLLM v2 checkpoint's ids where the release keeps them: |<MASK>| in added_tokens.json (one of
    its tokenizer files), the pad in generation_config.json (the release's, its ids shifted with the vocabulary)."""
    vocab = hf["vocab_size"]
    with open(os.path.join(folder, "added_tokens.json"), "w") as f:
        json.dump({"|<MASK>|": vocab - SPECIALS_FROM_END["fastdllm_v2"]["mask"]}, f, indent=2)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(dict(FASTDLLM_V2_GENERATION, bos_token_id=hf["bos_token_id"], pad_token_id=hf["bos_token_id"],
                       eos_token_id=[hf["eos_token_id"], hf["bos_token_id"]]), f, indent=2)


def write_weights(folder: str, hf: dict, shards: int, gain: float, logit_std: float, seed: int, device) -> int:
    """The random bf16 weights of the config `hf` in the real layout (see make_checkpoint) -> their bytes."""
    cfg = ModelConfig.from_hf(hf)
    d_model = cfg.dim
    with torch.device("meta"):
        model = Transformer(cfg)
    params, parts = dict(model.named_parameters()), fused_parts(model)
    shapes = {ours: stored_at(params, parts, ours)[2] for ours in checkpoint_names(cfg, model).values()}  # as stored

    def layer(item):   # the checkpoints store tensors layer by layer: embeddings, blocks 0..n-1, norm, head
        ours = item[1]
        m = re.match(r"layers\.(\d+)\.", ours)
        return (1, int(m[1])) if m else (0, 0) if ours.startswith("embed") else (2, 0)
    names = sorted(checkpoint_names(cfg, model).items(), key=layer)   # [(checkpoint name, our name)]
    sizes = [math.prod(shapes[ours]) * 2 for _, ours in names]
    total = sum(sizes)
    # Shard i holds the tensors whose middle falls in the i-th part of the bytes, as HF's sharding does.
    shard_of, offset = [], 0
    for n in sizes:
        shard_of.append(min(shards - 1, int((offset + n / 2) / total * shards)))
        offset += n
    files = (["model.safetensors"] if shards == 1 else
             [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)])
    os.makedirs(folder, exist_ok=True)
    gen = torch.Generator(device).manual_seed(seed)
    for i, file in enumerate(files):
        tensors = {}
        for (theirs, ours), s in zip(names, shard_of):
            if s != i:
                continue
            shape = shapes[ours]
            if ours.endswith("norm.weight"):
                t = torch.ones(shape)
            elif ours.endswith("expert_bias"):
                t = torch.randn(shape, generator=gen, device=device).mul_(0.01)
            else:
                std = (logit_std if ours == "lm_head.weight" else gain) / d_model ** 0.5
                t = torch.randn(shape, generator=gen, device=device).mul_(std)
            tensors[theirs] = t.to(torch.bfloat16).cpu()
        save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
        del tensors
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {t: files[s] for (t, _), s in zip(names, shard_of)}}
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return total


def spec(hf: dict, shards: int, gain: float, logit_std: float, seed: int = 0) -> dict:
    """What decides a random checkpoint's files: MARKER holds it, and a folder is reused only for the same."""
    return dict(config=hf, shards=shards, gain=gain, logit_std=logit_std, seed=seed)


def held_checkpoint(folder: str, what: str) -> dict | None:
    """Where a random checkpoint may go: a new or empty folder -> None; a folder this tool wrote -> its MARKER's
    spec. Anything else is refused in one line (`what` names it: "--dir D" or the folder): a file, a folder that
    holds other files (never overwritten), a place we cannot write."""
    if os.path.isdir(folder):
        try:
            entries = os.listdir(folder)
        except OSError as e:
            raise ValueError(f"cannot read {what}: {e.strerror}") from None
        if MARKER in entries:
            try:
                with open(os.path.join(folder, MARKER)) as f:
                    held = json.load(f)
                held.pop("written_by")
                return held
            except (OSError, ValueError, KeyError, AttributeError):
                raise ValueError(f"{what}: its {MARKER} is unreadable or not this tool's: pass a new or empty "
                                 f"folder") from None
        if entries:
            raise ValueError(f"{what} is not empty and holds no checkpoint written by tools/checkpoint.py (or its "
                             f"writing was cut short): pass a new or empty folder; nothing in it is overwritten")
    elif os.path.lexists(folder):
        raise ValueError(f"{what} is a file, not a folder: pass a new or empty folder")
    parent = os.path.abspath(folder)
    while not os.path.lexists(parent):          # the folder, or the nearest part of its path that exists
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"cannot write {what}: {parent} is a file, not a folder")
    if not writable(parent):
        raise ValueError(f"cannot write {what}: the folder {parent} is not writable")
    return None


# The special tokens a tokenizer for a random checkpoint gets, at the config's ids. LLaDA-MoE: <|mask|> (the
# mask token dllm-trainer's tokenizer fix-up names; id 156895 in the model card) and <|endoftext|> (eos 156892; the
# name is not confirmed by a public copy of the file: docs/models.md).
TOKENIZER_SPECIALS = {"lladamoe": {"mask_token_id": "<|mask|>", "eos_token_id": "<|endoftext|>"}}


def write_word_tokenizer(folder: str, family: str):
    """A word-level tokenizer.json over the checkpoint's vocabulary: token i is "w{i}", except the family's
    special tokens (TOKENIZER_SPECIALS) at config.json's ids, so `python fastdllm.py --model folder` runs offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    specials = {hf[key]: content for key, content in TOKENIZER_SPECIALS[family].items()}
    vocab = {specials.get(i, f"w{i}"): i for i in range(hf["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()   # joins words with spaces
    tok.add_special_tokens(list(specials.values()))
    tok.save(os.path.join(folder, "tokenizer.json"))


def random_prompts(cfg: ModelConfig, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """(batch, length) ids below every special id (mask, eos, pad, bos), so no prompt holds one."""
    top = min(i for i in (cfg.mask_id, cfg.eos_id, cfg.pad_id, cfg.bos_id, cfg.vocab_size) if i is not None)
    return torch.randint(0, top, (batch, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------------
# The shape flags (flags.py shape_arguments, shared with bench.py modes / sweep and tools/checkpoint.py)

def shape_config(args) -> dict:
    """The config.json the shape flags describe; a combination no model can have is one line naming them."""
    heads = args.heads or max(1, args.d_model // 128)
    kv = args.kv_heads or heads
    if args.d_model % heads or (args.d_model // heads) % 2:
        raise ValueError(f"--d-model {args.d_model} does not split into --heads {heads} heads of an even size "
                         f"(RoPE rotates pairs): pick heads dividing d_model / 2")
    if heads % kv:
        raise ValueError(f"--kv-heads {kv} does not divide --heads {heads}")
    low = max(SPECIALS_FROM_END[args.family].values()) + 1
    if args.vocab < low:
        raise ValueError(f"--vocab {args.vocab} is too small for {args.family}: its special ids sit up to "
                         f"{low - 1} below the top, so use --vocab >= {low}")
    hf = hf_config(args.family, args.d_model, args.layers, args.vocab, heads, kv, args.ffn or 3 * args.d_model)
    cfg = ModelConfig.from_hf(hf)
    n_tensors = len(checkpoint_names(cfg, skeleton(cfg)))
    if args.shards > n_tensors:
        raise ValueError(f"--shards {args.shards} exceeds the checkpoint's {n_tensors} tensors")
    return hf


def check_fits(hf: dict, folder: str, device, dtype):
    """A shape too large for this machine is one line now, not a full disk halfway through the write or a
    process killed for memory: the bf16 files must fit the free disk, and on a CPU the loaded weights in RAM."""
    with torch.device("meta"):
        n = sum(p.numel() for p in Transformer(ModelConfig.from_hf(hf)).parameters())
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    if 2 * n > free:
        raise ValueError(f"the shape flags describe a {2 * n / 1e9:.1f} GB checkpoint, more than the "
                         f"{free / 1e9:.1f} GB free at {existing}: pick smaller --d-model, --layers or --vocab")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    need = n * dtype.itemsize
    if device.type == "cpu" and ram and need > ram:
        raise ValueError(f"the shape flags describe {n / 1e9:.1f}B parameters, {need / 1e9:.1f} GB in {dtype} "
                         f"(more than this machine's {ram / 1e9:.1f} GB of memory): pick smaller --d-model, "
                         f"--layers or --vocab")


def write(folder: str, args) -> int:
    """make_checkpoint with the shape flags."""
    return make_checkpoint(folder, args.family, args.d_model, args.layers, args.vocab, args.heads, args.kv_heads,
                           args.ffn, shards=args.shards, gain=args.gain, logit_std=args.logit_std)


def reusable(args, hf) -> bool:
    """--dir: whether it holds the checkpoint the flags describe (reused), or may take one (a new or empty
    folder); any other folder is refused, before anything is written or loaded."""
    if not args.dir:
        return False
    held = held_checkpoint(args.dir, f"--dir {args.dir}")
    if held is not None and held != spec(hf, args.shards, args.gain, args.logit_std):
        raise ValueError(f"--dir {args.dir} holds a checkpoint written with other flags (shape, --shards, --gain or "
                         f"--logit-std; see its {MARKER}): pass those flags, or another --dir")
    return held is not None


def load_random(args, hf, device, dtype):
    """Write (or reuse, with --dir) the random checkpoint the shape flags describe, and load it."""
    if args.dir:
        if not reusable(args, hf):
            write(args.dir, args)
        return load_model(args.dir, device=device, dtype=dtype, quantize=args.quantize)
    folder = tempfile.mkdtemp(prefix="fastdllm_bench_")
    try:
        write(folder, args)
        return load_model(folder, device=device, dtype=dtype, quantize=args.quantize)
    finally:   # the loaded model holds its own copy (float32) or the mapped pages (bf16)
        shutil.rmtree(folder, ignore_errors=True)
