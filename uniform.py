"""
uniform.py: DiffusionGemma's decode (google/diffusiongemma-26B-A4B-it; its network is gemma.py), uniform-state block
diffusion in fastdllm.py's one loop. The official decode is huggingface/transformers v5.23.0,
src/transformers/models/diffusion_gemma/generation_diffusion_gemma.py (docs/diffusiongemma.md tells it).

The answer is decoded canvas by canvas (the loop's blocks, block_length = the checkpoint's canvas_length). Nothing is
masked: a canvas starts as random tokens (`start_block`), and each step (`GemmaStep.propose`)
- samples a whole canvas from the decoder's logits at the schedule's temperature, t_max down towards t_min;
- offers every position, most confident (lowest entropy) first, to the entropy bound (sampler.EntropyBound, the
  EB-Sampler rule), which accepts a run whose entropies, summed less the largest, stay under the bound;
- and the commit keeps the accepted samples and renoises every other position with fresh random tokens
  (Proposal.rest); the step's logits condition the next step (self-conditioning, `GemmaCall`).
A row's canvas is done once its argmax is stable and confident (adaptive stopping) or after `steps` steps: its answer
is that last argmax, not the sampled canvas, which the commit writes in; the next canvas's first call then commits
it into the KV cache through the causal encoder (cache.BlockWindow: the block before, with the block). What a step
may still write is a row's canvas while it denoises (`GemmaStep.undecided`, the loop's `Plan.undecided`). A row whose
finished canvas holds an end token has ended (`CanvasEnd`); what follows its first end token is padding.
Randomness only from the generator, drawn in the official order: a canvas's start (one randint (B, C)), then per step
the multinomial draw and the renoise (one randint (B, C)); every row draws, as officially. With a generator per row,
each row draws from its own as it would alone, so a batch row equals its solo run (the official's one stream cannot).
"""
import math
from functools import partial

import torch
import torch.nn.functional as F

from cache import BlockWindow, CachePolicy
from gemma import check_decode, check_text_only, positions
from family import Canvas, Family, Parts
from sampler import NEG_INF, EntropyBound, NoStop, Proposal, StepRule, entropy

OWN = ("entropy_bound", "t_min", "t_max", "stability_threshold", "confidence_threshold")   # its settings alone


class GemmaStep(StepRule):
    """DiffusionGemma's step rule: the sampled canvas, each position's confidence its negative entropy (the entropy
    bound's order), the renoise as the rest; a row whose canvas stops writes its argmax."""
    reads_block = True      # every position of the canvas is proposed at every step
    edits = True            # a canvas may change until it ends (a stream shows canvases once they end)

    def __init__(self, *, steps: int, t_min, t_max, stability_threshold, confidence_threshold, vocab: int,
                 answer_at: int, eos, generator, shape: tuple, device=None):
        self.steps_per_block, self.t_min, self.t_max = steps, t_min, t_max
        self.stability, self.confidence = stability_threshold, confidence_threshold
        self.vocab, self.answer_at, self.eos, self.generator = vocab, answer_at, eos, generator
        # The last step's scaled logits, the next step's self-conditioning, and which rows read them (none at a
        # canvas's first step): buffers at fixed addresses that the model call reads (GemmaCall; a CUDA graph).
        (B, C), self.argmax = shape, None     # argmax: the last step's (B, C), the canvas a stream shows (view)
        self.sc = torch.zeros(B, C, vocab, dtype=torch.float32, device=device)
        self.sc_on = torch.zeros(B, dtype=torch.bool, device=device)

    def start_block(self, x, s: int, e: int):
        """A canvas of random tokens for every row still answering (a row whose answer has ended keeps its padding)."""
        (B, C), g = (x.shape[0], e - s), self.generator
        self.block, self.argmax = (s, e), None
        self.sc_on.fill_(False)
        self.denoising = ~torch.isin(x[:, self.answer_at:s], self.eos).any(-1)          # (B,)
        self.history = torch.full((self.stability or 0, B, C), -1, device=x.device)     # the last argmaxes
        if isinstance(g, list):      # a generator per row: each row still answering draws as it would alone
            start = torch.zeros(B, C, dtype=torch.long, device=x.device)
            for b in self.drawing():
                start[b] = torch.randint(0, self.vocab, (C,), generator=g[b], device=x.device)
        else:                        # one for the batch: every row draws, the official order
            start = torch.randint(0, self.vocab, (B, C), generator=g, device=x.device)
        x[:, s:e] = torch.where(self.denoising[:, None], start, x[:, s:e])

    def drawing(self) -> list:
        """The rows still denoising, on the host (a read: only with a generator per row)."""
        return [b for b, on in enumerate(self.denoising.tolist()) if on]

    def draws(self, probs):
        """A step's draws, in the official order: every position's sample from probs (B, C, V), then the renoise's random
        tokens (B, C). One generator: for the batch at once, every row drawing; one per row: each row still denoising
        from its own, as it would alone."""
        (B, C, V), g = probs.shape, self.generator
        if not isinstance(g, list):
            sample = torch.multinomial(probs.view(B * C, V), 1, generator=g).view(B, C)
            return sample, torch.randint(0, V, (B, C), generator=g, device=probs.device)
        sample, noise = (torch.zeros(B, C, dtype=torch.long, device=probs.device) for _ in range(2))
        for b in self.drawing():
            sample[b] = torch.multinomial(probs[b], 1, generator=g[b]).view(C)
            noise[b] = torch.randint(0, V, (C,), generator=g[b], device=probs.device)
        return sample, noise

    def undecided(self, x):
        """(B, L) bool: the canvas of each row still denoising."""
        open_ = torch.zeros_like(x, dtype=torch.bool)
        open_[:, self.block[0]:self.block[1]] = self.denoising[:, None]
        return open_

    def view(self, x):
        """on_step's canvas (Parts.view): where a row still denoises, the step's argmax (the answer it would give
        now; the sampled canvas the commit writes is mostly noise to a reader); elsewhere x, with no end cut."""
        if self.argmax is None:
            return x
        s, e = self.block
        return torch.cat([x[:, :s], torch.where(self.denoising[:, None], self.argmax, x[:, s:e]), x[:, e:]], 1)

    def temperature(self, i: int):
        """The official schedule at step i: t_min + (t_max - t_min) * (steps - i) / steps, in float32 (the last
        step's is t_min + (t_max - t_min) / steps, never t_min itself)."""
        return self.t_min + (self.t_max - self.t_min) * (torch.tensor(self.steps_per_block - i, dtype=torch.int32) /
                                                           self.steps_per_block)

    def propose(self, logits, at) -> Proposal:
        scaled = logits if self.t_min is None else logits / self.temperature(at.i).to(logits.device)   # (B, C, V)
        B, C, V = scaled.shape
        sample, noise = self.draws(F.softmax(scaled, dim=-1, dtype=torch.float32))
        h, argmax = entropy(scaled), scaled.argmax(-1)                                     # (B, C) each
        # Adaptive stopping: the argmax the same as at the last `stability` steps, and the mean entropy low.
        stops = torch.zeros_like(self.denoising) if self.stability is None else (
            (self.history == argmax).all(-1).all(0) & (h.mean(-1) < self.confidence))
        self.history = torch.cat([self.history, argmax[None]])[1:]
        ends = self.denoising & (stops | (at.i + 1 >= self.steps_per_block))           # rows whose canvas ends now
        open_ = (self.denoising & ~ends)[:, None].expand(B, C)
        rest = torch.where(ends[:, None], argmax, torch.where(self.denoising[:, None], noise, at.x[:, at.s:at.e]))
        self.denoising, self.argmax = self.denoising & ~ends, argmax
        self.sc.copy_(scaled)
        self.sc_on.fill_(True)
        return Proposal(sample, (-h).masked_fill(~open_, NEG_INF), open_, open_.sum(-1), scaled, rest=rest)


class GemmaCall:
    """The loop's model call (Plan.layers) for DiffusionGemma: the model's own, gemma.DiffusionGemma.hidden (a fed
    span ends with the canvas; what comes before it, a canvas's first call's prompt or last canvas, is committed and
    goes through the causal encoder first; the canvas through the decoder, self-conditioned), run eager, replayed
    from CUDA graphs or compiled (`run`: graphs.model_call), given what it reads beyond the loop's arguments: each
    cache slot's validity (valid (B, L): a real token, not a left pad) and position, and the step rule's
    self-conditioning buffers (the last logits, and the rows that read them)."""

    def __init__(self, rule: GemmaStep, valid, run):
        self.rule, self.valid, self.pos, self.run = rule, valid, positions(valid), run

    def __call__(self, ids, pos, kv, slots, mask):
        return self.run(ids, pos, kv, slots, mask, self.valid, self.pos, self.rule.sc, self.rule.sc_on)


class CanvasEnd:
    """The end of text: a row's answer has ended once a canvas it finished holds an end token (what follows it is the
    output's padding)."""

    def __init__(self, rule: GemmaStep):
        self.rule = rule

    def __call__(self, x, at, p):
        return torch.isin(x[:, self.rule.answer_at:at.e], self.rule.eos).any(-1) & ~self.rule.denoising


class Recompute(CachePolicy):
    """cache="none": every call feeds everything up to the canvas's end, so the encoder recomputes the committed keys/
    values (exact: they are causal) and nothing is reused from an earlier call."""

    def span(self, at):
        return 0, at.e


# transformers' own defaults of the official decode, where generation_config.json does not set one.
FALLBACK = dict(steps=48, entropy_bound=0.1, t_min=0.4, t_max=0.8, stability_threshold=1, confidence_threshold=0.005)


def gemma_defaults(cfg, st, given) -> dict:
    """The checkpoint's generation_config.json (its canvas, its steps and decode settings), for what was not given;
    stop_at_eos unless told otherwise (the official decode always ends a row at an end token)."""
    decode = FALLBACK | dict(cfg.gemma.decode)
    out = {k: v for k, v in decode.items() if k != "steps" and k not in given}
    return out | dict(block_length=st.block_length if given.get("block_length") else cfg.gemma.canvas,
                      steps=st.steps if st.steps is not None else decode.get("steps", 48),
                      stop_at_eos=st.stop_at_eos if "stop_at_eos" in given else True)


def check_gemma(cfg, st, given: dict, longest: int, name=lambda key: key):
    """What a DiffusionGemma call refuses, in one line naming the setting."""
    if st.block_length != cfg.gemma.canvas:
        raise ValueError(f"{name('block_length')} {st.block_length} is not this checkpoint's canvas: config.json "
                         f"declares canvas_length {cfg.gemma.canvas}; pass that (or leave it unset)")
    check_decode(st.steps, st.entropy_bound, st.t_min, st.t_max, st.stability_threshold, st.confidence_threshold, name)
    defaults = type(st)()
    other = [k for k in ("threshold", "factor", "temperature", "remasking", "top_p", "top_k", "alg_temp", "sub_block",
                         "minimal_topk", "editing_threshold", "max_post_steps", "num_to_transfer", "eps")
             if given.get(k, getattr(defaults, k)) != getattr(defaults, k)]
    if other:
        raise ValueError(f"{name(other[0])} does not apply to DiffusionGemma: it samples at the temperatures "
                         f"{name('t_max')} down to {name('t_min')} and accepts by its {name('entropy_bound')} (a rule "
                         f"of your own: select=); drop {name(other[0])}")
    if st.cache == "free":
        raise ValueError(f"{name('cache')} 'free' does not apply to DiffusionGemma: its committed canvases are causal, "
                         f"so its prefix cache is exact; use 'prefix' (or 'dual', the same) or 'none'")


def gemma_canvas(prompt, attention_mask, st, cfg, eos) -> Canvas:
    """[prompt, canvases]: the answers after a common prompt width, ceil(gen_length / C) canvases of C (the official
    does not cut the last one short), each drawn at its start (GemmaStep.start_block). A left-padded row's positions
    count from its first real token (GemmaCall); generate()'s ids have padding after each row's first end token."""
    (B, P), C = prompt.shape, st.block_length
    n, pad = math.ceil(st.gen_length / C), cfg.pad_id
    x = F.pad(prompt, (0, n * C), value=pad if pad is not None else int(eos[0]))
    lengths = attention_mask.to(x.device).long().sum(-1) if attention_mask is not None else torch.full(
        (B,), P, device=x.device)
    L = x.shape[1]

    def output(x):          # padding after a row's first end token (no early stop, or pad_token_id None: none)
        ended = torch.isin(x, eos) & (torch.arange(L, device=x.device) >= P)
        return x if pad is None or not st.stop_at_eos else x.masked_fill(ended.long().cumsum(-1) - ended.long() > 0,
                                                                           pad)
    return Canvas(x, [(s, s + C) for s in range(P, L, C)], torch.stack([P - lengths, torch.full_like(lengths, P)], -1),
                  None, None, lambda b: min(L, P + -(-(b - P) // C) * C), torch.full_like(lengths, L), pad, output,
                  output)


def gemma_parts(model, st, given, generator, c: Canvas, eos):
    cfg = model.config
    check_text_only(cfg, c.x)
    P = c.x.shape[1] - len(c.blocks) * st.block_length
    rule = GemmaStep(steps=st.steps, t_min=st.t_min, t_max=st.t_max, stability_threshold=st.stability_threshold,
                     confidence_threshold=st.confidence_threshold, vocab=cfg.vocab_size, answer_at=P,
                     eos=eos if st.stop_at_eos else eos[:0], generator=generator,    # no end: every canvas decoded
                     shape=(c.x.shape[0], st.block_length), device=c.x.device)
    cache = st.cache if isinstance(st.cache, CachePolicy) else Recompute() if st.cache == "none" else BlockWindow()
    valid = torch.arange(c.x.shape[1], device=c.x.device) >= c.prompt[:, :1]
    stop = st.stop or (CanvasEnd(rule) if st.stop_at_eos else NoStop())
    return Parts(rule, st.select or EntropyBound(st.entropy_bound, torch.float32), cache, stop,
                 partial(GemmaCall, rule, valid), rule.view)


GEMMA = Family(defaults=gemma_defaults, check=check_gemma, canvas=gemma_canvas, parts=gemma_parts)
