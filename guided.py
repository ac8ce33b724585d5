"""
guided.py: FlashDLM's guided diffusion (arXiv 2505.21467; docs/official.md 7.2), all of it: the diffusion model
drafts every masked position, a small causal LM (the guide, Qwen2.5-1.5B-Instruct for Dream-7B) verifies them left
to right, and a step commits the accepted run.
- `Guide`: the guide and its KV cache of the committed text, for a batch; `accept_drafts`: the five acceptance rules;
- `guide_token`, `guided_commit`: what a step commits, assisted (the drafts) or speculative (the guide's own token);
- `Guided`: the step rule (sampler.StepRule); `GuidedFreeCache`: FlashDLM's aggressive caching (cache.CachePolicy);
- `check_guide`, `check_guided`: a guide sharing the model's token ids, and the guided settings.
A guided generate() is fastdllm.py's one loop with these parts in its plan (`guided_parts`): one block, the
guide's verdicts as the proposal's open positions, a committed end token ends the answer.
"""
import numbers
from functools import partial

import torch
import torch.nn.functional as F

from cache import FreeCache, KVCache, NoCache, PrefixCache
from model import ModelConfig
from family import Canvas, Family, Parts, answer_canvas
from sampler import NEG_INF, Proposal, Schedule, StepRule, argmax_except, stop_rule

# The settings only guided diffusion reads (defaults: fastdllm.Settings); without a guide each is refused (options.py).
OWN = ("speculative", "accept", "accept_k", "accept_ratio", "accept_threshold", "verify_chunk")
ACCEPT_RULES = ("deterministic", "topk", "topk_relative", "dynamic_threshold", "aggressive")
# The acceptance rules that read each setting: one given for another rule would change nothing, so is refused.
ACCEPT_READS = {"accept_k": ("topk", "topk_relative"), "accept_ratio": ("topk_relative",),
                "accept_threshold": ("dynamic_threshold",)}


class Guide:
    """A causal guide model and its KV cache of the committed text, for a batch verified together: one guide forward per
    verification chunk serves every row, though rows commit different numbers of tokens. Slot i of row b holds the
    keys/values of canvas position i, so each row's text sits where the canvas has it, whatever its length or left
    padding; RoPE positions are per row (`pos`: real tokens count from 0) and pads are never attended (`real`), so each
    row gets the numbers it would get alone.

    Invariant: row b's slots [0, length[b]) hold its committed text *except its last token*, at slot length[b] (just
    before the first mask). A verification teacher-forces the drafted canvas from there: the last committed token's slot
    predicts the first draft, draft i's slot predicts draft i+1, so one forward scores a whole run of drafts (as in
    speculative decoding). Committed slots were computed on committed text, so committing is moving `length` forward; a
    replaced draft's slot (speculative) lies past it and is fed again. Finished rows leave the guide's batch (`rows`
    maps the guide's rows to the batch's)."""

    def __init__(self, model, batch: int, max_len: int, pos=None, real=None):
        if not model.config.causal:
            raise ValueError(f"the guide must be a causal LM (model_type 'qwen2'), not a {model.config.family} "
                             f"diffusion model: pass a Qwen2-format checkpoint as the guide")
        if max_len > model.config.max_seq_len:
            raise ValueError(f"the text ({max_len} tokens) is longer than the guide's {model.config.max_seq_len} "
                             f"positions: shorten the prompt or gen_length, or use a guide with a longer context")
        self.model = model
        self.cache = KVCache.for_model(model, batch, max_len)   # max_len: the canvas, prompt + answer
        device = self.cache.k[0].device
        self.rows = torch.arange(batch, device=device)           # the batch rows the guide still serves
        self.length = torch.zeros(batch, dtype=torch.long, device=device)
        self.pos, self.real = pos, real                          # (B, L) RoPE positions, real-token mask; or None
        self.bad = torch.zeros((), dtype=torch.bool, device=device)   # NaN/inf seen, read with the next decision

    def forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids (R, T) of the served rows at slots [start, start+T) -> next-token logits (R, T, V)."""
        end = start + ids.shape[1]
        pos = None if self.pos is None else self.pos[:, start:end]
        mask = None if self.real is None else self.real[:, None, None, :end]    # keys: never a pad
        logits = self.model(ids, pos, self.cache, start, mask)
        self.bad |= ~torch.isfinite(logits.sum(-1, dtype=torch.float32)).all()  # the diffusion model's check
        return logits

    def check(self, *values):
        """One host read: the guide's NaN/inf flag and the given device scalars -> their Python values."""
        bad, *values = torch.stack([self.bad.long(), *(torch.as_tensor(v).long() for v in values)]).tolist()
        if bad:
            raise ValueError("the guide produced NaN/inf logits: its weights hold NaN/inf, or its activations "
                             "overflowed (try --dtype float32)")
        return values

    def prefill(self, prompt: torch.Tensor) -> int:
        """Start new texts: push the prompts (B, P) except their last token, in one forward (the last token is
        fed by the first verification, where its slot predicts the first draft). -> guide calls."""
        P = prompt.shape[1]
        self.length.fill_(P - 1)
        if P > 1:
            self.forward(prompt[self.rows, :-1], 0)
        return int(P > 1)

    def verify(self, drafted: torch.Tensor, accept, chunk: int = 32):
        """Score each row's drafts. drafted (B, L): the canvas with every open position drafted, row b's drafts at
        [length[b] + 1, L); accept(logits (R, T, V), tokens (R, T)) -> bool (R, T): the rule (accept_drafts). A row's
        fed text [last, d0, ..., d_{N-2}] goes in chunks of `chunk` (the official verify_batch_size, 32) up to its first
        chunk with a rejection: n < N accepted drafts take n // chunk + 1 chunks, all N take ceil(N / chunk). Batched,
        forward k feeds the span covering every undecided row's chunk k (the guide is causal: re-fed verified slots get
        the same keys/values), so a step costs the most chunks of any row, one host read each. -> (n (B,), at (B, V),
        calls): the accepted run from the first draft, the guide's logits at the first rejected draft (zeros elsewhere),
        guide forwards. Leaves `length` alone (`commit`)."""
        y = drafted[self.rows]                                      # (R, L)
        R, L = y.shape
        start = self.length                                         # (R,) slot of the last committed token
        n = torch.full((R,), -1, dtype=torch.long, device=y.device)  # -1: not decided yet
        at = torch.zeros(R, self.model.config.vocab_size, dtype=self.cache.k[0].dtype, device=y.device)
        calls = 0                                                   # = the chunk index k
        while True:
            undecided = n < 0
            lo, hi = start + calls * chunk, (start + (calls + 1) * chunk).clamp(max=L - 1)   # each row's chunk k
            more, a, b = self.check(undecided.any(), torch.where(undecided, lo, L).min(),
                                    torch.where(undecided, hi, 0).max())
            if not more:
                break
            logits = self.forward(y[:, a:b], a)                     # (R, b - a, V): slot i judges token i + 1
            calls += 1
            slot = torch.arange(a, b, device=y.device)
            mine = undecided[:, None] & (slot >= lo[:, None]) & (slot < hi[:, None])
            bad = mine & ~accept(logits, y[:, a + 1:b + 1])
            first = torch.where(bad, slot, L).min(-1).values        # the first rejection's slot, L if none
            hit = first < L
            row = (first - a).clamp(0, b - a - 1)[:, None, None].expand(R, 1, logits.shape[-1])
            at = torch.where(hit[:, None], logits.gather(1, row).squeeze(1), at)
            n = torch.where(hit, first - start, n)
            n = torch.where(undecided & ~hit & (hi >= L - 1), L - 1 - start, n)      # every draft accepted
        n_all, at_all = n.new_zeros(len(drafted)), at.new_zeros(len(drafted), at.shape[-1])   # every batch row
        return n_all.index_copy_(0, self.rows, n), at_all.index_copy_(0, self.rows, at), calls

    def commit(self, n: torch.Tensor, done: torch.Tensor):
        """Row b committed n[b] tokens: keep the slots of `last` and the first n - 1 (the text minus its new last
        token). Slots past `length` hold stale drafts: the next verification overwrites them, and the causal mask
        never reads past its chunk. done (B,): finished rows leave the guide's batch, so they cost no more guide
        work (one host read a step; one copy of the cache when a row finishes)."""
        self.length += n[self.rows]
        keep = ~done[self.rows]
        if not self.check(keep.all())[0]:
            keep = keep.nonzero().squeeze(1)                        # one more read, then indices: no sync per layer
            self.rows, self.length = self.rows[keep], self.length[keep]
            self.cache.keep_rows(keep)
            self.pos, self.real = (None if t is None else t[keep] for t in (self.pos, self.real))


def accept_drafts(logits, drafts, rule: str = "deterministic", k: int = 5, ratio: float = 0.95,
                  threshold: float = 0.1):
    """FlashDLM's verification, the verdicts only (the step commits the accepted run): does the causal guide agree
    with each draft? logits (..., V): the guide's next-token logits at each draft's position; drafts (...) -> bool.
    - deterministic: the draft is the guide's argmax (what greedy decoding with the guide would write).
    - topk: the draft is among the guide's k most likely tokens (the official default k = 5).
    - topk_relative: in the top k *and* p(draft) >= ratio * p(top-1), so a flat top-k does not let an unlikely
      token through (their evaluator: k = 5, ratio = 0.95).
    - dynamic_threshold: p(draft) > threshold (the official `confidence_threshold`, default 0.1).
    - aggressive (the official constants): in the guide's top 5, or p(draft) > 0.05, or in its top-p 0.95 set
      (ids sorted by p, kept while their cumulative probability is <= 0.95).
    Decided on float32 probabilities, as the official code does (softmax, then argmax / topk / sort), so that
    ties and underflow to 0 fall the same way."""
    if rule not in ACCEPT_RULES:
        raise ValueError(f"unknown acceptance rule {rule!r}: use one of {', '.join(ACCEPT_RULES)}")
    p = logits.float().softmax(-1)                                            # (..., V)
    p_draft = p.gather(-1, drafts[..., None]).squeeze(-1)                     # (...)
    if rule == "deterministic":
        return p.argmax(-1) == drafts
    if rule == "dynamic_threshold":
        return p_draft > threshold
    if rule == "aggressive":
        top5 = (p.topk(min(5, p.shape[-1]), dim=-1).indices == drafts[..., None]).any(-1)
        sorted_p, order = p.sort(-1, descending=True)
        nucleus = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, order, sorted_p.cumsum(-1) <= 0.95)
        return top5 | (p_draft > 0.05) | nucleus.gather(-1, drafts[..., None]).squeeze(-1)
    top_p, top_ids = p.topk(min(k, p.shape[-1]), dim=-1)                      # (..., k)
    ok = (top_ids == drafts[..., None]).any(-1)
    return ok & (p_draft >= ratio * top_p[..., 0]) if rule == "topk_relative" else ok


def guide_token(logits, mask_id: int):
    """The guide's own token where it rejected a draft: the argmax of its float32 probabilities (what the official
    code writes for deterministic, topk and topk_relative; for the other rules it samples, which we do not
    replay). Never the mask id (the tiny test guide has that row; a committed mask would leave its position open)."""
    return argmax_except(logits.float().softmax(-1), mask_id)


def guided_commit(drafts, cand, n, fix, speculative: bool, eos):
    """What a guided step commits, per row. drafts (B, N): the diffusion model's argmax at the open columns cand
    (B, N), which run to the block's end (guided commits go left to right); n (B,): the accepted run from the
    first draft (Guide.verify); fix (B,): the guide's own token at the first rejected draft (guide_token).
    - assisted (FlashDLM's default): the accepted run, at least one draft: the model's text where the guide agrees.
    - speculative (the diffusion model as the drafter): the accepted run, then the guide's token for the rejected
      draft, so every committed token is one the rule lets the guide write (`deterministic`: its greedy text).
    Cut after the first end token (eos ids). -> (x0 (B, N), take (B, N), ended (B,))."""
    N = cand.shape[1]
    col = torch.arange(N, device=cand.device)
    rank = col - (N - cand.sum(-1, keepdim=True))           # 0 at each row's first open column
    if speculative:
        x0 = torch.where(rank == n[:, None], fix[:, None], drafts)
        take = cand & (rank <= n[:, None])
    else:
        x0, take = drafts, cand & (rank < n.clamp(min=1)[:, None])
    end = take & torch.isin(x0, eos)
    cut = torch.where(end, col, N).min(-1, keepdim=True).values
    return x0, take & (col <= cut), end.any(-1)


class Guided(StepRule):
    """The guided step rule, for the whole batch: drafts are the argmax at every open position over the guide's
    ids (Dream-7B has 152064 rows, Qwen2.5 151936: rows past the tokenizer are padding); the guide verifies them,
    and what guided_commit takes is the proposal's `open` (k = all: the plan's selection is the schedule)."""

    def __init__(self, guide: Guide, accept, chunk: int, eos, mask_id: int, speculative: bool, prompt):
        self.guide, self.accept, self.chunk, self.eos, self.mask_id = guide, accept, chunk, eos, mask_id
        self.speculative, self.guide_calls = speculative, guide.prefill(prompt)

    def propose(self, logits, at) -> Proposal:
        drafts = argmax_except(logits[..., :self.guide.model.config.vocab_size], self.mask_id)      # (B, n)
        drafts = torch.zeros_like(at.masked, dtype=drafts.dtype).index_copy_(1, at.cols, drafts)    # (B, N)
        drafted = torch.cat([at.x[:, :at.s], torch.where(at.masked, drafts, at.x[:, at.s:])], 1)   # every mask drafted
        n, rejected, calls = self.guide.verify(drafted, self.accept, self.chunk)
        fix = guide_token(rejected, self.mask_id)
        x0, take, ended = guided_commit(drafts, at.masked, n, fix, self.speculative, self.eos)
        self.guide.commit(count := take.sum(-1), ended | (count == at.masked.sum(-1)))     # finished rows leave
        self.guide_calls += calls
        return Proposal(x0, torch.where(take, 0.0, NEG_INF), take, count, logits)


class GuidedFreeCache(FreeCache):
    """Guided FreeCache (FlashDLM's aggressive caching, both families): a row's feed starts at its last committed
    token, so a committed token is frozen with keys computed while it held its token, not a mask. A batch feeds
    from the leftmost row's (one host read a step); every other row keeps its frozen prefix (its earlier
    positions, and all of a finished row, go to the discard slot). The span changes, so compile=True stays eager."""
    fixed_width = False

    def last(self, at):
        """(B,) each row's last committed position; L for a row with nothing left to decode."""
        return torch.where(at.masked.any(-1), at.s + at.masked.long().argmax(-1) - 1, at.x.shape[1])

    def span(self, at) -> tuple[int, int]:
        return (0 if at.n == 0 else int(self.last(at).min()), at.x.shape[1])

    def slots(self, at, fed):
        if at.n == 0 or at.x.shape[0] == 1:      # the first call writes everything; one row feeds from its own
            return None
        return torch.where(fed < self.last(at)[:, None], at.x.shape[1], fed)


def check_guided(cfg, st, given: dict, longest: int, name=lambda key: key):
    """A loaded causal guide sharing the model's token ids, then check_guided_settings."""
    if isinstance(guide := st.guide, str):
        raise ValueError(f"guide must be a loaded causal model, not the path {guide!r}: load it with "
                         f"model.load_model(path)")
    if not isinstance(guide, torch.nn.Module) or not getattr(getattr(guide, "config", None), "causal", False):
        raise ValueError(f"guide must be a causal LM loaded with model.load_model (a Qwen2-format checkpoint, e.g. "
                         f"Qwen/Qwen2.5-1.5B-Instruct for Dream), not {type(guide).__name__}")
    check_guide(cfg, guide.config)
    check_guided_settings(st, type(st)(), name)


def check_guided_settings(st, defaults, name=lambda key: key):
    """Guided diffusion's own settings, needing no model (options.check_early runs it before any is loaded): the
    guide decides how many drafts to commit, so no other parallel rule applies, and drafts are the argmax (no
    sampling); a setting the chosen acceptance rule never reads is refused unless at its default (`defaults`:
    fastdllm.Settings). name(key) words a setting as its caller knows it (`--accept-k`)."""
    clash = next((k for k in ("threshold", "factor", "select", "propose") if getattr(st, k) is not None), None)
    if clash:
        raise ValueError(f"pass {name('guide')} or {name(clash)}, not both: with a guide the guide decides how many "
                         f"drafts each step commits")
    if st.temperature:
        raise ValueError(f"{name('temperature')} must be 0 with {name('guide')}: guided drafts are the diffusion "
                         f"model's argmax (got {st.temperature})")
    if st.accept not in ACCEPT_RULES:
        raise ValueError(f"unknown accept rule {st.accept!r}: use one of {', '.join(ACCEPT_RULES)}")
    if type(st.accept_k) is not int or st.accept_k < 1:
        raise ValueError(f"accept_k must be an integer >= 1 (got {st.accept_k!r})")
    if not isinstance(ratio := st.accept_ratio, numbers.Real) or isinstance(ratio, bool) or not 0 < ratio <= 1:
        raise ValueError(f"accept_ratio must be in (0, 1] (got {st.accept_ratio!r})")
    if type(st.verify_chunk) is not int or st.verify_chunk < 1:
        raise ValueError(f"verify_chunk must be an integer >= 1 (got {st.verify_chunk!r})")
    if type(st.speculative) is not bool:
        raise ValueError(f"speculative must be True or False (got {st.speculative!r})")
    if isinstance(t := st.accept_threshold, bool) or not isinstance(t, numbers.Real) or not 0 <= t < 1:
        raise ValueError(f"accept_threshold must be a number in [0, 1) (got {t!r}): the guide accepts a draft "
                         f"whose probability exceeds it")
    check_accept(st.accept, {k for k in ACCEPT_READS if getattr(st, k) != getattr(defaults, k)}, name)


def check_accept(accept: str, given, name=lambda key: key):
    """given: the acceptance settings the caller chose (the API: those not at their default; the CLI: the flags
    on its command line); name(key) words a setting as the caller knows it (`--accept-k`)."""
    for key in sorted(set(given) & set(ACCEPT_READS)):
        if accept not in ACCEPT_READS[key]:
            rules = " or ".join(ACCEPT_READS[key])
            raise ValueError(f"{name(key)} only applies to {name('accept')} {rules}, not {accept!r}: drop it, or "
                             f"pick that rule")


def check_guide(model_cfg: ModelConfig, guide_cfg: ModelConfig, model_tok=None, guide_tok=None):
    """A guide that does not share the diffusion model's token ids, refused in one line: it is fed the model's ids
    and its verdicts compared id for id (the official fallback, re-tokenising through text, is not one-to-one). On the
    configs and, when given, both tokenizers: the guide is causal and the model is not; the guide has a row for every
    id the model can write (its tokenizer's, but the mask: Dream-7B's 152064 rows and Qwen2.5-1.5B's 151936 are
    padding past both tokenizers' ends); the end-of-text id is the same token to both (without tokenizers, one of
    the guide's bos/eos ids: Dream's <|endoftext|> 151643 is Qwen2.5-1.5B-Instruct's bos); every id both tokenizers
    define is the same token, and one only the model's defines is its special token (Dream's <|mask|>...)."""
    if not guide_cfg.causal:
        raise ValueError(f"the guide is a {guide_cfg.family} model, not a causal LM: pass a Qwen2-format "
                         f"checkpoint (model_type 'qwen2') as the guide")
    if model_cfg.causal:
        raise ValueError("the model to decode is a causal LM (qwen2), not a diffusion LM: pass it as the guide "
                         "and a LLaDA or Dream checkpoint as the model")
    if model_tok is not None:
        n = model_tok.get_vocab_size(with_added_tokens=True)
        top = n - 2 if model_cfg.mask_id == n - 1 else n - 1      # the largest id the model can write
    else:   # configs alone: text ids lie below the mask id (Dream 151666 of 152064 rows; the rest is padding)
        top = min(model_cfg.vocab_size, model_cfg.mask_id) - 1
    if guide_cfg.vocab_size <= top:
        raise ValueError(f"the guide has {guide_cfg.vocab_size} token ids but the diffusion model can write ids up "
                         f"to {top}: the guide must use the diffusion model's tokenizer (the same token ids)")
    eos = model_cfg.eos_id
    if model_tok is None or guide_tok is None:
        guide_ids = [*guide_cfg.eos_ids, guide_cfg.bos_id]
        if eos not in guide_ids:
            raise ValueError(f"the diffusion model's end-of-text id {eos} is none of the guide's special ids "
                             f"{sorted(set(guide_ids) - {None})}: the guide must use the diffusion model's tokenizer")
        return
    if eos is not None and model_tok.id_to_token(eos) != guide_tok.id_to_token(eos):
        raise ValueError(f"end-of-text id {eos} is {model_tok.id_to_token(eos)!r} to the diffusion model but "
                         f"{guide_tok.id_to_token(eos)!r} to the guide: they must share a tokenizer")
    specials = {i for i, t in model_tok.get_added_tokens_decoder().items() if t.special}
    for token, i in model_tok.get_vocab(with_added_tokens=True).items():
        theirs = guide_tok.id_to_token(i)
        if theirs != token and (theirs is not None or i not in specials) and i != model_cfg.mask_id:
            raise ValueError(f"token id {i} is {token!r} to the diffusion model but {theirs!r} to the guide: "
                             f"the guide must use the diffusion model's tokenizer (the same token ids)")


def guided_defaults(cfg, st, given) -> dict:
    """One block over the answer, one token a step as the schedule (the guide decides how many a step commits)."""
    return dict(block_length=st.gen_length, steps=st.gen_length)


def guided_parts(model, st, given, generator, c: Canvas, eos):
    """A guided call's step rule, selection rule, cache policy and stop rule (fastdllm.make_plan): one block over the
    answer; "dual" is "prefix" there (the only block has no suffix), "free" the aggressive caching; a committed end
    token ends the answer (FlashDLM's rule, k = 1)."""
    B, L, mask_id = c.x.shape[0], c.x.shape[1], model.config.mask_id
    real = None if c.pos is None else c.mask[:, 0, -1]          # (B, L): the real positions (an answer's row of keys)
    accept = partial(accept_drafts, rule=st.accept, k=st.accept_k, ratio=st.accept_ratio, threshold=st.accept_threshold)
    rule = Guided(Guide(st.guide, B, L, c.pos, real), accept, st.verify_chunk, eos, mask_id, st.speculative,
                  c.x[:, :L - st.gen_length])
    feed = GuidedFreeCache() if st.cache == "free" else NoCache() if st.cache == "none" else PrefixCache()
    return Parts(rule, Schedule(), feed, stop_rule(st, c, eos, mask_id, run=1))


GUIDED = Family(defaults=guided_defaults, check=check_guided, canvas=answer_canvas, parts=guided_parts)
