"""
tools/checkpoint.py: random checkpoints in the real on-disk formats (LLaDA and Dream), for benchmarks and
tests that need a model of a given shape and not its knowledge.

    python tools/checkpoint.py /tmp/mid                                  # LLaDA, d_model 512, 4 layers, 126k vocab
    python tools/checkpoint.py /tmp/d --family dream --d-model 256 --layers 2 --vocab 1024 --shards 3
    python tools/checkpoint.py /tmp/dc --release apple/DiffuCoder-7B-Instruct   # a released checkpoint's format
    python tools/checkpoint.py --sizes                                           # their bf16 weight bytes

A checkpoint goes into a new or empty folder only, and its last file, random_checkpoint.json, says that this
tool wrote it and with which settings: bench.py --dir reuses such a folder and refuses every other non-empty
one, so no file of anyone else's is ever overwritten.
"""
import json
import math
import os
import re
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # run as a script from anywhere

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from model import ModelConfig, Transformer, checkpoint_names, fused_parts, load_model, stored_at  # noqa: E402
from tools.flags import Parser, nonempty, shape_arguments, writable  # noqa: E402
from tools import gemma_checkpoint  # noqa: E402

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
    names = sorted(checkpoint_names(cfg).items(), key=layer)      # [(checkpoint name, our name)]
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
# The released checkpoints, each at tiny sizes in its exact on-disk format: config.json with the real keys and
# values except the sizes, the real tensor names and shard count, and the real tokenizer files' special tokens
# (each at its real distance from the end of the vocabulary, so the real vocabulary gets the real ids) and chat
# template. docs/models.md gives each fact's source, and which ones no public copy of the file confirmed.

# Special tokens by real id. LLaDA: docs/official.md 1 (tokenizer_config.json). Qwen2.5's 22, the first 14 special;
# Dream adds <|beginoftext|> and <|mask|> (docs/official.md 3); DiffuCoder-Instruct adds <|dlm_pad|>.
LLADA_TOKENS = {126080: "<|startoftext|>", 126081: "<|endoftext|>", 126082: "[CLS]", 126083: "[gMASK]",
                126336: "<|mdm_mask|>", 126340: "<role>", 126341: "</role>", 126346: "<|start_header_id|>",
                126347: "<|end_header_id|>", 126348: "<|eot_id|>"}
QWEN_TOKENS = dict(enumerate(
    ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
     "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
     "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
     "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"], start=151643))
QWEN_NOT_SPECIAL = set(range(151657, 151665))
DREAM_TOKENS = {**QWEN_TOKENS, 151665: "<|beginoftext|>", 151666: "<|mask|>"}
DIFFUCODER_TOKENS = {**DREAM_TOKENS, 151667: "<|dlm_pad|>"}
REAL_VOCAB = {"llada": 126464, "dream": 152064, "lladamoe": 157184, "fastdllm_v2": 152064, "sdar": 151936,
              "llada2": 157184}   # embedding rows (LLaDA: embedding_size)
# LLaDA-MoE: the Ling 2.0 tokenizer's end of text and mask at the reported ids (dInfer's eos 156892 and mask 156895;
# the mask's name is dllm's, the end's is not confirmed). The role tags its template writes are tokens of it (dllm makes
# <|role_end|> LLaDA-MoE's end of turn) at ids no public copy showed: nothing reads them by id, so the tiny copy
# puts them just above the mask (docs/models.md, LLaDA-MoE).
LLADAMOE_TOKENS = {156892: "<|endoftext|>", 156895: "<|mask|>", 156896: "<role>", 156897: "</role>",
                   156898: "<|role_end|>"}

# Chat templates, written here (jinja, as tokenizer_config.json holds them) to render what each model's own does:
# LLaDA's (docs/official.md 1: bos once, header + trimmed content + <|eot_id|> per message, the assistant header
# always), and ChatML with a default system prompt, in Dream-v0's form (the system inside the loop) and Qwen2.5's
# (before it).
LLADA_TEMPLATE = ("{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
                  "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
                  "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
                  "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}")
DREAM_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                  "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
                  "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
QWEN25_TEMPLATE = ("{%- if messages[0]['role'] == 'system' %}\n"
                   "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n{%- else %}\n"
                   "    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n{%- endif %}\n"
                   "{%- for message in messages %}\n    {%- if not (loop.first and message.role == 'system') %}\n"
                   "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
                   "    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n"
                   "    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")

# Ling 2.0's format, which LLaDA-MoE-Instruct's template is reported to write (docs/models.md: its own template
# text was not seen): the system turn (first system message + newline, then the thinking switch), each message in
# role tags closed by <|role_end|> (a tool-result run as one OBSERVATION turn; an assistant's text after </think>,
# its reasoning kept only after the last question), then the assistant's tag. Tool definitions and calls left out.
LING_TEMPLATE = """{%- set thinking_option = 'off' %}
{{- '<role>SYSTEM</role>' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{% endif %}
{{- 'detailed thinking ' + thinking_option + '<|role_end|>' }}
{%- set ns = namespace(last=messages|length - 1, found=false) %}
{%- for m in messages|reverse %}
    {%- if not ns.found and m.role == 'user' and not (m.content.startswith('<tool_response>')
                                                   and m.content.endswith('</tool_response>')) %}
        {%- set ns.found = true %}{% set ns.last = messages|length - loop.index %}
    {%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{{- '<role>HUMAN</role>' + m.content + '<|role_end|>' }}
    {%- elif m.role == 'system' and not loop.first %}{{- '<role>SYSTEM</role>' + m.content + '<|role_end|>' }}
    {%- elif m.role == 'assistant' %}
        {%- set text = m.content %}{% set thought = '' %}
        {%- if '</think>' in text %}
            {%- set thought = text.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set text = text.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last and thought %}
            {%- set text = '\\n<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' + text %}
        {%- endif %}
        {{- '<role>ASSISTANT</role>' + text + '<|role_end|>' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<role>OBSERVATION</role>' }}{% endif %}
        {{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|role_end|>' }}{% endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<role>ASSISTANT</role>' }}{% endif %}"""

# Dream's generation_config.json (docs/official.md 3, verbatim; its ids follow config.json).
DREAM_GENERATION = dict(_from_model_config=True, alg="origin", alg_temp=None, eps=0.001, mask_token_id=None,
                        output_history=False, steps=512, temperature=0.0, top_k=None, top_p=None,
                        transformers_version="4.46.2")

# Fast-dLLM v2's generation_config.json (Efficient-Large-Model/Fast_dLLM_v2_7B, Qwen2.5-7B-Instruct's; ids follow).
FASTDLLM_V2_GENERATION = dict(do_sample=True, repetition_penalty=1.05, temperature=0.7, top_k=20, top_p=0.8,
                              transformers_version="4.53.1")

# SDAR's generation_config.json (JetLM/SDAR-4B-Chat; ids follow): <|im_end|> and <|endoftext|> end the text.
SDAR_GENERATION = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95, transformers_version="4.51.0")
QWEN3_TOKENS = {**QWEN_TOKENS, 151665: "<tool_response>", 151666: "</tool_response>", 151667: "<think>",
                151668: "</think>", 151669: "<|MASK|>"}
# Qwen3's ChatML (no default system prompt), as SDAR's chat_template.jinja writes a conversation without tools.
QWEN3_TEMPLATE = ("{%- for message in messages %}\n    {{- '<|im_start|>' + message.role + '\\n' + message.content + "
                  "'<|im_end|>\\n' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}"
                  "\n{%- endif %}\n")

LLADA_ROW = dict(family="llada", shape="llada-8b", shards=6, tokens=LLADA_TOKENS, tokenizer="tokenizer.json",
                 tokenizer_class="PreTrainedTokenizerFast", model_max_length=4096, bos="<|startoftext|>",
                 eos="<|endoftext|>", pad="<|endoftext|>", mask="<|mdm_mask|>", template=LLADA_TEMPLATE,
                 template_file=None, ids={}, generation=None)
DREAM_ROW = dict(family="dream", shape="dream-7b", shards=4, tokens=DREAM_TOKENS, tokenizer="slow",
                 tokenizer_class="DreamTokenizer", model_max_length=131072, bos="<|beginoftext|>",
                 eos="<|endoftext|>", pad="<|endoftext|>", mask="<|mask|>", template=DREAM_TEMPLATE,
                 template_file=None, ids=dict(bos_token_id=151643, eos_token_id=151643, pad_token_id=151643),
                 generation=DREAM_GENERATION)
DIFFUCODER_ROW = {**DREAM_ROW, "template": QWEN25_TEMPLATE, "template_file": "chat_template.jinja"}
# LLaDA-MoE: tokenizer.json, the template inside tokenizer_config.json (the file listing has no chat_template.jinja
# and a 4.59 kB tokenizer_config.json), no bos; `config` edits config.json at real values (the release's
# model_type "llada", its config class LLaDAConfig, 8192 positions), `drop` removes keys (no mask_token_id: the
# mask is the tokenizer's <|mask|>). generation_config.json exists; of its fields only config.json's ids are written.
LLADAMOE_ROW = dict(family="lladamoe", shape="lladamoe-7b", shards=3, tokens=LLADAMOE_TOKENS,
                    tokenizer="tokenizer.json", tokenizer_class="PreTrainedTokenizerFast", model_max_length=8192,
                    bos=None, eos="<|endoftext|>", pad="<|endoftext|>", mask="<|mask|>", template=LING_TEMPLATE,
                    template_file=None, ids={}, generation=dict(_from_model_config=True),
                    config=dict(model_type="llada", max_position_embeddings=8192, auto_map={
                        "AutoConfig": "configuration_lladamoe.LLaDAConfig",
                        "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM",
                        "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM"}), drop=("mask_token_id",))
# Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_7B): Qwen2.5's slow tokenizer files (vocab.json, merges.txt,
# added_tokens.json with |<MASK>| at 151665), no bos token, eos <|im_end|>, pad <|endoftext|>, the template in
# chat_template.jinja; config.json: model_type Fast_dLLM_Qwen, bd_size 32, bos 151643, eos = pad 151645, no mask id.
FASTDLLM_V2_ROW = dict(family="fastdllm_v2", shape="fastdllm-v2-7b", shards=4,
                       tokens={**QWEN_TOKENS, 151665: "|<MASK>|"}, tokenizer="slow", tokenizer_class="Qwen2Tokenizer",
                       model_max_length=131072, bos=None, eos="<|im_end|>", pad="<|endoftext|>", mask="|<MASK>|",
                       template=QWEN25_TEMPLATE, template_file="chat_template.jinja", ids={},
                       generation=dict(FASTDLLM_V2_GENERATION, bos_token_id=151643, pad_token_id=151643,
                                       eos_token_id=[151645, 151643]))
# SDAR (JetLM/SDAR-4B-Chat): Qwen3's tokenizer.json, |<MASK|> 151669 an added token not flagged special, eos = pad
# <|endoftext|>, no bos; config.json as the Hub's (no block_size, no mask_token_id: the decode's, the tokenizer's).
SDAR_ROW = dict(family="sdar", shape="sdar-4b", shards=2, tokens=QWEN3_TOKENS, tokenizer="tokenizer.json",
                tokenizer_class="Qwen2Tokenizer", model_max_length=131072, bos=None, eos="<|endoftext|>",
                pad="<|endoftext|>", mask="<|MASK|>", template=QWEN3_TEMPLATE, template_file="chat_template.jinja", ids={},
                not_special=set(range(151657, 151665)) | set(range(151665, 151670)),
                generation=dict(SDAR_GENERATION, bos_token_id=151643, pad_token_id=151643, eos_token_id=[151645, 151643]),
                drop=("block_size", "mask_token_id"))
# LLaDA2.x: the golden tiny config.json's keys (the release's), the Ling 2.0 tokenizer as LLaDA-MoE's plus its bos
# <|startoftext|> (tokenizer_config.json names it; its id was not seen: the tiny copy puts it below the end token),
# the template inside tokenizer_config.json, 32768 positions; generation_config.json: eos = pad = 156892. The shard
# counts were not seen: the mini's is LLaDA2.0-mini-preview's first commit's (7), the flash's the same guess.
LLADA2_TOKENS = {156891: "<|startoftext|>", **LLADAMOE_TOKENS}
LLADA2_ROW = dict(family="llada2", shape="llada2-mini", shards=7, tokens=LLADA2_TOKENS, tokenizer="tokenizer.json",
                  tokenizer_class="PreTrainedTokenizerFast", model_max_length=32768, bos="<|startoftext|>",
                  eos="<|endoftext|>", pad="<|endoftext|>", mask="<|mask|>", template=LING_TEMPLATE,
                  template_file=None, ids={}, drop=("mask_token_id",),
                  generation=dict(eos_token_id=156892, pad_token_id=156892, do_sample=False))
# One row per released checkpoint; `ids` are config.json's special ids (real values), `eos`/`pad`/`bos`/
# `mask` the tokenizer files' tokens, `tokenizer` "tokenizer.json" or Qwen2's "slow" files. The weights' shape at
# real size is SHAPES[shape]; REAL_VOCAB[family] is its vocabulary.
RELEASES = {
    "GSAI-ML/LLaDA-8B-Base": LLADA_ROW,
    "GSAI-ML/LLaDA-8B-Instruct": LLADA_ROW,
    "GSAI-ML/LLaDA-1.5": LLADA_ROW,
    "inclusionAI/LLaDA-MoE-7B-A1B-Base": LLADAMOE_ROW,
    "inclusionAI/LLaDA-MoE-7B-A1B-Instruct": LLADAMOE_ROW,
    "inclusionAI/LLaDA2.0-mini": LLADA2_ROW,
    "inclusionAI/LLaDA2.0-flash": {**LLADA2_ROW, "shape": "llada2-flash"},
    "inclusionAI/LLaDA2.1-mini": LLADA2_ROW,
    "inclusionAI/LLaDA2.1-flash": {**LLADA2_ROW, "shape": "llada2-flash"},
    "Dream-org/Dream-v0-Base-7B": DREAM_ROW,
    "Dream-org/Dream-v0-Instruct-7B": DREAM_ROW,
    # Qwen2.5-Coder's tokenizer: <|im_end|> ends its text; its generation config lists both end tokens.
    "Dream-org/Dream-Coder-v0-Instruct-7B": {**DREAM_ROW, "template": QWEN25_TEMPLATE, "eos": "<|im_end|>",
                                            "ids": dict(bos_token_id=151665, eos_token_id=151643, pad_token_id=151643),
                                            "generation": {**DREAM_GENERATION, "eos_token_id": [151645, 151643]}},
    "apple/DiffuCoder-7B-Base": DIFFUCODER_ROW,
    # Instruct-tuned with a new pad token at fixed length: the tokenizer's pad is <|dlm_pad|>, config.json's stays.
    "apple/DiffuCoder-7B-Instruct": {**DIFFUCODER_ROW, "tokens": DIFFUCODER_TOKENS, "pad": "<|dlm_pad|>"},
    "apple/DiffuCoder-7B-cpGRPO": {**DIFFUCODER_ROW, "tokens": DIFFUCODER_TOKENS, "pad": "<|dlm_pad|>"},
    "Efficient-Large-Model/Fast_dLLM_v2_7B": FASTDLLM_V2_ROW,
    "JetLM/SDAR-4B-Chat": SDAR_ROW,
    "JetLM/SDAR-8B-Chat": {**SDAR_ROW, "shape": "sdar-8b"},
}


def release_bytes(repo: str) -> int:
    """The bf16 bytes of a released checkpoint's weights: its real config's parameter count x 2."""
    shape = SHAPES[RELEASES[repo]["shape"]]
    hf = hf_config(shape["family"], shape["d_model"], shape["n_layers"], shape["vocab"], shape["n_heads"],
                   shape["n_kv_heads"], shape["ffn"], shape.get("head_dim"))
    with torch.device("meta"):
        return 2 * sum(p.numel() for p in Transformer(ModelConfig.from_hf(hf)).parameters())


def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet, in byte order: printable bytes stand for themselves, the others for
    chr(256 + n) (space -> "Ġ", newline -> "Ċ")."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


# A few merges, so the tiny tokenizers are byte-level BPE with merges, as the real ones ("the", " the", "in").
MERGES = [("h", "e"), ("t", "he"), ("Ġ", "the"), ("i", "n"), ("Ġ", "Ġ")]


def write_release_tokenizer(folder: str, row: dict, at) -> None:
    """The row's tokenizer files, its special tokens at ids at(real id): LLaDA's tokenizer.json, or Dream's slow
    files (vocab.json, merges.txt, added_tokens.json); then tokenizer_config.json and special_tokens_map.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: b for b, c in enumerate(byte_chars())}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tokens = {at(i): t for i, t in row["tokens"].items()}
    special = lambda i: i - at(0) not in row.get("not_special", QWEN_NOT_SPECIAL)      # noqa: E731  (i: an id here)
    entry = lambda i: dict(content=tokens[i], lstrip=False, normalized=False, rstrip=False, single_word=False,
                           special=special(i))                 # noqa: E731
    if row["tokenizer"] == "tokenizer.json":
        tok = Tokenizer(models.BPE({**vocab, **{t: i for i, t in tokens.items()}}, MERGES))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([tokens[i] for i in sorted(tokens)])
        tok.save(os.path.join(folder, "tokenizer.json"))
    else:
        files = {"vocab.json": vocab, "added_tokens.json": {t: i for i, t in tokens.items()}}
        for name, obj in files.items():
            with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                json.dump(obj, f, ensure_ascii=False, indent=2)
        with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES))
    names = {f"{k}_token": row[k] for k in ("bos", "eos", "pad") if row[k]}      # LLaDA-MoE names no bos
    config = {"add_bos_token": False, "add_eos_token": False,
              "added_tokens_decoder": {str(i): entry(i) for i in sorted(tokens)}, **names,
              "model_max_length": row["model_max_length"], "tokenizer_class": row["tokenizer_class"]}
    if row["template_file"] is None:
        config["chat_template"] = row["template"]
    else:
        with open(os.path.join(folder, row["template_file"]), "w", encoding="utf-8") as f:
            f.write(row["template"])
    special_map = {**{k: entry(next(i for i in tokens if tokens[i] == v)) for k, v in names.items()},
                   "additional_special_tokens": [tokens[i] for i in sorted(tokens) if special(i)]}
    if row["tokenizer"] == "slow":     # Dream's tokenizer class names its mask
        special_map["mask_token"] = row["mask"]
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=2)


def make_release(folder: str, repo: str, d_model: int = 64, n_layers: int = 2, vocab: int = 1024, n_heads: int = 4,
                 n_kv_heads: int = 2, ffn: int = 192, seed: int = 0) -> int:
    """A random checkpoint of the released `repo` (RELEASES) at these sizes, in its exact format: config.json,
    generation_config.json, the weights in its real shards, its tokenizer files and chat template. Every special id
    keeps its real distance from the end of the vocabulary: vocab=REAL_VOCAB[family] gives the real ids.
    Returns the weights' bytes."""
    row = RELEASES[repo]
    if held_checkpoint(folder, folder) is not None:
        raise ValueError(f"{folder} already holds a checkpoint: pass a new or empty folder")
    at = lambda i: i - REAL_VOCAB[row["family"]] + vocab       # noqa: E731  (a real id -> its id here)
    hf = hf_config(row["family"], d_model, n_layers, vocab, n_heads, n_kv_heads, ffn)
    hf.update({key: at(i) for key, i in row["ids"].items()})
    hf = {k: v for k, v in {**hf, **row.get("config", {})}.items() if k not in row.get("drop", ())}
    total = write_weights(folder, hf, row["shards"], 1.13, 13.0, seed, "cpu")
    files = {"config.json": hf}
    if row["generation"] is not None:
        eos = row["generation"].get("eos_token_id")      # a real id (or list of them), else config.json's
        eos = hf["eos_token_id"] if eos is None else [at(i) for i in eos] if isinstance(eos, list) else at(eos)
        files["generation_config.json"] = {**row["generation"],
                                           **{k: at(row["generation"][k]) if k in row["generation"] else hf[k]
                                              for k in ("bos_token_id", "pad_token_id") if k in hf or k in row["generation"]},
                                           "eos_token_id": eos}
    for name, obj in files.items():
        with open(os.path.join(folder, name), "w") as f:
            json.dump(obj, f, indent=2)
    write_release_tokenizer(folder, row, at)
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump(dict(written_by="tools/checkpoint.py", release=repo, config=hf, seed=seed), f, indent=2)
    return total


# ----------------------------------------------------------------------------------------------------------
# Command line: the shape flags (tools/flags.py, shared with bench.py modes / sweep)

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
    n_tensors = len(checkpoint_names(ModelConfig.from_hf(hf)))
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


def main(argv=None):
    p = Parser(prog="tools/checkpoint.py", description="Write a random checkpoint in the real on-disk format.")
    p.add_argument("out", type=nonempty, nargs="?", help="the folder to write (new or empty)")
    p.add_argument("--release", choices=[*RELEASES, gemma_checkpoint.REPO], metavar="REPO", help="a released "
                   "checkpoint's exact format at tiny sizes (tests' size; no shape flags): "
                   + ", ".join([*RELEASES, gemma_checkpoint.REPO]))
    p.add_argument("--sizes", action="store_true", help="print each released checkpoint's bf16 weight bytes at its "
                   "real size (parameters x 2), then exit")
    shape_arguments(p)
    p.add_argument("--tokenizer", action="store_true", help="also write a word-level tokenizer.json with the "
                   "family's special tokens (lladamoe), for the command line")
    args = p.parse_args(argv)
    if args.tokenizer and args.family not in TOKENIZER_SPECIALS:
        raise ValueError(f"--tokenizer writes {', '.join(TOKENIZER_SPECIALS)} tokenizers only: for {args.family}, "
                         f"copy a real tokenizer into the folder")
    if args.sizes:
        for repo in RELEASES:
            print(f"{repo}: {release_bytes(repo):,} bytes ({release_bytes(repo) / 1e9:.2f} GB)")
        # DiffusionGemma (tools/gemma_checkpoint.py): its text model, and what one token reads (top-8 of 128 experts)
        total, active = gemma_checkpoint.sizes()
        print(f"{gemma_checkpoint.REPO}: {2 * total:,} bytes ({2 * total / 1e9:.2f} GB); active per token "
              f"{2 * active:,} bytes ({2 * active / 1e9:.2f} GB, {active / 1e9:.2f}B parameters)")
        return
    if not args.out:
        raise ValueError("no folder to write: pass one (or --sizes)")
    if args.release:
        changed = sorted(k for k in SHAPE_DESTS if getattr(args, k) != p.get_default(k))
        if changed:
            raise ValueError(f"--{changed[0].replace('_', '-')} does not apply with --release, which writes the "
                             f"release's tiny test size: drop it")
        held_checkpoint(args.out, args.out)
        size = (gemma_checkpoint.make_gemma_release(args.out) if args.release == gemma_checkpoint.REPO else
                make_release(args.out, args.release))
        print(f"{args.out}: {args.release} at tiny sizes, {size / 1e6:.2f} MB of weights")
        return
    hf = shape_config(args)
    held_checkpoint(args.out, args.out)
    check_fits(hf, args.out, torch.device("cpu"), torch.bfloat16)    # the shards are made in bf16 in memory
    size = write(args.out, args)
    if args.tokenizer:
        write_word_tokenizer(args.out, args.family)
    print(f"{args.out}: {size / 1e9:.3f} GB")


SHAPE_DESTS = {"family", "d_model", "layers", "heads", "kv_heads", "ffn", "vocab", "shards", "gain", "logit_std"}

if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
