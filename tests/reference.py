"""Naive decodes, written apart from fastdllm.generate(): the oracles the fast paths are tested against.

No cache, no batching tricks, no shared code with the decoding loop or sampler.py: every step is one plain
forward of the whole canvas (`predictions(model, x)`: row i predicts the token at position i, for both families:
the official logits shift, cat(logits[:, :1], logits[:, :-1]), written here apart from the loop's),
and each rule is written from the official formula as docs/official.md records it.

reference_decode: block by block, each step commits the most confident masked token of the block and, with a
threshold, every masked token whose confidence reaches it (Fast-dLLM 3.3, Theorem 1), or with a factor f the top
n-1 by confidence, n the first rank whose confidence is below 1 - f/(n+1) (Fast-dLLM 3.3). Confidence is the
probability of the argmax token (never the mask token itself), in the precision each official sampler uses:
float64 for LLaDA, float32 for Dream. Fast-dLLM's Dream sampler decodes the first token of a block at the
block's first step, whatever its confidence; the first step of a block does that and nothing else.
reference_dream_blocks: Fast-dLLM's Dream block sampler's own schedule (no threshold), with an exact cache.
reference_dream_canvas: Dream's own whole-canvas sampler (`diffusion_generate`), every `alg` that ranks
positions, sampled or greedy, and Fast-dLLM's `confidence_threshold` over the canvas.
Deliberate differences from the official code (docs/parity.md) are kept here too: no proposal is the mask token.
"""
import torch


def predictions(model, x, **kw):
    """model(x) with row i the prediction for the token at position i: a shifted family (Dream, Fast-dLLM v2)
    predicts position i from the output at i - 1, and position 0 keeps its own (the official shift)."""
    logits = model(x, **kw)
    return torch.cat([logits[:, :1], logits[:, :-1]], 1) if model.config.shift else logits


def factor_rule(conf, masked, f: float):
    """Fast-dLLM's factor rule (3.3; docs/official.md 2, `get_transfer_index_dynamic`), row by row: sort the
    candidates' confidences c(1) >= ... >= c(N), find the first rank n >= 2 with c(n) < 1 - f/(n+1) and take the
    top n-1; nobody fails: take all N. Kept as the official code has it: a first failure at the last rank takes
    all N too."""
    take = torch.zeros_like(masked)
    for b in range(conf.shape[0]):
        c = conf[b][masked[b]].sort(descending=True).values.tolist()
        n = len(c)
        for rank in range(2, len(c) + 1):
            if c[rank - 1] < 1 - f / (rank + 1):
                n = rank - 1 if rank < len(c) else len(c)
                break
        take[b, conf[b].topk(n).indices] = True
    return take & masked


@torch.inference_mode()
def reference_decode(model, prompt, gen_length: int, block_length: int, threshold: float | None = None,
                     factor: float | None = None):
    """-> (canvas (B, P + gen_length), model calls). One token per step when threshold and factor are None."""
    cfg = model.config
    B, P = prompt.shape
    x = torch.cat([prompt, torch.full((B, gen_length), cfg.mask_id, dtype=torch.long)], dim=1)
    calls = 0
    for s in range(P, P + gen_length, block_length):
        e, first = s + block_length, True
        while (x[:, s:e] == cfg.mask_id).any():
            logits = predictions(model, x)[:, s:e]                                   # (B, N, V): the block's predictions
            calls += 1
            probs = logits.double().softmax(-1) if cfg.family == "llada" else logits.float().softmax(-1)
            probs[..., cfg.mask_id] = -1                                # never propose the mask itself
            conf, token = probs.max(-1)                                 # (B, N)
            masked = x[:, s:e] == cfg.mask_id
            conf = conf.masked_fill(~masked, float("-inf"))
            if cfg.family == "dream" and first:
                take = torch.zeros_like(masked)
                take[:, 0] = True
            elif factor is not None:
                take = factor_rule(conf, masked, factor)
            else:
                take = torch.zeros_like(masked).scatter_(1, conf.argmax(-1, keepdim=True), True)
                if threshold is not None:
                    take |= conf >= threshold
            take &= masked
            x[:, s:e] = torch.where(take, token, x[:, s:e])
            first = False
    return x, calls


# ---------------------------------------------------------------------------------------------------- Dream
def dream_sample(logits, mask_id: int, temperature=0.0, top_p=None, top_k=None):
    """Dream's `sample_tokens` (docs/official.md 5) on (n, V) logits -> (probs, x0, confidence): divide by the
    temperature, keep the nucleus (tokens until the cumulative probability passes top_p, the first always),
    then the top_k logits, softmax; at T > 0 draw x0 with the official call, torch.distributions.Categorical, from
    the global RNG (the caller seeds it), and its confidence is the drawn token's probability; else the argmax
    and its probability. The mask token is never proposed: its probability is 0 for the draw and the argmax."""
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    floor = torch.finfo(logits.dtype).min
    if top_p is not None and top_p < 1:
        ranked, order = logits.sort(-1, descending=True)
        past = ranked.softmax(-1).cumsum(-1) > top_p
        past = torch.cat([torch.zeros_like(past[:, :1]), past[:, :-1]], -1)    # the token that crosses stays
        logits = logits.masked_fill(torch.zeros_like(past).scatter(-1, order, past), floor)
    if top_k is not None:
        logits = logits.masked_fill(logits < logits.topk(min(top_k, logits.shape[-1]), -1).values[:, -1:], floor)
    probs = logits.softmax(-1)
    allowed = probs.clone()
    allowed[:, mask_id] = 0
    if temperature > 0:
        x0 = torch.distributions.Categorical(probs=allowed).sample()
    else:
        x0 = allowed.argmax(-1)
    return probs, x0, probs.gather(-1, x0[:, None])[:, 0]


def dream_score(alg: str, probs, confidence):
    """How Dream ranks positions (docs/official.md 5): maskgit_plus the proposal's probability, topk_margin the top
    two probabilities' difference, entropy the negative entropy sum p log(p + 1e-10)."""
    if alg == "maskgit_plus":
        return confidence
    if alg == "topk_margin":
        top = probs.sort(-1, descending=True).values
        return top[:, 0] - top[:, 1]
    assert alg == "entropy", alg
    return (probs * torch.log(probs + 1e-10)).sum(-1)


def dream_count(masked, t, s, last: bool) -> int:
    """The official schedule's tokens for the step from time t to s: the batch's average mask count (a float32
    tensor, as the official code divides) times 1 - s/t, floored in float32; everything left at the last step."""
    n = masked.sum() / masked.shape[0]
    return int(n) if last else int(n * (1 - s / t))


def commit_top(x, cols, masked, score, x0, k: int, mask_id: int) -> bool:
    """Write x0 at the k best-scored masked positions of each row of x[:, cols] (-inf elsewhere), in place, with
    the official call (torch.topk over the row). -> whether the choice cut through tied scores: the rule does
    not say which tied position wins (the official code leaves it to torch.topk's order over its own tensor
    width), so a by-value test must not rest on such a step."""
    full = torch.full(masked.shape, float("-inf")).masked_scatter(masked, score)
    props = torch.full(masked.shape, mask_id).masked_scatter(masked, x0)
    best, pick = full.topk(k, -1)
    x[:, cols] = x[:, cols].scatter(1, pick, props.gather(1, pick))
    return left_a_tie(full, best)


def left_a_tie(full, best) -> bool:
    """Whether a row of scores `full` holds, outside its chosen `best` (topk values), a score equal to the
    last chosen one (a finite one): which of the tied positions is chosen is then torch.topk's affair."""
    last = best[:, -1:]
    return bool(((full == last).sum(-1) > (best == last).sum(-1))[last[:, 0] > float("-inf")].any())


@torch.inference_mode()
def reference_dream_blocks(model, prompt, gen_length: int, block_length: int, steps: int, eps: float = 1e-3):
    """Fast-dLLM's Dream block sampler with its default ranking, entropy, and no threshold (docs/official.md 6.2,
    `generation_utils_block.py`), greedy, with every cached call replaced by a full forward (an exact cache).
    Per block: a refresh call decodes the block's first position, whatever its confidence; then call i = 1, 2, ...
    commits dream_count(masks of the block, grid[i], grid[i+1]) tokens by entropy, grid = linspace(1, eps,
    steps per block + 1), until the block is full; the call at i = steps per block is spent and decodes nothing
    (reached only with 1 step per block). -> (canvas, model calls)."""
    cfg, (B, P) = model.config, prompt.shape
    x = torch.cat([prompt, torch.full((B, gen_length), cfg.mask_id, dtype=torch.long)], dim=1)
    per_block = steps // (gen_length // block_length)
    grid, calls = torch.linspace(1, eps, per_block + 1), 0
    for s in range(P, P + gen_length, block_length):
        block = slice(s, s + block_length)
        _, x0, _ = dream_sample(predictions(model, x)[:, s], cfg.mask_id)
        x[:, s], calls, i = x0, calls + 1, 1
        while True:
            logits = predictions(model, x)[:, block]
            calls += 1
            if i == per_block:
                break
            masked = x[:, block] == cfg.mask_id
            probs, x0, conf = dream_sample(logits[masked], cfg.mask_id)
            k = dream_count(masked, grid[i], grid[i + 1], i == per_block - 1)
            if k > 0:
                commit_top(x, block, masked, dream_score("entropy", probs, conf), x0, k, cfg.mask_id)
            i += 1
            if not (x[:, block] == cfg.mask_id).any():
                break
    return x, calls


@torch.inference_mode()
def reference_dream_canvas(model, prompt, gen_length: int, steps: int, alg: str = "entropy", temperature=0.0,
                           top_p=None, top_k=None, eps: float = 1e-3, threshold: float | None = None, seed: int = 0):
    """Dream's whole-canvas sampler (docs/official.md 5, `_sample`): every call ranks all masked positions of the
    canvas; step i of grid = linspace(1, eps, steps + 1) commits dream_count(masks, grid[i], grid[i+1]) tokens per
    row, the best by `alg`. Sampled draws (temperature > 0) come from the global RNG seeded `seed`, one
    Categorical over the masked positions in row-major order per call, as the official code draws; the caller's
    RNG state is restored after. With a threshold, Fast-dLLM's `confidence_threshold` (7.2, batch 1): each call
    offers the gen_length/steps + carry most confident masked positions, takes the first and the others at
    confidence >= threshold, carries the refused to the next call; a refusal at the last scheduled call adds
    one more call with no new quota. -> (canvas, model calls, tokens committed per call, calls whose choice cut
    through tied scores (commit_top))."""
    cfg, B = model.config, prompt.shape[0]
    x = torch.cat([prompt, torch.full((B, gen_length), cfg.mask_id, dtype=torch.long)], dim=1)
    grid, committed, ties, i = torch.linspace(1, eps, steps + 1), [], 0, 0
    quota, carry = gen_length // steps, 0
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        while i < steps:
            masked = x == cfg.mask_id
            probs, x0, conf = dream_sample(predictions(model, x)[masked], cfg.mask_id, temperature, top_p, top_k)
            before = int(masked.sum())
            if threshold is None:
                k = dream_count(masked, grid[i], grid[i + 1], i == steps - 1)
                if k > 0:
                    ties += commit_top(x, slice(None), masked, dream_score(alg, probs, conf), x0, k, cfg.mask_id)
            else:
                offered, carry = quota + carry, 0
                full = torch.full(masked.shape, float("-inf")).masked_scatter(masked, conf)
                best, order = full.topk(offered, -1)
                ties += left_a_tie(full, best)
                take = order[0, torch.cat([torch.tensor([True]), best[0, 1:] >= threshold])]   # the first always
                x[0, take] = torch.full(masked.shape, cfg.mask_id).masked_scatter(masked, x0)[0, take]
                carry = offered - len(take)
                if carry and i == steps - 1:
                    steps, quota = steps + 1, 0
            committed.append(before - int((x == cfg.mask_id).sum()))
            i += 1
    return x, i, committed, ties


@torch.inference_mode()
def reference_fastdllm_v2(model, prompt: list, gen_length: int, G: int, sub: int, threshold: float, stop=None):
    """Fast-dLLM v2's decode (arXiv 2509.26328; NVlabs/Fast-dLLM v2/generation_functions.py), one prompt, written from
    its rules with one plain block-causal forward of the whole canvas per call, no cache: the canvas runs to the grid
    block gen_length / G blocks past the prompt's whole blocks, plus one token. Position p is predicted from the
    output at p - 1. A block's first call (a block that starts at g > 0) is the one that would store the block
    before it: its token at g is the arg-max. Then each sub-block, left to right, until it has no mask: every masked
    position whose probability is > threshold, and always the most likely. stop: the end token; a finished block
    holding it ends the answer, padded after it with `pad` = stop[1]. -> (canvas ids, model calls)."""
    cfg, P = model.config, len(prompt)
    L = (P // G + gen_length // G) * G + 1
    x = torch.tensor([prompt + [cfg.mask_id] * (L - P)])
    q = torch.arange(L)
    mask = (q[None, :] // G <= q[:, None] // G)[None, None]
    calls = 0

    def out():
        nonlocal calls
        calls += 1
        return model(x, mask=mask)[0].float()

    for g in range(P // G * G, L, G):
        if g > 0:
            logits = out()
            if x[0, g] == cfg.mask_id:
                p = logits[g - 1].softmax(-1)
                p[cfg.mask_id] = -1
                x[0, g] = p.argmax()
        for j in range(g, min(g + G, L), sub):
            while (x[0, j:j + sub] == cfg.mask_id).any():
                logits = out()
                p = torch.cat([logits[:1], logits[:-1]])[j:j + sub].softmax(-1)   # p from p - 1 (0: its own)
                p[:, cfg.mask_id] = -1
                conf, tok = p.max(-1)
                masked = x[0, j:j + sub] == cfg.mask_id
                conf = torch.where(masked, conf, torch.tensor(-1.0))
                take = masked & ((conf > threshold) | (torch.arange(len(conf)) == conf.argmax()))
                x[0, j:j + sub][take] = tok[take]
        if stop is not None and g + G < L and (x[0, P:g + G] == stop[0]).any():
            end = P + int((x[0, P:] == stop[0]).nonzero()[0])
            x[0, end + 1:] = stop[1]
            break
    return x[0], calls
