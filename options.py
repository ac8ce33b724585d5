"""
options.py: what a generate() call may ask, and what it refuses before anything runs. `Settings`: every setting
and its default; `settings`: a call's settings with every default decided, the method's, then its family's own
(FAMILIES: each family's defaults, refusals, canvas and parts come from its own file, family.Family); `checked`:
those settings with every check passed. The checks, each once, in one line that names the setting and the fix, never
deep inside torch: `check_early` needs no model (the programs run it before they load gigabytes of weights),
`check_call` runs them all with the model's and the hooks' signatures, then the family's own (Family.check). The
hooks' answers while the loop runs are checks.py's.
"""
import dataclasses
import inspect
import math
import numbers
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch

from blockdiff import BLOCK, FAMILIES as BLOCK_FAMILIES, SDAR_REMASKING
from cache import CACHE_POLICIES, CachePolicy
from checks import name
from dream import DREAM
from family import LLADA, Family
from guided import GUIDED, OWN as GUIDED_OWN
from llada2 import OWN as LLADA2_OWN
from sampler import DREAM_REMASKING, LLADA_REMASKING
from uniform import GEMMA, OWN as GEMMA_OWN


@dataclass
class Settings:
    """Every setting of generate(model, prompt, **settings) and its default, decided here once (None: decided by
    `resolve` from the family and the other settings). The four hooks take a fork's own part (README "Fork it")."""
    gen_length: int = 128              # tokens to generate
    block_length: int | None = 32      # semi-autoregressive block; None = one block (Dream: its own sampler)
    sub_block: int | None = None       # Fast-dLLM v2: a block is decoded in sub-blocks of this many tokens (default 8)
    steps: int | None = None           # denoising steps over the answer (None: gen_length, 1 token/step)
    cache: str | CachePolicy = "none"  # "none" | "prefix" | "dual" | "free", or a cache.CachePolicy
    threshold: float | None = None     # Fast-dLLM 3.3: commit every token with confidence >= threshold
    factor: float | None = None        # Fast-dLLM 3.3: factor-based parallel decoding
    select: Callable | None = None     # a selection rule: rule(proposal, at) -> (B, N) bool (sampler.py)
    propose: object | None = None      # a step rule: .propose(logits, at) -> sampler.Proposal (sampler.StepRule)
    stop: Callable | None = None       # a stop rule: rule(x, at, proposal) -> (B,) bool rows ended (sampler.py)
    temperature: float = 0.0           # 0 = greedy
    remasking: str | None = None       # LLaDA: low_confidence | random; Dream: entropy (maskgit_plus if parallel)
    top_p: float | None = None         # Dream's sampling options
    top_k: int | None = None
    alg_temp: float | None = None
    eps: float = 1e-3                  # Dream's time grid runs from 1 down to eps
    minimal_topk: int = 1              # LLaDA2: steps are capped at gen_length // minimal_topk (the official's)
    editing_threshold: float | None = None   # LLaDA2.1: edit a committed token whose new proposal is above this
    max_post_steps: int | None = None  # LLaDA2.1: a block's edit-only calls once it has no mask (default 16)
    num_to_transfer: int | None = None # LLaDA2.1: masks a call commits below the threshold (default 1)
    entropy_bound: float | None = None # DiffusionGemma: a step accepts the samples whose entropies, summed less the
                                       #   largest, stay <= this (its generation_config.json's: 0.1)
    t_min: float | None = None         # DiffusionGemma: its temperature runs from t_max down to t_min (0.4, 0.8)
    t_max: float | None = None
    stability_threshold: int | None = None     # DiffusionGemma: a canvas ends once its argmax is the same as at
    confidence_threshold: float | None = None  #   this many last steps and its mean entropy is below this (1, 0.005)
    refresh_every_step: bool = False   # feed the whole canvas every step (checks the cache plumbing)
    stop_at_eos: bool | int = False    # True: stop after a finished block holding an end token; k: FlashDLM's rule
    eos_ids: list | None = None        # the end tokens (default the config's)
    compile: bool | object = False     # torch.compile the layers (CUDA graphs on CUDA); a Compiled keeps its graphs
    cuda_graphs: bool | object | None = None   # CUDA graphs of the layers (None: on CUDA); a CudaGraphs keeps them
    guide: torch.nn.Module | None = None   # FlashDLM guided diffusion: a causal LM with the same token ids
    speculative: bool = False          # guided: commit the guide's token at the first rejection
    accept: str = "deterministic"      # guided: the acceptance rule (guided.ACCEPT_RULES)
    accept_k: int = 5                  # guided top-k and topk_relative
    accept_ratio: float = 0.95         # guided topk_relative ratio
    accept_threshold: float = 0.1      # guided dynamic_threshold: p(draft) > this
    verify_chunk: int = 32             # guided: drafts verified per guide forward


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
    call's settings with every default decided (`settings`), `defaults` the defaults (Settings),
    `given` the settings the caller passed. Every family's call runs them all: the values and types (check_settings),
    the prompt and the family's sampler options (check_prompt, check_family), end of text (check_stop), the hooks
    (check_hooks), guided-only and other families' settings left at their defaults (check_unguided, check_readers);
    then the family's own (Family.check; LLaDA has none). check_early is the programs', before the weights load."""
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


# ---------------------------------------------------------------------------------------- the call's settings
# Each family's part of the set-up (its defaults, its refusals, its canvas and its parts), from its own file.
FAMILIES = {"llada": LLADA, "dream": DREAM, **dict.fromkeys(BLOCK_FAMILIES, BLOCK), "diffusion_gemma": GEMMA}


def family_of(cfg, st) -> Family:
    """The family whose parts decode this call: guided diffusion's with a guide, else the model's (a causal LM, which
    check_call refuses, counts as LLaDA until then)."""
    return GUIDED if st.guide is not None else FAMILIES.get(cfg.family, LLADA)


def settings(cfg, options: dict) -> Settings:
    """The call's settings with every default decided: the method's (Settings), the family's own (its remasking, its
    block and sub-block, its steps), then one block and one token a step where still left None."""
    st = Settings(**known(options, Settings))
    st = dataclasses.replace(st, **family_of(cfg, st).defaults(cfg, st, options))
    return dataclasses.replace(st, block_length=st.block_length or st.gen_length,
                               steps=st.gen_length if st.steps is None else st.steps)


def checked(model, prompt, options: dict, attention_mask=None, generator=None, on_step=None):
    """The call's settings, every default decided and every check passed: options.py's, then the family's own (a
    refusal is one line naming the setting and the fix) -> (settings, the family)."""
    st = settings(model.config, options)
    check_call(model, prompt, st, attention_mask, generator, on_step, Settings(), options)
    family = family_of(model.config, st)
    family.check(model.config, st, options, prompt.shape[1])
    return st, family
