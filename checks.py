"""
checks.py: every check of a generate() call, in one place, each once. An impossible request fails in one line
that names the problem and the fix, never deep inside torch. The CLI runs `check_settings` before it loads
gigabytes of weights; generate() runs `check_call` (all of them) before it decides anything, and checks the
four hooks at the boundary while it runs: every step, the shapes and dtypes of what a step rule, a selection
rule and a stop rule return (host metadata, no sync), and their values inside the step's one host read
(`check_step`); every cache policy's span (`check_span`).
"""
import inspect
import math
import numbers
from types import SimpleNamespace

import torch

from cache import Feed
from guided import check_guided, check_guided_settings

CACHE_MODES = ("none", "prefix", "dual", "free")
LLADA_REMASKING = ("low_confidence", "random")
DREAM_REMASKING = ("origin", "maskgit_plus", "topk_margin", "entropy", "position_weighted")
# Guided diffusion's own settings (their defaults: fastdllm.Settings).
GUIDED_ONLY = ("speculative", "accept", "accept_k", "accept_ratio", "accept_threshold", "verify_chunk")
BOOLEANS = ("refresh_every_step", "speculative")


def bad(msg):
    raise ValueError(msg)


def check_settings(gen_length, block_length, steps, cache, threshold, factor, temperature, top_p=None,
                   top_k=None, alg_temp=None, eps=None, generator=None):
    """The checks that need no model."""
    # A wrong type gets the same one line as a wrong value, not a TypeError from deep inside torch.
    for name, v, kind in (("gen_length", gen_length, int), ("block_length", block_length, int), ("steps", steps, int),
                          ("temperature", temperature, float), ("top_k", top_k, int), ("threshold", threshold, float),
                          ("factor", factor, float), ("top_p", top_p, float), ("alg_temp", alg_temp, float),
                          ("eps", eps, float)):
        optional = name not in ("gen_length", "block_length", "steps", "temperature")
        if not (optional and v is None or isinstance(v, numbers.Integral if kind is int else numbers.Real)
                and not isinstance(v, bool)):
            bad(f"{name} must be {'an integer' if kind is int else 'a number'}{' or None' * optional} (got {v!r})")
    if generator is not None and not isinstance(generator, torch.Generator):
        bad(f"generator must be a torch.Generator, not {generator!r}: e.g. torch.Generator('cpu').manual_seed(0)")
    if eps is not None and not 0 < eps < 1:
        bad(f"eps must be in (0, 1) (got {eps}): Dream's time runs from 1 down to eps (default 1e-3)")
    if gen_length < 1 or block_length < 1:
        bad(f"gen_length ({gen_length}) and block_length ({block_length}) must be positive")
    if gen_length % block_length:
        bad(f"gen_length {gen_length} is not a multiple of block_length {block_length}: "
            f"pick a block_length that divides it, e.g. {next(b for b in range(block_length, 0, -1) if gen_length % b == 0)}")
    if steps < 1:
        bad(f"steps must be >= 1 (got {steps})")
    if steps % (gen_length // block_length):
        bad(f"steps {steps} is not divisible by the number of blocks {gen_length // block_length} "
            f"(gen_length / block_length): use a multiple, e.g. steps={gen_length}")
    if not isinstance(cache, (str, Feed)):
        raise TypeError(f"cache must be a mode name ({', '.join(CACHE_MODES)}) or a cache.Feed policy (subclass "
                        f"cache.Feed and write its span()), not {cache!r}")
    if isinstance(cache, str) and cache not in CACHE_MODES:
        bad(f"unknown cache mode {cache!r}: use one of {', '.join(CACHE_MODES)}")
    if threshold is not None and not threshold > 0:      # `not >` also catches NaN
        bad(f"threshold must be a number > 0 (got {threshold}): 0.9 is Fast-dLLM's; above 1 means one token per "
            f"step, None turns it off")
    if factor is not None and not factor > 0:
        bad(f"factor must be > 0 (got {factor})")
    if threshold is not None and factor is not None:
        bad("pass threshold or factor, not both: they are two parallel-decoding rules")
    if not temperature >= 0:
        bad(f"temperature must be >= 0 (got {temperature}); 0 is greedy")
    if math.isinf(temperature):
        bad(f"temperature must be finite (got {temperature}): 0 is greedy, 1 samples the model's distribution")
    if top_p is not None and not 0 < top_p <= 1:
        bad(f"top_p must be in (0, 1] (got {top_p})")
    if top_k is not None and top_k < 1:
        bad(f"top_k must be >= 1 (got {top_k})")
    if alg_temp is not None and not alg_temp >= 0:
        bad(f"alg_temp must be >= 0 (got {alg_temp})")


def check_early(kw: dict, defaults, name=lambda key: key):
    """Every check of generate() keywords that needs no model, before any is loaded (the CLI, the benchmark, the
    server, the harness all call it; generate() runs them all again, and the model's): block_length None is one
    block and steps None one token a step, as generate() fills them in; a `guide` of any value (a path, say)
    means a guide is coming. defaults: fastdllm.Settings; name(key) words a setting as the caller knows it."""
    st = SimpleNamespace(**vars(defaults) | kw)
    names = inspect.signature(check_settings).parameters
    check_settings(**{k: getattr(st, k) for k in names if hasattr(st, k)} |
                   {"block_length": st.block_length or st.gen_length,
                    "steps": st.gen_length if st.steps is None else st.steps})
    check_hooks(st)
    check_stop(None, st.stop_at_eos, None)
    if st.remasking is not None and st.remasking not in LLADA_REMASKING + DREAM_REMASKING:
        bad(f"unknown remasking {st.remasking!r}: use one of {', '.join(LLADA_REMASKING + DREAM_REMASKING)} "
            f"(LLaDA: the first {len(LLADA_REMASKING)}, Dream: the others)")
    check_guided_settings(st, defaults, name) if st.guide is not None else check_unguided(st, defaults)


def check_unguided(st, defaults):
    """A guided setting at its default changes nothing without a guide (callers that pass every keyword keep
    working); any other value would be silently ignored: refuse it."""
    given = [k for k in GUIDED_ONLY if getattr(st, k) != getattr(defaults, k)]
    if given:
        bad(f"{', '.join(given)} only apply to guided diffusion: pass guide= too, or leave them out")


def check_prompt(cfg, prompt, gen_length, remasking, top_p, top_k, alg_temp, attention_mask=None):
    """The checks that depend on the model: the prompt's ids and length, and the family's options."""
    if not isinstance(prompt, torch.Tensor):
        bad(f"the prompt must be a torch.Tensor of token ids, not a {type(prompt).__name__}: e.g. torch.tensor([ids])")
    if prompt.ndim == 2 and prompt.shape[0] == 0:
        bad("the prompt batch has 0 rows: pass at least one prompt")
    if prompt.ndim == 2 and prompt.shape[1] == 0:      # (torch.tensor([[]]) is float: say "empty" first)
        bad("the prompt is empty: pass at least one token")
    # torch.long only, as the official code: int32 fails late inside Dream's sampler, uint8 wraps around.
    if prompt.ndim != 2 or prompt.dtype != torch.long:
        bad(f"the prompt must be a (batch, length) tensor of integer token ids of dtype torch.long, not "
            f"{prompt.dtype} of shape {tuple(prompt.shape)}: e.g. torch.tensor([ids]), or prompt.long()")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != prompt.shape:
            bad(f"attention_mask must be a tensor of the prompt's shape {tuple(prompt.shape)} (1 = token, 0 = pad), "
                f"not {getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
        m = attention_mask.bool()
        if not m.any(-1).all():
            bad("attention_mask has a row of zeros: every prompt needs at least one real token (a 1)")
        if (m[:, :-1] & ~m[:, 1:]).any():     # a 1 followed by a 0: a pad after a real token
            bad("attention_mask pads a row on the right (or in the middle): the answer must follow the prompt "
                "directly, so pad on the left (fastdllm.pad_prompts does)")
    if prompt.min() < 0 or prompt.max() >= cfg.vocab_size:
        bad(f"the prompt has token id {prompt.min() if prompt.min() < 0 else prompt.max()} outside the vocabulary "
            f"[0, {cfg.vocab_size}): tokenize it with this model's tokenizer")
    if (prompt == cfg.mask_id).any():
        bad(f"the prompt contains the mask token id {cfg.mask_id}: masks are reserved for the answer; "
            f"remove them (infilling inside the prompt is not supported)")
    if prompt.shape[1] + gen_length > cfg.max_seq_len:
        bad(f"prompt ({prompt.shape[1]} tokens) + gen_length ({gen_length}) exceeds the model's "
            f"{cfg.max_seq_len} positions: shorten the prompt or lower gen_length")
    names = LLADA_REMASKING if cfg.family == "llada" else DREAM_REMASKING
    if remasking not in names:
        bad(f"unknown remasking {remasking!r} for {cfg.family}: use one of {', '.join(names)}")
    if cfg.family == "llada" and (top_p is not None or top_k is not None or alg_temp):
        bad("top_p, top_k and alg_temp are Dream options; LLaDA samples with temperature only")


def check_stop(cfg, stop_at_eos, eos_ids):
    """End of text: stop_at_eos is False, True or k >= 1; every end id an integer inside the vocabulary."""
    if not (isinstance(stop_at_eos, bool) or isinstance(stop_at_eos, numbers.Integral) and stop_at_eos >= 1):
        bad(f"stop_at_eos must be False, True (stop after a finished block holding an end token) or an integer "
            f"k >= 1 (FlashDLM's k end tokens in a row), not {stop_at_eos!r}")
    if eos_ids is None:
        return
    ids = list(eos_ids) if isinstance(eos_ids, (list, tuple, set)) else None
    if not ids or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < cfg.vocab_size
                          for i in ids):
        bad(f"eos_ids must be a non-empty list of token ids in [0, {cfg.vocab_size}), not {eos_ids!r}")
    if cfg.mask_id in ids:
        bad(f"eos_ids holds the mask token id {cfg.mask_id}: an end token must be a token the model writes")


def check_dream_modes(whole_canvas, cache, remasking, parallel, custom_rule, gen_length, steps, spb, n_blocks,
                      threshold):
    """Dream's samplers each implement some of the rules: say which one does what was asked."""
    free = cache == "free"
    if whole_canvas and (cache != "none" or parallel and threshold is None and not custom_rule):
        bad("Dream's whole-canvas sampler (block_length=None) has no cache or factor rule: pass a "
            "block_length to use Fast-dLLM's block sampler")
    if whole_canvas and custom_rule:
        bad("Dream's whole-canvas sampler (block_length=None) has its own rules: a custom select rule needs a "
            "block_length (Fast-dLLM's block sampler)")
    if whole_canvas and threshold is not None and gen_length % steps:
        bad(f"Dream's whole-canvas threshold rule spreads the {gen_length} masks evenly over the "
            f"steps: steps ({steps}) must divide gen_length")
    if not whole_canvas and not free and remasking != "entropy" and not parallel:
        bad(f"Fast-dLLM's Dream block sampler ranks tokens by entropy; remasking={remasking!r} "
            f"needs Dream's whole-canvas sampler (block_length=None) or cache='free'")
    if not whole_canvas and not free and not parallel and spb < 2:
        bad(f"Fast-dLLM's Dream block sampler needs >= 2 steps per block (got {spb}): "
            f"raise steps to at least {2 * n_blocks}, or use threshold/factor or cache='free'")
    if custom_rule and free:
        bad("FlashDLM's FreeCache sampler for Dream has its own schedule: a custom select rule needs "
            "cache 'none', 'prefix' or 'dual'")


def check_hooks(st):
    """The four hooks are objects of a known protocol (README "Fork it"): a refusal names the hook."""
    if st.select is not None and not callable(st.select):
        raise TypeError(f"select must be a selection rule, a callable (proposal, at) -> (B, N) bool, not {st.select!r}")
    if st.propose is not None and not callable(getattr(st.propose, "propose", None)):
        raise TypeError(f"propose must be a step rule with .propose(logits, at) -> sampler.Proposal (subclass "
                        f"sampler.StepRule), not {st.propose!r}")
    if st.stop is not None and not callable(st.stop):
        raise TypeError(f"stop must be a stop rule, a callable (x, at, proposal) -> (B,) bool, not {st.stop!r}")
    if st.stop is not None and st.stop_at_eos:
        bad("pass stop or stop_at_eos, not both: each is a rule for when an answer has ended")
    if st.select is not None and (st.threshold is not None or st.factor is not None):
        bad("pass select or threshold/factor, not both: each is a rule for how many tokens a step commits")
    for name in BOOLEANS:
        if type(getattr(st, name)) is not bool:
            bad(f"{name} must be True or False (got {getattr(st, name)!r})")
    if type(st.compile) is not bool and type(st.compile).__name__ != "Compiled":
        bad(f"compile must be True, False or a fastdllm.Compiled (got {st.compile!r})")


def check_call(model, prompt, st, attention_mask, generator, whole_canvas, defaults):
    """Every check of one generate() call, in the order that names the first real problem. `st` holds the
    call's settings with the family's defaults already filled in, `defaults` the defaults (fastdllm.Settings)."""
    cfg = model.config
    if cfg.causal:
        bad("this is a causal LM (model_type qwen2), not a diffusion LM: pass it as guide= and a "
            "LLaDA or Dream checkpoint as the model")
    check_settings(st.gen_length, st.block_length, st.steps, st.cache, st.threshold, st.factor, st.temperature,
                   st.top_p, st.top_k, st.alg_temp, st.eps, generator)
    check_prompt(cfg, prompt, st.gen_length, st.remasking, st.top_p, st.top_k, st.alg_temp, attention_mask)
    check_stop(cfg, st.stop_at_eos, st.eos_ids)
    check_hooks(st)
    check_guided(model, st, defaults) if st.guide is not None else check_unguided(st, defaults)
    if cfg.family == "dream" and st.guide is None and st.propose is None:
        n_blocks = st.gen_length // st.block_length
        check_dream_modes(whole_canvas, st.cache, st.remasking, st.threshold is not None or st.factor is not None
                          or st.select is not None, st.select is not None, st.gen_length, st.steps,
                          st.steps // n_blocks, n_blocks, st.threshold)
    device = model.lm_head.weight.device
    if generator is not None and generator.device.type != device.type:
        bad(f"the generator is on {generator.device.type} but the model on {device.type}: "
            f"create it with torch.Generator({device.type!r})")


# ---------------------------------------------------------------------------------------- the hooks, while running
def name(hook) -> str:
    return type(hook).__name__ if not hasattr(hook, "__name__") else hook.__name__


def check_span(feed, at, open_cols: list) -> tuple[int, int]:
    """A cache policy's span for the step `at`: a pair of ints inside the canvas, the whole canvas at a
    generation's first call (the cache starts empty), covering every open position of the block (open_cols:
    their block columns, read at the previous step). A shifted family predicts position p from p - 1: a span
    that starts exactly at the first open position is widened by one, so no policy can silently break Dream."""
    span, L = feed.span(at), at.x.shape[1]
    if not (isinstance(span, (tuple, list)) and len(span) == 2 and all(type(v) is int for v in span)):
        raise TypeError(f"cache= {name(feed)}.span() returned {span!r}: a span is a pair of ints (a, b)")
    a, b = span
    where = f"at step {at.i} of block [{at.s}, {at.e})"
    if not 0 <= a < b <= L:
        raise ValueError(f"cache= {name(feed)}.span() returned ({a}, {b}) {where}: a span lies inside the canvas "
                         f"[0, {L})")
    if at.n == 0 and feed.keeps_cache and (a, b) != (0, L):
        raise ValueError(f"cache= {name(feed)}.span() returned ({a}, {b}) at the first call: it must feed the "
                         f"whole canvas (0, {L}), the cache starts empty")
    if open_cols:
        first, last = at.s + open_cols[0], at.s + open_cols[-1]
        a = a - 1 if at.shift and a == first else a
        if not (a + at.shift <= first and last < b):
            raise ValueError(f"cache= {name(feed)}.span() returned ({span[0]}, {b}) {where}: it must cover the open "
                             f"positions [{first}, {last}]" + (" and the one before them (this family predicts "
                                                                "position p from p - 1)" if at.shift else ""))
    return a, b


def described(v) -> str:
    return f"a {tuple(v.shape)} {v.dtype} tensor" if isinstance(v, torch.Tensor) else repr(v)


def checked_hooks(rule, select, stop, B: int, N: int):
    """The step rule's propose, the selection rule and the stop rule, each checked at every step for the shape
    and dtype of what it returns (host metadata only; their values are checked in the step's one read)."""
    def propose(logits, at):
        p = rule.propose(logits, at)
        fields = (("x0", (B, N), False), ("conf", (B, N), True), ("open", (B, N), None), ("k", (B,), False))
        for f, shape, floating in fields:
            v = getattr(p, f, None)
            if not (isinstance(v, torch.Tensor) and v.shape == shape and
                    (v.dtype == torch.bool if floating is None else v.is_floating_point() == floating)):
                raise TypeError(f"propose= {name(rule)}.propose() returned {f} = {described(v)}: a sampler.Proposal "
                                f"holds {f} of shape {shape} ({'bool' if floating is None else 'float' if floating else 'integer'})")
        return p

    def selection(p, at):
        take = select(p, at)
        if not (isinstance(take, torch.Tensor) and take.dtype == torch.bool and take.shape == (B, N)):
            raise TypeError(f"select= {name(select)} returned {described(take)}: a selection rule returns a "
                            f"({B}, {N}) bool tensor, one row per batch row, True = commit")
        return take

    selection.__name__ = name(select)

    def stopping(x, at, p):
        ended = stop(x, at, p)
        if not (isinstance(ended, torch.Tensor) and ended.dtype == torch.bool and ended.shape == (B,)):
            raise TypeError(f"stop= {name(stop)} returned {described(ended)}: a stop rule returns a ({B},) bool "
                            f"tensor, True = the row's answer has ended")
        return ended
    return propose, selection, stopping


def check_step(nonfinite: int, opened: int, outside: int, at, rule, select):
    """The values the step's one host read brought back: NaN/inf logits, a proposal that opens a committed
    position, a selection outside the proposal's open positions (it would overwrite committed tokens)."""
    if nonfinite:
        bad(f"the model produced NaN/inf logits at step {at.n + 1}: the weights hold NaN/inf, or the activations "
            f"overflowed (try --dtype float32)")
    if opened:
        bad(f"propose= {name(rule)}.propose() opened positions that are not masks at step {at.n + 1}: a proposal's "
            f"open positions lie inside at.cand")
    if outside:
        bad(f"select= {name(select)} chose positions outside the proposal's open positions at step {at.n + 1} "
            f"(committed tokens would be overwritten): return a subset of proposal.open")
