"""
demo/train.py: train a tiny LLaDA-format masked-diffusion model on one-step arithmetic word problems, on a CPU.

The point is a model small enough to train without a big machine that still shows what Fast-dLLM's
confidence-aware parallel decoding does: at threshold 0.9 several tokens are unmasked per step and the
answers stay right; at 0.5 the model commits to mutually inconsistent tokens and they break. For that to be
visible every solution must have *more than one* valid written form (23 + 45 or 45 + 23): a position whose
token depends on a choice made at another position is exactly what unmasking in parallel gets wrong.

Everything here writes the real LLaDA on-disk format (config.json with LLaDA's fields, bf16 safetensors with
LLaDA's tensor names, tokenizer.json), so the model loads through model.load_model and fastdllm.py's CLI:

    python demo/train.py --device cuda         # the shipped demo/llada-arith/: 20,000 steps, ~7 min on one GPU
    python demo/train.py                       # the same on a CPU: ~0.3-0.9 s a step on 2 cores, hours
    python demo/train.py --smoke --out /tmp/m  # a few steps of a tiny config, seconds

Fewer steps are not enough: at 10,000 steps one-token-per-step decoding was valid on only 0.83 of the
held-out problems (0.995 at 20,000).

With --guide the same script trains the *guide* of FlashDLM's guided diffusion (arXiv 2505.21467; docs/official.md 7.2):
a small causal LM in the exact Qwen2.5 on-disk format (config.json with Qwen2's fields, tied head, Qwen2
tensor names), with the same tokenizer, hence the same token ids, and the ordinary next-token loss on the same
problems. Every position is a target, so it learns far faster than the diffusion model:

    python demo/train.py --guide --threads 1   # the shipped demo/qwen2-arith/: 0.45M parameters (dim 128,
                                               # 3 layers, 4 heads / 2 kv heads, MLP 256), 1,500 steps,
                                               # 15 min on one thread of a busy 2-core VM (~8 min idle);
                                               # greedy on its own: valid on 0.990 of 200 held-out problems
"""
import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
from layout import checkpoint_state, fused_parts
from model import ModelConfig, Transformer

HERE = os.path.dirname(os.path.abspath(__file__))
ANSWER_LEN = 32          # the answer is padded with eos to this many tokens: the model learns where to stop
HELDOUT_SEED = 1234      # eval/test problems; their (template, a, b) triples never appear in training

# ----------------------------------------------------------------------------------------------------------
# The task. Every template is 18 tokens long (names, pronouns and objects are one token each, numbers are
# always two digits), so any set of prompts can be batched without padding (LLaDA ignores attention masks).
NAMES = [("Tom", "he"), ("Sam", "he"), ("Anna", "she"), ("Mia", "she")]
OBJECTS = ["apples", "books", "coins", "cards"]
TEMPLATES = [  # (operation, question)
    ("+", "{n} has {a} {o} and buys {b} more. How many {o} does {p} have?"),
    ("+", "A box has {a} {o}. {n} adds {b}. How many {o} are there?"),
    ("-", "{n} has {a} {o} and sells {b}. How many {o} does {p} have left?"),
    ("-", "A box has {a} {o}. {n} takes {b}. How many {o} are left?"),
]


def solutions(op: str, a: int, b: int) -> list[str]:
    """Every valid worked answer. Two forms each, so a token's value depends on a choice made elsewhere."""
    if op == "+":
        c = a + b
        eqs = [f"{a} + {b} = {c}", f"{b} + {a} = {c}"]
    else:
        c = a - b
        eqs = [f"{a} - {b} = {c}", f"{b} + {c} = {a}"]      # take away, or count up from b
    return [f"{eq}. The answer is {c}." for eq in eqs]


def problem(rng: random.Random, template: int | None = None):
    """-> (question, answer forms, key). Numbers are 10..99, with a >= b for subtraction."""
    t = rng.randrange(len(TEMPLATES)) if template is None else template
    op, text = TEMPLATES[t]
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if op == "-" and a < b:
        a, b = b, a
    (n, p), o = rng.choice(NAMES), rng.choice(OBJECTS)
    return text.format(n=n, p=p, o=o, a=a, b=b), solutions(op, a, b), (t, a, b)


def training_problems(rng: random.Random, n: int, excluded: set) -> list:
    """n random problems, none with a held-out (template, a, b): the model is tested on unseen sums."""
    out = []
    while len(out) < n:
        pr = problem(rng)
        if pr[2] not in excluded:
            out.append(pr)
    return out


def heldout(n: int = 500) -> list[tuple[str, list[str], tuple]]:
    """The fixed evaluation problems (distinct triples), shared by eval.py and the tests."""
    rng, out, seen = random.Random(HELDOUT_SEED), [], set()
    while len(out) < n:
        q, sols, key = problem(rng)
        if key not in seen:
            seen.add(key)
            out.append((q, sols, key))
    return out


# ----------------------------------------------------------------------------------------------------------
# Tokenizer: word level, every digit its own token (so 2-3 digit sums are learnable without a huge vocab).
SPECIALS = ["<|endoftext|>", "<|startoftext|>", "<unk>"]   # eos/pad = 0, bos = 1 (unused), unk = 2
MASK = "<|mdm_mask|>"                                      # LLaDA's mask token name; the last id


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    words = {w for _, text in TEMPLATES for w in text.replace(".", " ").replace("?", " ").split()}
    words |= {n for n, p in NAMES} | {p for n, p in NAMES} | set(OBJECTS) | {"The", "answer", "is"}
    words = sorted(w for w in words if not w.startswith("{"))
    vocab = SPECIALS + list("0123456789") + list(".?+-=") + words + [MASK]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    # Decoding: words joined by spaces with no space before "." / "?" (WordPiece's cleanup), then the digits
    # of a number joined back together ("6 8" -> "68"), so decode() gives the text we trained on.
    tok.decoder = decoders.Sequence([decoders.WordPiece(prefix="##", cleanup=True), decoders.Fuse(),
                                     decoders.Replace(Regex(r"(?<=\d) (?=\d)"), "")])
    tok.add_special_tokens(SPECIALS + [MASK])
    return tok


def encode_batch(tok, problems, rng: random.Random):
    """-> (B, P + ANSWER_LEN) ids and P. One of the valid answer forms is drawn 50/50 per problem.
    No bos: the CLI encodes the raw prompt with add_special_tokens=False, so training does the same."""
    prompts = [e.ids for e in tok.encode_batch([q for q, _, _ in problems], add_special_tokens=False)]
    answers = [e.ids for e in tok.encode_batch([rng.choice(s) for _, s, _ in problems], add_special_tokens=False)]
    P = len(prompts[0])
    assert all(len(p) == P for p in prompts), "templates must all have the same token length"
    rows = [p + a + [0] * (ANSWER_LEN - len(a)) for p, a in zip(prompts, answers)]
    return torch.tensor(rows), P


# ----------------------------------------------------------------------------------------------------------
# Training: LLaDA's SFT objective.

def sft_loss(model, x, P: int, mask_id: int, gen: torch.Generator, eps: float = 1e-3):
    """The prompt is never masked; each answer token (eos padding included, so the model learns to stop) is
    masked with probability t ~ U(eps, 1), one t per sample. The cross-entropy on masked tokens is weighted
    by 1/t, which makes it an upper bound on the negative log-likelihood (LLaDA eq. 5), and normalised by
    the answer length as in LLaDA's SFT."""
    B, T = x.shape
    # x and the draws live on the CPU (one generator, the same masks whatever the device); moved after.
    t = (1 - eps) * torch.rand(B, 1, generator=gen) + eps                       # (B, 1)
    masked = torch.rand(B, T, generator=gen) < t
    masked[:, :P] = False
    device = model.lm_head.weight.device
    x, t, masked = x.to(device), t.to(device), masked.to(device)
    logits = model(torch.where(masked, mask_id, x))                            # (B, T, V): no shift in LLaDA
    ce = F.cross_entropy(logits[masked], x[masked], reduction="none")
    return (ce / t.expand(B, T)[masked]).sum() / (B * (T - P))


def causal_loss(model, x, P: int, gen=None):
    """The guide's objective: plain next-token cross-entropy at every position (row i predicts token i+1),
    prompt and eos padding included. `gen` is unused: nothing is drawn."""
    device = model.lm_head.weight.device
    x = x.to(device)
    logits = model(x[:, :-1])                                                  # (B, T-1, V): causal, no shift
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def init_weights(model, gen: torch.Generator):
    # nanoGPT's init: N(0, 0.02) everywhere (nn.Embedding's default N(0, 1) is far too large here), drawn tensor by
    # tensor as the checkpoint stores them (a fused q/k/v or gate/up weight part by part).
    rows = {}
    for fused, part in fused_parts(model).values():
        rows.setdefault(fused, []).append(part)
    for name, p in model.named_parameters():
        with torch.no_grad():
            if p.dim() == 2:                      # matrices; the RMSNorm weights stay at 1
                for part in rows.get(name, [slice(None)]):
                    p[part] = torch.randn(p[part].shape, generator=gen) * 0.02
            elif name.endswith(".bias"):          # the guide's q/k/v biases (Qwen2) start at 0
                p.zero_()

# The field set of LLaDA-8B-Instruct's config.json (values of the 8B model where they are not sizes or ids,
# which save() overwrites), so the demo folder is a real LLaDA checkpoint for any loader.
LLADA_CONFIG = {
    "activation_type": 'silu',
    "alibi": False,
    "alibi_bias_max": 8.0,
    "architectures": ['LLaDAModelLM'],
    "attention_dropout": 0.0,
    "attention_layer_norm": False,
    "attention_layer_norm_with_affine": True,
    "auto_map": {'AutoConfig': 'configuration_llada.LLaDAConfig', 'AutoModelForCausalLM': 'modeling_llada.LLaDAModelLM', 'AutoModel': 'modeling_llada.LLaDAModelLM'},
    "bias_for_layer_norm": False,
    "block_group_size": 1,
    "block_type": 'llama',
    "d_model": 32,
    "embedding_dropout": 0.0,
    "embedding_size": 1024,
    "eos_token_id": 1022,
    "flash_attention": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "init_cutoff_factor": None,
    "init_device": 'meta',
    "init_fn": 'mitchell',
    "init_std": 0.02,
    "input_emb_norm": False,
    "layer_norm_type": 'rms',
    "layer_norm_with_affine": True,
    "mask_token_id": 1000,
    "max_sequence_length": 4096,
    "mlp_hidden_size": 64,
    "mlp_ratio": 4,
    "model_type": 'llada',
    "multi_query_attention": None,
    "n_heads": 4,
    "n_kv_heads": 4,
    "n_layers": 2,
    "pad_token_id": 1022,
    "precision": 'amp_bf16',
    "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05,
    "rope": True,
    "rope_full_precision": True,
    "rope_theta": 500000.0,
    "scale_logits": False,
    "transformers_version": '4.46.3',
    "use_cache": False,
    "vocab_size": 1024,
    "weight_tying": False,
}


# The field set of Qwen2.5-1.5B-Instruct's config.json (FlashDLM's guide for Dream-7B; values of the 1.5B model
# where they are not sizes or ids), so the guide folder is a real Qwen2 checkpoint for any loader.
QWEN2_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 1536,
    "initializer_range": 0.02,
    "intermediate_size": 8960,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 12,
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def hf_config(cfg) -> dict:
    """Our ModelConfig as the family's config.json: every field of the real model's file, our sizes and ids."""
    if cfg.family == "qwen2":
        hf = dict(QWEN2_CONFIG)
        hf.update(hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                  num_key_value_heads=cfg.n_kv_heads, intermediate_size=cfg.ffn_dim, vocab_size=cfg.vocab_size,
                  bos_token_id=cfg.bos_id, eos_token_id=cfg.eos_id, max_position_embeddings=cfg.max_seq_len,
                  sliding_window=cfg.max_seq_len, max_window_layers=cfg.n_layers, rope_theta=cfg.rope_theta,
                  rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings)
        return hf
    hf = dict(LLADA_CONFIG)   # every field of LLaDA-8B's config.json; our sizes and ids below
    hf.update(d_model=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
              mlp_hidden_size=cfg.ffn_dim, vocab_size=cfg.vocab_size, embedding_size=cfg.vocab_size,
              mask_token_id=cfg.mask_id, eos_token_id=cfg.eos_id, pad_token_id=cfg.pad_id,
              max_sequence_length=cfg.max_seq_len, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.norm_eps)
    return hf


def save(model, tok, out: str):
    """Write the folder exactly as the family's checkpoints look: config.json, model.safetensors (bf16, the
    checkpoint's tensor names; a tied head is stored once, as the embedding), tokenizer.json."""
    from safetensors.torch import save_file
    cfg = model.config
    os.makedirs(out, exist_ok=True)
    hf = hf_config(cfg)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    state = {name: t.to(torch.bfloat16).contiguous() for name, t in checkpoint_state(model).items()}
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    tok.save(os.path.join(out, "tokenizer.json"))


def train(out: str, steps: int = 20000, batch: int = 64, lr: float = 2e-3, dim: int = 128, n_layers: int = 4,
          n_heads: int = 4, ffn_dim: int = 384, seed: int = 0, threads: int = 2, device: str = "cpu",
          log_every: int = 100, guide: bool = False, n_kv_heads: int | None = None):
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    tok = build_tokenizer()
    V = tok.get_vocab_size()
    assert tok.token_to_id(MASK) == V - 1 and tok.token_to_id("<|endoftext|>") == 0
    if guide:
        # The guide shares the diffusion model's tokenizer and its V rows (mask included, never a target), so
        # every id means the same token to both models (model.check_guide). bos/eos as the tokenizer's.
        cfg = ModelConfig(family="qwen2", vocab_size=V, dim=dim, n_layers=n_layers, n_heads=n_heads,
                          n_kv_heads=n_kv_heads or n_heads, ffn_dim=ffn_dim, rope_theta=1e6, norm_eps=1e-6,
                          qkv_bias=True, max_seq_len=128, mask_id=None, eos_id=0,
                          bos_id=tok.token_to_id("<|startoftext|>"), tie_embeddings=True)
        loss_fn = causal_loss
    else:
        # 64 positions: the 18-token prompts and 32-token answers it learns fit, and the CLI's default
        # gen-length (fitted to the model, 256 -> 32 here) is then the answer length it was trained for.
        cfg = ModelConfig(family="llada", vocab_size=V, dim=dim, n_layers=n_layers, n_heads=n_heads,
                          n_kv_heads=n_kv_heads or n_heads, ffn_dim=ffn_dim, max_seq_len=64, mask_id=V - 1,
                          eos_id=0, pad_id=0)
        loss_fn = lambda model, x, P, gen: sft_loss(model, x, P, cfg.mask_id, gen)   # noqa: E731
    model = Transformer(cfg)
    init_weights(model, gen)
    model.to(device)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocab {V}, {steps} steps")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = min(200, steps // 10)
    excluded = {key for _, _, key in heldout()}
    t0, smooth = time.time(), None
    for step in range(steps):
        # linear warm-up, then cosine decay to 10% of lr
        frac = (step - warmup) / max(1, steps - warmup)
        for g in opt.param_groups:
            g["lr"] = lr * (step + 1) / warmup if step < warmup else lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        x, P = encode_batch(tok, training_problems(rng, batch, excluded), rng)
        loss = loss_fn(model, x, P, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        smooth = loss.item() if smooth is None else 0.98 * smooth + 0.02 * loss.item()
        if step % log_every == 0 or step == steps - 1:
            print(f"step {step:5d} | loss {loss.item():.4f} (smoothed {smooth:.4f}) | "
                  f"lr {opt.param_groups[0]['lr']:.2e} | {time.time() - t0:.0f}s", flush=True)
    print(f"final loss {smooth:.4f} (smoothed) | wall time {time.time() - t0:.0f}s")
    save(model.eval().cpu(), tok, out)
    print(f"wrote {out}")
    return model


def main(argv=None):
    p = argparse.ArgumentParser(description="Train the tiny LLaDA-format arithmetic model of the demo, or (--guide) "
                                            "its causal Qwen2-format guide.")
    p.add_argument("--guide", action="store_true", help="train the causal guide (demo/qwen2-arith) instead")
    p.add_argument("--out", default=None, help="output model folder (default demo/llada-arith, or demo/qwen2-arith)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 20000, guide 1500)")
    p.add_argument("--batch", type=int, default=64, help="problems per step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (cosine schedule)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, masking and init")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="cpu | cuda (the same seed gives a slightly different model)")
    p.add_argument("--smoke", action="store_true", help="a few steps of a tiny config (a quick plumbing check)")
    args = p.parse_args(argv)
    out = args.out or os.path.join(HERE, "qwen2-arith" if args.guide else "llada-arith")
    common = dict(seed=args.seed, threads=args.threads, device=args.device, guide=args.guide)
    if args.smoke:
        return train(out, steps=10, batch=16, dim=32, n_layers=2, n_heads=2, n_kv_heads=1 if args.guide else 2,
                     ffn_dim=64, log_every=5, **common)
    if args.guide:
        # A quarter of the diffusion model's width budget and no masking noise: ~0.3 s a step on one CPU thread.
        model = train(out, steps=args.steps or 1500, batch=args.batch, lr=args.lr, dim=128, n_layers=3, n_heads=4,
                      n_kv_heads=2, ffn_dim=256, **common)
        print(f"the guide alone: demo/eval.py's guide_greedy; guided decoding: python demo/eval.py --guide {out}")
        return model
    return train(out, steps=args.steps or 20000, batch=args.batch, lr=args.lr, **common)


if __name__ == "__main__":
    main()
