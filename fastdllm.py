"""
fastdllm.py: fast inference for masked-diffusion LLMs (LLaDA-8B, Dream-7B): generate(), its plan and the one loop.

A diffusion LM generates by denoising: the answer starts as gen_length [MASK] tokens, and each model call
("step", counted as NFE) predicts every masked position at once and commits some. generate() decides once
(`make_plan`) four parts a fork can replace: the cache policy (cache.py: Fast-dLLM's prefix and DualCache,
arXiv 2505.22618 section 3.2, FlashDLM's FreeCache, arXiv 2505.21467), the step rule (sampler.py: how LLaDA and
Dream propose; guided.py: FlashDLM's guided diffusion), the selection rule (Fast-dLLM's threshold and factor
decoding, section 3.3) and the stop rule. Then one loop, each step feed -> propose -> select -> commit -> stop,
at fixed shapes within a block and with one host sync, so compile=True captures each model call as one graph.

    python fastdllm.py --prompt "What is 7 * 8?"                    # LLaDA-8B-Instruct, dual cache, tau 0.9
    python fastdllm.py --model demo/llada-arith --gen-length 32 --prompt "Tom has 23 apples and buys 45 more. How many apples does he have?"
"""
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import checks
import sampler as S
from cache import CACHE_POLICIES, Feed, KVCache, Refresh, Step
from guided import guided_parts
from model import Compiled, logits_at, padding  # noqa: F401  (Compiled: fastdllm.Compiled for callers)


@dataclass
class Settings:
    """Every setting of generate(model, prompt, **settings), with its default (None: the family's or the method's).
    The four hooks (cache, propose, select, stop) also take a fork's own part (README "Fork it")."""
    gen_length: int = 128              # tokens to generate
    block_length: int | None = 32      # semi-autoregressive block; None = one block (Dream: its own sampler)
    steps: int | None = None           # denoising steps over the answer (default gen_length: 1 token/step)
    cache: str | Feed = "none"         # "none" | "prefix" | "dual" | "free", or a cache.Feed policy
    threshold: float | None = None     # Fast-dLLM 3.3: commit every token with confidence >= threshold
    factor: float | None = None        # Fast-dLLM 3.3: factor-based parallel decoding
    select: Callable | None = None     # a selection rule: rule(proposal, at) -> (B, N) bool (sampler.py)
    propose: object | None = None      # a step rule: .propose(logits, at) -> sampler.Proposal (sampler.StepRule)
    stop: Callable | None = None       # a stop rule: rule(x, at, proposal) -> (B,) bool rows ended (sampler.py)
    temperature: float = 0.0           # 0 = greedy
    remasking: str | None = None       # LLaDA "low_confidence" | "random"; Dream's alg (default "entropy")
    top_p: float | None = None         # Dream's sampling options
    top_k: int | None = None
    alg_temp: float | None = None
    eps: float = 1e-3                  # Dream's time grid runs from 1 down to eps
    refresh_every_step: bool = False   # feed the whole canvas every step (checks the cache plumbing)
    stop_at_eos: bool | int = False    # True: stop after a finished block holding an end token; k: FlashDLM's rule
    eos_ids: list | None = None        # the end tokens (default the config's)
    compile: bool | object = False     # torch.compile the model call (CUDA: CUDA graphs), one graph per feed
                                       #   shape; a Compiled instance keeps its graphs' cache across calls
    guide: torch.nn.Module | None = None   # FlashDLM guided diffusion: a causal LM with the same token ids
    speculative: bool = False          # guided: commit the guide's token at the first rejection
    accept: str = "deterministic"      # guided: "deterministic" | "topk" | "topk_relative" | "dynamic_threshold" |
                                       #   "aggressive"
    accept_k: int = 5                  # guided top-k and topk_relative
    accept_ratio: float = 0.95         # guided topk_relative ratio
    accept_threshold: float = 0.1      # guided dynamic_threshold: p(draft) > this
    verify_chunk: int = 32             # guided: drafts verified per guide forward


# The command line's defaults where they differ from generate()'s: the methods' headline setting (Fast-dLLM's
# DualCache with threshold 0.9) and early stop at the end of text. cli.py, serve.py and harness.py read them.
CLI_DEFAULTS = dict(gen_length=256, cache="dual", threshold=0.9, stop_at_eos=True)


def pad_prompts(rows: list[list[int]], pad_id: int):
    """Prompts of different lengths -> (ids (B, P), attention_mask (B, P)), left-padded so that every answer
    starts at the same canvas position."""
    P = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (P - len(r)) + list(r) for r in rows])
    return ids, (torch.arange(P) >= torch.tensor([[P - len(r)] for r in rows])).long()


@dataclass
class Plan:
    """What one generate() call decided before its loop: the blocks and the parts the loop calls."""
    blocks: list              # [(s, e)] the semi-autoregressive blocks of the answer
    feed: Feed                # cache.py: which span each step feeds
    rule: S.StepRule          # the family's step rule (start_block, more)
    propose: Callable         # its propose, -> sampler.Proposal    (these three: checks.checked_hooks)
    select: Callable          # the selection rule
    stop: Callable            # the stop rule
    model: torch.nn.Module
    call: Callable            # logits_at, eager or compiled
    kv: KVCache | None
    pos: torch.Tensor         # (B, L) RoPE positions
    mask: torch.Tensor | None # (B, 1, L, L) attention mask of padded rows
    shift: int                # the family's logits shift
    mask_id: int
    calls_per_block: int      # the fewest calls a block takes (for calls_saved)
    eos: torch.Tensor         # the end-of-text ids
    ar: torch.Tensor          # arange(L): slots and columns as views, no kernel
    P: int                    # the prompt's length, then gen_length positions to generate
    gen_length: int

    def at(self, x, n: int, i: int, s: int, e: int, open_cols: list) -> Step:
        """Where this step stands: the cache policy's span (checked to cover every open position; for a shifted
        family, widened by one to the position before the first open one), and the block columns to predict."""
        at = Step(n, i, s, e, x, x[:, s:e] == self.mask_id, self.shift)
        a, b = checks.check_span(self.feed, at, open_cols)
        cols = torch.tensor(open_cols, dtype=torch.long, device=x.device)   # the LM head: the open columns only
        return at._replace(span=(a, b), refresh=(a, b) == (0, x.shape[1]), cols=cols)

    def forward(self, x, at: Step):
        """The model on the fed span -> (logits (B, n, V) at the block columns at.cols, NaN/inf flag)."""
        a, b = at.span
        slots = self.feed.slots(at, a, b)
        slots = self.ar[a:b] if slots is None else slots
        rows = (at.cols + (at.s - a)).clamp(0, b - a - 1)      # chunk rows of the block columns
        return self.call(self.model, x[:, a:b], self.pos[:, a:b], self.kv, slots,
                         None if self.mask is None else self.mask[:, :, a:b], rows)

    def record(self, x, at: Step, p: S.Proposal, take, ended, bad, stats) -> tuple[bool, list]:
        """The step's one host read: the hooks' checks (NaN/inf logits, a proposal opening a committed position, a
        selection outside p.open), every row ended?, the stats' counts, the block's open columns."""
        stats["row_nfe"] = stats.get("row_nfe", 0) + at.cand.any(-1)          # device tensors until the end
        stats["row_committed"] = stats.get("row_committed", 0) + take.sum(-1)
        head = torch.stack([bad, (p.open & ~at.cand).any(), (take & ~p.open).any(), ended.all(), take.sum(),
                            (x[:, self.P:] == self.mask_id).sum()])
        v = torch.cat([head, (x[:, at.s:at.e] == self.mask_id).any(0)]).tolist()
        checks.check_step(*v[:3], at, self.rule, self.select)
        ended, committed, left = v[3:6]
        stats["nfe"] += 1
        stats["fed"].append(at.span[1] - at.span[0])
        stats["committed"].append(committed)
        stats["filled"].append(stats.get("left", x.shape[0] * self.gen_length) - left - committed)
        stats["left"], stats["guide_calls"] = left, getattr(self.rule, "guide_calls", 0)
        return bool(ended), [c for c, m in enumerate(v[6:]) if m]

    def finish(self, x, stats: dict, t0: float) -> dict:
        torch.cuda.synchronize(x.device) if x.is_cuda else None
        stats["seconds"], _ = time.perf_counter() - t0, stats.pop("left")
        stats["row_nfe"], stats["row_committed"] = stats["row_nfe"].tolist(), stats["row_committed"].tolist()
        end = torch.isin(x[:, self.P:], self.eos)     # tokens/s counts answers, never end-of-text filler
        stats["answer_tokens"] = int(torch.where(end.any(-1), end.long().argmax(-1), end.shape[1]).sum())
        stats["tokens_per_s"] = stats["answer_tokens"] / max(stats["seconds"], 1e-9)
        return stats


def family_rules(cfg, st, whole_canvas: bool, n_blocks: int, generator, device):
    """The call's step rule and selection rule, decided once (fastdllm.make_plan): a fork's, or the family's."""
    select = st.select or (S.Threshold(st.threshold) if st.threshold is not None else
                           S.Factor(st.factor) if st.factor is not None else S.Schedule())
    parallel = getattr(select, "parallel", True)
    if st.propose is not None:
        return st.propose, select
    if cfg.family == "llada":
        return S.LLaDA(st.steps // n_blocks, st.temperature, st.remasking, generator, cfg.mask_id), select
    args = (st.steps, n_blocks, st.block_length, st.temperature, st.remasking, st.top_p, st.top_k, st.eps,
            generator, cfg.mask_id, device, parallel)
    origin, tau = st.remasking == "origin" and not parallel, st.threshold
    rule = (S.DreamCanvas(*args, until_done=tau is not None, origin=origin) if whole_canvas else
            (S.DreamFree if st.cache == "free" else S.Dream)(*args))
    select = S.QuotaThreshold(tau) if whole_canvas and tau is not None else select
    if st.alg_temp and not parallel and not origin:    # the official widths: the canvas, the fed chunk, the block
        pad = ((lambda at: (at.s, 0)) if whole_canvas else (lambda at: (0, 0)) if st.cache == "free"
               else (lambda at: (0, at.span[1] - at.e)))
        select = S.SampledPositions(st.alg_temp, generator, pad)
    return rule, S.FirstToken(select) if rule.first_token else select


def resolve(model, prompt, options: dict, attention_mask, generator):
    """The settings with the family's and the method's defaults filled in, every check passed; -> (settings,
    whether this is Dream's own whole-canvas sampler)."""
    names = {f.name for f in dataclasses.fields(Settings)}
    if set(options) - names:
        raise ValueError(f"unknown setting {sorted(set(options) - names)[0]!r}: generate() takes "
                         f"{', '.join(sorted(names))}")
    st = Settings(**options)
    dream, guided = model.config.family == "dream", st.guide is not None
    whole_canvas = dream and st.block_length is None and not guided     # Dream's own diffusion_generate
    st = dataclasses.replace(
        st, remasking=st.remasking or ("entropy" if dream else "low_confidence"),
        block_length=st.gen_length if guided else st.block_length or st.gen_length,   # guided: one block
        steps=st.gen_length if st.steps is None or guided else st.steps)
    checks.check_call(model, prompt, st, attention_mask, generator, whole_canvas, Settings())
    return st, whole_canvas


def make_plan(model, prompt, options: dict, attention_mask, generator) -> Plan:
    """Turn (cache, family, selection, stop) into parts, once: everything here depends only on the call's
    settings, so the loop has no branch on a setting."""
    cfg, device = model.config, model.lm_head.weight.device
    st, whole_canvas = resolve(model, prompt, options, attention_mask, generator)
    B, P = prompt.shape
    L, n_blocks = P + st.gen_length, st.gen_length // st.block_length
    generator = generator or torch.Generator(device).manual_seed(0)
    eos = torch.tensor(sorted(set(st.eos_ids or cfg.eos_ids or [cfg.eos_id]) - {None}), dtype=torch.long, device=device)
    pos, mask = padding(attention_mask, st.gen_length, device)
    ar = torch.arange(L, device=device)
    if st.guide is not None:    # one block over the answer; a committed end token ends the answer
        (rule, select, feed), stop_run = guided_parts(st, prompt.to(device), attention_mask, pos, eos, cfg.mask_id), 1
    else:
        rule, select = family_rules(cfg, st, whole_canvas, n_blocks, generator, device)
        feed = st.cache if isinstance(st.cache, Feed) else CACHE_POLICIES[st.cache]()
        stop_run = st.stop_at_eos
    feed = Refresh(feed) if st.refresh_every_step else feed
    stop = st.stop or (S.EndOfText(P, eos, cfg.mask_id, stop_run) if stop_run else S.NoStop())
    compiled = st.compile and feed.fixed_width and (st.compile if isinstance(st.compile, Compiled) else Compiled())
    call, cache = (compiled, compiled.cache) if compiled else (logits_at, KVCache.for_model)
    kv = cache(model, B, L, feed.spare) if feed.keeps_cache else None
    calls_per_block = 1 if getattr(select, "parallel", True) else st.steps // n_blocks
    return Plan([(s, s + st.block_length) for s in range(P, L, st.block_length)], feed, rule,
                *checks.checked_hooks(rule, select, stop, B, st.block_length), model,
                call, kv, ar.expand(B, L) if pos is None else pos, mask, int(cfg.shift_logits), cfg.mask_id,
                calls_per_block, eos, ar, P, st.gen_length)


@torch.inference_mode()
def generate(model, prompt: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
             generator: torch.Generator | None = None, on_step=None, **settings):
    """
    Decode gen_length tokens after `prompt` (B, P). Returns (ids (B, P + gen_length), stats) with stats
    {"nfe": model calls, "row_nfe": the calls that served each row (a row's NFE alone, whatever the batch),
    "row_committed": the tokens the selection committed in each row, "fed": tokens fed per call, "committed":
    tokens the selection committed per call (all rows), "filled": tokens the stop rule filled per call,
    "calls_saved", "guide_calls", "seconds", "answer_tokens": generated tokens before each row's first end
    token, summed, "tokens_per_s": answer_tokens per second}.

    settings: the keywords of `Settings`; see its field comments and the README's API table.
    attention_mask: (B, P) 1/0 for left-padded prompts, both families: each row decodes as it would alone.
    generator: the only source of randomness (default: a fresh one seeded 0). on_step(x, stats) is called
        after every step with the live canvas.
    """
    p = make_plan(model, prompt, settings, attention_mask, generator)
    on_step = on_step or (lambda x, stats: None)
    x = F.pad(prompt.to(p.ar.device), (0, p.gen_length), value=p.mask_id)
    stats = {"nfe": 0, "fed": [], "committed": [], "filled": [], "calls_saved": 0, "guide_calls": 0}
    t0 = time.perf_counter()
    for bi, (s, e) in enumerate(p.blocks):
        p.rule.start_block(x, s, e)
        i, open_cols = 0, list(range(e - s))
        while True:
            at = p.at(x, stats["nfe"], i, s, e, open_cols)           # where this step stands; what it feeds
            logits, bad = p.forward(x, at)                            # 1. feed
            prop = p.propose(logits, at)                              # 2. propose
            take = p.select(prop, at)                                 # 3. select
            x[:, s:e] = torch.where(take, prop.x0, x[:, s:e])         # 4. commit
            done = p.stop(x, at, prop)                                # 5. stop
            ended, open_cols = p.record(x, at, prop, take, done, bad, stats)   # the step's one host read
            on_step(x, stats)
            if ended or not p.rule.more(bool(open_cols), at):
                break
            i += 1
        if ended:                                                     # every row's answer has ended
            stats["calls_saved"] = (len(p.blocks) - bi - 1) * p.calls_per_block
            break
    return x, p.finish(x, stats, t0)


if __name__ == "__main__":   # `python fastdllm.py --prompt ...` runs the command line, cli.py, as the main program
    import runpy
    runpy.run_module("cli", run_name="__main__")
