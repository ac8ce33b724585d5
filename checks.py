"""
checks.py: every check of a generate() call, in one place, each once. An impossible request fails in one line
that names the problem and the fix, never deep inside torch. The CLI runs `check_early` before it loads
gigabytes of weights; generate() runs `check_call` (all of them, and the hooks' signatures) before it decides
anything else. While it runs, the loop checks the hooks' answers at the boundary (`proposal`, `selection`,
`stopped`; their values in the plan's one read); the one-line refusals it raises when a check fails are at the end
of this file.
Guided diffusion's own checks are guided.py's.
"""
import dataclasses
import inspect
import math
import numbers
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from blockdiff import FAMILIES as BLOCK_FAMILIES, SDAR_REMASKING
from cache import CACHE_POLICIES, CachePolicy
from guided import OWN as GUIDED_OWN
from llada2 import OWN as LLADA2_OWN
from uniform import OWN as GEMMA_OWN
from sampler import DREAM_REMASKING, LLADA_REMASKING

BOOLEANS = ("refresh_every_step", "speculative")


def bad(msg):
    raise ValueError(msg)


def known(options: dict, settings_class) -> dict:
    """generate()'s keywords are the fields of fastdllm.Settings: another is one line listing them."""
    names = {f.name for f in dataclasses.fields(settings_class)}
    if set(options) - names:
        bad(f"unknown setting {sorted(set(options) - names)[0]!r}: generate() takes {', '.join(sorted(names))}")
    return options


def check_settings(gen_length, block_length, steps, cache, threshold, factor, temperature, top_p=None,
                   top_k=None, alg_temp=None, eps=None, generator=None, grid=False, name=lambda key: key):
    """The checks that need no model. grid: a block-diffusion model's (blockdiff.check_block checks its blocks).
    name(key) words a setting as the caller knows it (a flag)."""
    # A wrong type gets the same one line as a wrong value, not a TypeError from deep inside torch.
    for key, v, kind in (("gen_length", gen_length, int), ("block_length", block_length, int), ("steps", steps, int),
                          ("temperature", temperature, float), ("top_k", top_k, int), ("threshold", threshold, float),
                          ("factor", factor, float), ("top_p", top_p, float), ("alg_temp", alg_temp, float),
                          ("eps", eps, float)):
        optional = key not in ("gen_length", "block_length", "steps", "temperature")
        if not (optional and v is None or isinstance(v, numbers.Integral if kind is int else numbers.Real)
                and not isinstance(v, bool)):
            bad(f"{key} must be {'an integer' if kind is int else 'a number'}{' or None' * optional} (got {v!r})")
    rows = generator if isinstance(generator, (list, tuple)) and generator else [generator]
    if generator is not None and not all(isinstance(g, torch.Generator) for g in rows):
        bad(f"generator must be a torch.Generator, not {generator!r}: e.g. torch.Generator('cpu').manual_seed(0) "
            f"(DiffusionGemma also takes a list of them, one per row)")
    if eps is not None and not 0 < eps < 1:
        bad(f"eps must be in (0, 1) (got {eps}): Dream's time runs from 1 down to eps (default 1e-3)")
    if gen_length < 1 or block_length < 1:
        bad(f"gen_length ({gen_length}) and block_length ({block_length}) must be positive")
    if not grid and gen_length % block_length:
        g, b = name("gen_length"), name("block_length")
        bad(f"{g} {gen_length} is not a multiple of {b} {block_length}: pass a {b} that divides it, e.g. {b} "
            f"{next(d for d in range(block_length, 0, -1) if gen_length % d == 0)}, or a {g} that is a multiple of "
            f"{block_length}, e.g. {g} {-(-gen_length // block_length) * block_length}")
    if steps < 1:
        bad(f"steps must be >= 1 (got {steps})")
    if not grid and steps % (gen_length // block_length):
        bad(f"steps {steps} is not divisible by the number of blocks {gen_length // block_length} "
            f"(gen_length / block_length): use a multiple, e.g. steps={gen_length}")
    if isinstance(cache, type):
        raise TypeError(f"cache= {cache.__name__} is a class: pass an instance, cache={cache.__name__}(...)")
    if not isinstance(cache, (str, CachePolicy)):
        raise TypeError(f"cache must be a mode name ({', '.join(CACHE_POLICIES)}) or a cache.CachePolicy (subclass "
                        f"cache.CachePolicy and write its span()), not {cache!r}")
    if isinstance(cache, str) and cache not in CACHE_POLICIES:
        bad(f"unknown cache mode {cache!r}: use one of {', '.join(CACHE_POLICIES)}")
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


def check_early(kw: dict, defaults, name=lambda key: key, grid=False):
    """Every check of generate() keywords that needs no model, before any is loaded (the CLI, the benchmark, the
    server, the harness all call it; generate() runs them all again, and the model's): block_length None is one
    block and steps None one token a step, as generate() fills them in; a `guide` of any value (a path, say)
    means a guide is coming. defaults: fastdllm.Settings; name(key) words a setting as the caller knows it; grid: a
    block-diffusion model's (its gen_length need not fill whole blocks)."""
    st = SimpleNamespace(**vars(defaults) | kw)
    names = inspect.signature(check_settings).parameters
    check_settings(**{k: getattr(st, k) for k in names if hasattr(st, k)} |
                   {"block_length": st.block_length or st.gen_length, "grid": grid, "name": name,
                    "steps": st.gen_length if st.steps is None else st.steps})
    check_hooks(st)
    check_stop(None, st.stop_at_eos, None)
    if st.remasking is not None and st.remasking not in LLADA_REMASKING + DREAM_REMASKING + SDAR_REMASKING:
        bad(f"unknown remasking {st.remasking!r}: use one of {', '.join(LLADA_REMASKING + DREAM_REMASKING)} "
            f"(LLaDA: the first {len(LLADA_REMASKING)}, Dream: the others) or, for SDAR, {', '.join(SDAR_REMASKING)}")
    if st.guide is None:     # with a guide: guided.check_guided_settings
        check_unguided(st, defaults)


def check_unguided(st, defaults):
    """A guided setting at its default changes nothing without a guide (callers that pass every keyword keep
    working); any other value would be silently ignored: refuse it."""
    given = [k for k in GUIDED_OWN if getattr(st, k) != getattr(defaults, k)]
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
    check_family(cfg, remasking, top_p, top_k, alg_temp)


def check_family(cfg, remasking, top_p=None, top_k=None, alg_temp=None, name=lambda key: key):
    """The family's own options, on config.json alone (the programs check them before the weights): its remasking
    names (None: the family's default); top_p, top_k and alg_temp are Dream's. name(key) words a setting as the
    caller knows it (a flag, a field)."""
    names = LLADA_REMASKING if cfg.family == "llada" else DREAM_REMASKING if cfg.family == "dream" else (remasking,)
    if remasking is not None and remasking not in names:          # (a block-diffusion family's: blockdiff.check_block)
        bad(f"unknown {name('remasking')} {remasking!r} for {cfg.family}: use one of {', '.join(names)}")
    given = [k for k, on in (("top_p", top_p is not None), ("top_k", top_k is not None), ("alg_temp", bool(alg_temp)))
             if on]
    if cfg.family == "llada" and given:
        bad(f"{name(given[0])} is a Dream option ({', '.join(map(name, ('top_p', 'top_k', 'alg_temp')))}): LLaDA "
            f"samples with {name('temperature')} only; drop {name(given[0])}")


def check_readers(cfg, given: dict, defaults, name=lambda key: key):
    """A setting that only another family reads, on config.json alone (the programs check it before the weights):
    LLaDA2's own (llada2.OWN), DiffusionGemma's (uniform.OWN) and Fast-dLLM v2's sub_block. given: the settings passed; defaults: fastdllm.Settings."""
    for family, title, own in (("llada2", "LLaDA2's (model_type llada2_moe)", LLADA2_OWN),
                               ("diffusion_gemma", "DiffusionGemma's", GEMMA_OWN)):
        theirs = [k for k in own if given.get(k, getattr(defaults, k)) != getattr(defaults, k)]
        if theirs and cfg.family != family:
            bad(f"{name(theirs[0])} is {title}: a {cfg.family} model does not read it; drop {name(theirs[0])}")
    if given.get("sub_block") is not None and cfg.family not in BLOCK_FAMILIES:
        bad(f"{name('sub_block')} is Fast-dLLM v2's: a {cfg.family} model decodes the whole block at each step; drop "
            f"{name('sub_block')}")


def check_stop(cfg, stop_at_eos, eos_ids):
    """End of text: stop_at_eos is False, True or k >= 1; every end id an integer inside the vocabulary."""
    if not (isinstance(stop_at_eos, bool) or isinstance(stop_at_eos, numbers.Integral) and stop_at_eos >= 1):
        bad(f"stop_at_eos must be False, True (stop after a finished block holding an end token) or an integer "
            f"k >= 1 (FlashDLM's k end tokens in a row), not {stop_at_eos!r}")
    if eos_ids is None:
        if cfg is not None and stop_at_eos and not cfg.eos_ids:
            bad("stop_at_eos needs the end tokens and this checkpoint names none (no eos_token_id in config.json or "
                "generation_config.json, no eos_token in its tokenizer files): pass eos_ids=[...]")
        return
    ids = list(eos_ids) if isinstance(eos_ids, (list, tuple, set)) else None
    if not ids or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < cfg.vocab_size
                          for i in ids):
        bad(f"eos_ids must be a non-empty list of token ids in [0, {cfg.vocab_size}), not {eos_ids!r}")
    if cfg.mask_id in ids:
        bad(f"eos_ids holds the mask token id {cfg.mask_id}: an end token must be a token the model writes")


# Each hook: what it must be, and how the loop calls it (the arguments, and the method, if it is one).
HOOKS = (("select", None, "a selection rule, a callable (proposal, at) -> (B, N) bool",
          "a selection rule is called as rule(proposal, at)", 2),
         ("stop", None, "a stop rule, a callable (x, at, proposal) -> (B,) bool", "a stop rule is called as "
          "rule(x, at, proposal)", 3),
         ("on_step", None, "a callable on_step(x, stats), called after every step", "it is called as on_step(x, stats)", 2),
         ("propose", "propose", "a step rule with .propose(logits, at) -> sampler.Proposal and .start_block(x, s, e) "
          "(subclass sampler.StepRule)", "a step rule's propose is called as propose(logits, at)", 2),
         ("propose", "start_block", "", "a step rule's start_block is called as start_block(x, s, e)", 3),
         ("cache", "span", "", "a cache policy's span is called as span(at)", 1),
         ("cache", "keys", "", "a cache policy's keys is called as keys(at)", 1),
         ("cache", "slots", "", "a cache policy's slots is called as slots(at, fed)", 2))


def check_hooks(st, on_step=None):
    """The hooks are objects of a known protocol, called as the loop calls them (README "Fork it"): a refusal names
    the hook, here, not Python's own TypeError in the middle of a decode."""
    for hook, method, what, how, n in HOOKS:
        obj = on_step if hook == "on_step" else getattr(st, hook)
        if isinstance(obj, type):       # the class, where its instance is meant (select=AboveMean)
            raise TypeError(f"{hook}= {obj.__name__} is a class: pass an instance, {hook}={obj.__name__}(...)")
        if obj is None or hook == "cache" and not isinstance(obj, CachePolicy):
            continue
        fn = obj if method is None else getattr(obj, method, None)
        if what and not (callable(fn) and (hook != "propose" or callable(getattr(obj, "start_block", None)))):
            raise TypeError(f"{hook} must be {what}, not {obj!r}")
        try:
            fn is None or inspect.signature(fn).bind(*[None] * n)
        except TypeError:
            who = name(fn) if method is None else f"{type(obj).__name__}.{method}"
            raise TypeError(f"{hook}= {who} takes {inspect.signature(fn)}: {how}") from None
        except ValueError:      # no signature to read (a builtin): it will say so itself
            pass
    if st.stop is not None and st.stop_at_eos:
        bad("pass stop or stop_at_eos, not both: each is a rule for when an answer has ended")
    if st.select is not None and (st.threshold is not None or st.factor is not None):
        bad("pass select or threshold/factor, not both: each is a rule for how many tokens a step commits")
    for key in BOOLEANS:
        if type(getattr(st, key)) is not bool:
            bad(f"{key} must be True or False (got {getattr(st, key)!r})")
    if type(st.compile) is not bool and type(st.compile).__name__ != "Compiled":
        bad(f"compile must be True, False or a fastdllm.Compiled (got {st.compile!r})")
    if not (st.cuda_graphs is None or type(st.cuda_graphs) is bool or "CudaGraphs" in map(
            lambda c: c.__name__, type(st.cuda_graphs).__mro__)):
        bad(f"cuda_graphs must be None (on CUDA only), True, False or a fastdllm.CudaGraphs (got {st.cuda_graphs!r})")


def check_call(model, prompt, st, attention_mask, generator, on_step, defaults, given):
    """Every check of one generate() call, in the order that names the first real problem. `st` holds the
    call's settings with every default decided (fastdllm.settings), `defaults` the defaults (fastdllm.Settings),
    `given` the settings the caller passed."""
    cfg = model.config
    if cfg.causal:
        bad("this is a causal LM (model_type qwen2), not a diffusion LM: pass it as guide= and a "
            "LLaDA or Dream checkpoint as the model")
    check_settings(st.gen_length, st.block_length, st.steps, st.cache, st.threshold, st.factor, st.temperature,
                   st.top_p, st.top_k, st.alg_temp, st.eps, generator,
                   grid=cfg.family not in ("llada", "dream", "qwen2"))   # steps and blocks per block, or canvas
    check_prompt(cfg, prompt, st.gen_length, st.remasking, st.top_p, st.top_k, st.alg_temp, attention_mask)
    check_stop(cfg, st.stop_at_eos, st.eos_ids)
    check_hooks(st, on_step)
    if st.guide is None:      # with a guide: guided.check_guided, when its parts are made
        check_unguided(st, defaults)
    ignored = [k for k in ("temperature", "remasking", "steps", "top_p", "top_k", "alg_temp", "eps")
               if given.get(k, getattr(defaults, k)) != getattr(defaults, k)] + ["generator"] * (generator is not None)
    if st.propose is not None and ignored:
        bad(f"propose= {name(st.propose)} makes its own proposals: {', '.join(ignored)} set(s) the built-in step "
            f"rules only; give your step rule what it needs, and drop {ignored[0]}")
    check_readers(cfg, given, defaults)
    device = model.lm_head.weight.device
    rows = generator if isinstance(generator, (list, tuple)) else [generator]
    if generator is not None and any(g.device.type != device.type for g in rows):
        bad(f"the generator is on {rows[0].device.type} but the model on {device.type}: "
            f"create it with torch.Generator({device.type!r})")
    if rows is generator and (cfg.family != "diffusion_gemma" or len(rows) != prompt.shape[0]):
        bad(f"generator is a list of {len(rows)}: one generator per row is DiffusionGemma's (each row then draws as it "
            f"would alone), for the {prompt.shape[0]} rows of the prompt; else pass one torch.Generator")


# ---------------------------------------------------------------------------------------- refusals while running
# fastdllm.Plan checks each step in plain code; when a check fails, it calls one of these for the message.
def name(hook) -> str:
    """A hook as its author wrote it: `Margin`, `<lambda>`, `LeftToRight.propose`."""
    if inspect.ismethod(hook):
        return f"{type(hook.__self__).__name__}.{hook.__name__}"
    return hook.__name__ if inspect.isfunction(hook) or isinstance(hook, type) else type(hook).__name__


def described(v) -> str:
    return f"a {tuple(v.shape)} {v.dtype} tensor" if isinstance(v, torch.Tensor) else repr(v)


def span(wanted, at, cache) -> tuple[int, int]:
    """A cache policy's span for the step `at`: a pair of ints (a, b) inside the canvas, else one line naming it."""
    a, b = wanted if isinstance(wanted, (tuple, list)) and len(wanted) == 2 else (None, None)
    if not (type(a) is int and type(b) is int and 0 <= a < b <= at.x.shape[1]):
        refuse_span(cache, at, wanted)
    return a, b


def step_rules(x, at, p, take, ended, before, open_, plan) -> torch.Tensor:
    """The rules the hooks' answers of one step keep (fastdllm.Plan.read): the stop rule's shape here, on the host; the
    values as (7,) bool on the device, brought back by the step's one read, for `refuse_step` to name
    the hook that broke one: non-finite logits; a proposal that opens a decided position (or edits an open one); one
    that opens a position without logits this call; a selection outside the proposal; a change to a position that was
    neither open nor the rule's edit of its answer; an ended row with a position still open; a token outside the
    vocabulary (a stop rule's fill). before: the canvas as
    the last step left it; open_: (B, L) the positions still open after this step."""
    stopped(ended, at, plan.stop)      # the proposal's and the selection's shapes: checked as they came back
    s, e = at.s, at.e
    edit = torch.zeros_like(take) | p.edit                                # (B, N): the step rule's edits (T2T)
    with_logits = torch.zeros_like(at.masked[0]).index_fill_(0, at.cols, True)       # (N,)
    may_change = at.masked | edit & (plan.ar[s:e] >= at.prompt[:, 1:])  # (B, N): open, or an edit of the answer
    may_change = (before == at.mask_id) | F.pad(may_change, (s, x.shape[1] - e))   # (B, L): a stop rule fills masks
    changed = x != before
    return torch.stack([~torch.isfinite(p.logits.sum(-1, dtype=torch.float32)).all(),
                        (p.open & ~at.masked).any() | (edit & at.masked).any(), (p.open & ~with_logits).any(),
                        (take & ~p.open).any(), (changed & ~may_change).any(), (ended[:, None] & open_).any(),
                        (changed & ((x < 0) | (x >= plan.model.config.vocab_size))).any()])


def refuse_span(cache, at, span):
    """The cache policy's span for the step `at` is not a pair of ints inside the canvas."""
    where, L = f"at step {at.i} of block [{at.s}, {at.e})", at.x.shape[1]
    if not (isinstance(span, (tuple, list)) and len(span) == 2 and all(type(v) is int for v in span)):
        raise TypeError(f"cache= {name(cache)}.span() returned {span!r}: a span is a pair of ints (a, b), or a "
                        f"sorted 1-D long tensor of canvas positions")
    raise ValueError(f"cache= {name(cache)}.span() returned ({span[0]}, {span[1]}) {where}: a span lies inside the "
                     f"canvas [0, {L})")


def refuse_unwritten(cache, at, span, written: int, seen_to: int):
    """The span's queries would attend to keys no call has written yet (a KV cache starts empty)."""
    a, b = span
    if at.n == 0 and seen_to == at.x.shape[1]:
        bad(f"cache= {name(cache)}.span() returned ({a}, {b}) at the first call: it must feed the whole canvas "
            f"(0, {seen_to}), the cache starts empty")
    first = "at the first call" if at.n == 0 else f"at step {at.i} of block [{at.s}, {at.e})"
    bad(f"cache= {name(cache)}.span() returned ({a}, {b}) {first}: its queries attend to positions [0, {seen_to}), "
        f"and only [0, {written}) hold keys/values yet: feed from {min(a, written)} to at least {seen_to}")


def proposal(p, at, step_rule):
    """The step rule's proposal at the boundary, before anything reads it (host metadata): its fields of the shapes
    and dtypes the loop needs. -> p"""
    B, N = at.masked.shape
    kind = lambda v: "bool" if v.dtype == torch.bool else "float" if v.is_floating_point() else "integer"  # noqa: E731
    for f, want, dtype in (("x0", (B, N), "integer"), ("conf", (B, N), "float"), ("open", (B, N), "bool"),
                           ("k", (B,), "integer"), ("edit", (B, N), "bool"), ("busy", (B,), "bool")):
        v = getattr(p, f, None)
        if f == "edit" and v is False or f == "busy" and v is None:       # the defaults: no edit, every row with a mask
            continue
        if not (isinstance(v, torch.Tensor) and v.shape == want and kind(v) == dtype):
            raise TypeError(f"propose= {name(step_rule)}.propose() returned {f} = {described(v)}: a sampler.Proposal "
                            f"holds {f} of shape {want} ({dtype})")
    return p


def selection(take, at, select):
    """The selection rule's answer at the boundary, before the commit reads it. -> take"""
    B, N = at.masked.shape
    if not (isinstance(take, torch.Tensor) and take.shape == (B, N) and take.dtype == torch.bool):
        refuse_answer("select=", select, take, f"a selection rule returns a ({B}, {N}) bool tensor, one row per batch "
                      f"row, True = commit")
    return take


def stopped(ended, at, stop):
    """The stop rule's answer at the boundary."""
    B = at.masked.shape[0]
    if not (isinstance(ended, torch.Tensor) and ended.shape == (B,) and ended.dtype == torch.bool):
        refuse_answer("stop=", stop, ended, f"a stop rule returns a ({B},) bool tensor, True = the row's answer has "
                      f"ended")


def refuse_answer(hook: str, rule, got, what: str):
    raise TypeError(f"{hook} {name(rule)} returned {described(got)}: {what}")


def key_mask(keys, shape, cache):
    """A cache policy's keys(at): None, or a (B, L) bool tensor."""
    if keys is None or isinstance(keys, torch.Tensor) and keys.shape == shape and keys.dtype == torch.bool:
        return keys
    raise TypeError(f"cache= {name(cache)}.keys() returned {described(keys)}: a key mask is a {tuple(shape)} bool "
                    f"tensor (True = the step may attend to that position), or None")


def positions(fed, at, cols, keeps_cache: bool, cache):
    """A fork's set of positions, checked with one host read: a sorted 1-D long tensor inside the canvas, the
    whole canvas at a generation's first call (a KV cache starts empty), holding each open position of the block
    and, for a shifted family, the one before it. -> the rows of the positions that predict the block's open columns."""
    L, want = at.x.shape[1], at.s + cols
    if not (fed.ndim == 1 and fed.dtype == torch.long and 0 < fed.numel() <= L):
        raise TypeError(f"cache= {name(cache)}.span() returned {described(fed)}: a set of positions is a 1-D long "
                        f"tensor of 1 to {L} canvas positions")
    rows = torch.searchsorted(fed, want).clamp(max=fed.numel() - 1)
    lo, hi, unsorted, missing = torch.stack([fed.min(), fed.max(), (fed[1:] <= fed[:-1]).any(), (
        (fed[rows] != want) | (fed[(rows - at.shift).clamp(min=0)] != want - at.shift)).any()]).tolist()
    where = f"at step {at.i} of block [{at.s}, {at.e})"
    if lo < 0 or hi >= L or unsorted:
        bad(f"cache= {name(cache)}.span() returned positions {where} that are not sorted and unique inside the canvas "
            f"[0, {L})")
    if at.n == 0 and keeps_cache and fed.numel() != L:
        bad(f"cache= {name(cache)}.span() fed {fed.numel()} positions at the first call: it must feed the whole "
            f"canvas ({L}), the cache starts empty")
    if missing:
        bad(f"cache= {name(cache)}.span() fed positions {where} without every open position of the block" +
            (" and the one before each (this family predicts position p from p - 1)" if at.shift else ""))
    return (rows - at.shift).clamp(min=0)       # sorted, unique and holding p and p - 1: p - 1 is the row before p


def slots(got, B: int, fed, cache):
    """A cache policy's slots(at, fed): None, or (B, T) long."""
    if got is None or isinstance(got, torch.Tensor) and got.shape == (B, fed.numel()) and got.dtype == torch.long:
        return got
    raise TypeError(f"cache= {name(cache)}.slots() returned {described(got)}: per-row slots are a ({B}, "
                    f"{fed.numel()}) long tensor (a canvas position, or the discard slot), or None")


def refuse_step(nonfinite, opened, unpredicted, outside, overwrote, unfilled, unknown, at, step_rule, select, stop,
                cache):
    """The values the step's one host read brought back (fastdllm.Plan.read) broke a rule of the hooks."""
    step = f"at step {at.n + 1}"
    if nonfinite:
        bad(f"the model produced NaN/inf logits {step}: the weights hold NaN/inf, or the activations overflowed "
            f"(try --dtype float32)")
    if opened:
        bad(f"propose= {name(step_rule)}.propose() opened positions that are not masks (or edited masks) {step}: a "
            f"proposal's open positions lie inside at.masked, its edits (Proposal.edit) outside it")
    if unpredicted:
        fed = f"fed {at.span}" if at.span else "fed a set of positions"
        bad(f"cache= {name(cache)}.span() {fed} {step} (block [{at.s}, {at.e})), and {name(step_rule)}.propose() "
            f"opened positions it has no logits for: a span must cover the open positions" + (
                " and the one before each (this family predicts position p from p - 1)" if at.shift else "") +
            "; a step rule opens only the columns at.cols")
    if outside:
        bad(f"select= {name(select)} chose positions outside the proposal's open positions {step} (committed tokens "
            f"would be overwritten): return a subset of proposal.open")
    if unfilled:
        bad(f"stop= {name(stop)} ended a row that still holds masks {step}: a stop rule fills an ended row's masks "
            f"(e.g. with an end token) before it returns True for it")
    custom = [f"{hook} {name(h)}" for hook, h in (("stop=", stop), ("propose=", step_rule), ("select=", select))
              if type(h).__module__ not in ("sampler", "guided", "blockdiff", "llada2", "dream")]
    if unknown:
        bad(f"{' or '.join(custom) or 'a hook'} wrote a token id outside the vocabulary [0, "
            f"{at.head.__self__.config.vocab_size}) {step}: a stop rule fills an ended row's masks with one of the "
            f"model's tokens (its end token or pad id), a step rule proposes token ids of the model")
    bad(f"{' or '.join(custom) or 'a hook'} changed a token that was not a mask (the prompt or a committed token) "
        f"{step}: hooks may only fill masked positions (the stop rule; a step rule's start_block), and a step rule's "
        f"edits (Proposal.edit) rewrite only the block's committed tokens, never the prompt")


def no_progress(proposed, at, step_rule, select):
    """A block that is still open after its schedule and one step per position: a rule that commits nothing."""
    hook = (f"select= {name(select)} committed nothing" if proposed else
            f"propose= {name(step_rule)}.propose() opened no position")
    bad(f"{hook}: the block [{at.s}, {at.e}) made no progress in {at.i + 1} steps; a block ends only once its "
        f"masks are committed")
