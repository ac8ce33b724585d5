"""
DiffusionGemma's decode, naive and in our words: what the official generate() does (huggingface/transformers v5.23.0,
src/transformers/models/diffusion_gemma/generation_diffusion_gemma.py; docs/diffusiongemma.md), written apart from
fastdllm.py's loop so that the loop can be tested against it, as tests/reference.py is for the other families.

Per canvas of C tokens: the canvas starts as uniform random tokens; each denoising step (cur_step = N, N-1, ..., 1)
runs the decoder on it, divides the logits by the temperature t_min + (t_max - t_min) * cur_step / N, samples every
position, accepts the lowest-entropy positions under the entropy bound (EB-Sampler: sorted ascending, position k
is accepted while the entropies before it sum to at most the bound) and replaces every other position with fresh
random tokens; the step's scaled logits condition the next step (self-conditioning). A canvas stops early once its
argmax is stable and its mean entropy is below a threshold, row by row. Its answer is the last argmax, which the
encoder then commits to the KV cache; a row whose canvas holds an end token is finished: every token after its first
end token, and every later canvas, is padding.

Randomness comes from `generator` only, in the official order: per canvas one randint (B, C) for the start canvas
(drawn even when a start canvas is given), then per step the multinomial draw (on the CPU: B*C*V exponentials) and
one randint (B, C) for the renoise. Rows that are finished still draw, as in the official code.
"""
import math

import torch
import torch.nn.functional as F

from cache import KVCache
from gemma import positions


def temperature(cur_step: int, steps: int, t_min, t_max):
    """The official schedule: t_min + (t_max - t_min) * cur_step / steps, in float32 tensor arithmetic as it computes
    it (cur_step is an int32 tensor there). The last step (cur_step 1) never reaches t_min."""
    return t_min + (t_max - t_min) * (torch.tensor(cur_step, dtype=torch.int32) / steps)


def entropy(logits):
    """Each position's entropy under softmax(logits), as torch.distributions.Categorical computes it."""
    return torch.distributions.Categorical(logits=logits).entropy()


def accept(h, entropy_bound: float):
    """EB-Sampler's rule on entropies h (B, C): sort ascending; accept the k-th lowest while the entropies before it
    sum to at most the bound (the lowest is always accepted). Not cumulative over steps: each step decides anew."""
    low, order = torch.sort(h, dim=-1)
    keep = low.cumsum(-1) - low <= entropy_bound
    return torch.zeros_like(keep).scatter(-1, order, keep)


def denoise_step(model, canvas, kv, slots, valid, pos, sc, cur_step, steps, entropy_bound, t_min, t_max, generator,
                 rule=None):
    """One step: the decoder on `canvas`, the schedule's temperature, the sample, the accepted positions and the
    renoised next canvas. rule(scaled logits, sample) -> accepted (B, C) bool replaces the entropy bound (a fork's
    rule, written here from its formula). Returns (scaled logits, sample, accepted, argmax, next canvas)."""
    logits = model.decode(canvas, kv, slots, valid, pos, sc_logits=sc)
    if t_min is not None and t_max is not None:
        logits = logits / temperature(cur_step, steps, t_min, t_max)
    B, C, V = logits.shape
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    sample = torch.multinomial(probs.view(B * C, V), 1, generator=generator).view(B, C)
    accepted = accept(entropy(logits), entropy_bound) if rule is None else rule(logits, sample)
    noise = torch.randint(0, V, (B, C), generator=generator)
    return logits, sample, accepted, logits.argmax(-1), torch.where(accepted, sample, noise)


@torch.inference_mode()
def reference_generate(model, prompt, attention_mask=None, canvas_length=None, max_new_tokens=256, steps=48,
                       entropy_bound=0.1, t_min=0.4, t_max=0.8, stability_threshold=1, confidence_threshold=0.005,
                       eos_ids=(1, 106, 50), pad_id=0, generator=None, start_canvas=None, official_positions=False,
                       trace=None, force=None, rule=None):
    """prompt (B, L) ids, attention_mask (B, L) 1 = token, 0 = padding (None: none). Decodes ceil(max_new_tokens / C)
    canvases at most (the official does not cut the last one short). Positions count each row's real tokens, so a
    padded row decodes as it would alone; official_positions=True numbers the slots instead, as the official code
    does (its padded golden runs). stability_threshold / confidence_threshold None: no adaptive stopping. trace: a
    list to append each step's (input canvas, sample, accepted, argmax, next canvas, finished rows) to. force: teacher
    forcing, for comparing steps with a recorded run: {"canvases": [c][step] input canvas, "commits": [c] canvas}.
    rule: an acceptance rule in place of the entropy bound (denoise_step).
    Returns dict(ids (B, L + n C), decoder_calls [B], steps_per_canvas [n], tokens_per_call [B])."""
    cfg = model.config
    B, L = prompt.shape
    C = canvas_length or cfg.gemma.canvas
    V = cfg.vocab_size
    n = math.ceil(max_new_tokens / C)
    mask = torch.ones(B, L, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    valid = torch.cat([mask, torch.ones(B, n * C, dtype=torch.bool)], dim=1)        # every canvas slot is real
    pos = torch.arange(L + n * C).expand(B, -1) if official_positions else positions(valid)
    kv = KVCache.for_model(model, B, L + n * C)
    adaptive = stability_threshold is not None and confidence_threshold is not None
    eos = torch.tensor(list(eos_ids))
    ids, finished = prompt, torch.zeros(B, dtype=torch.bool)
    calls, steps_per_canvas = torch.zeros(B, dtype=torch.long), []

    model.encode(prompt, kv, torch.arange(L), valid, pos)                           # the prefill
    for c in range(n):
        slots = torch.arange(L + c * C, L + (c + 1) * C)
        canvas = torch.randint(0, V, (B, C), generator=generator)
        if c == 0 and start_canvas is not None:
            canvas = start_canvas
        argmax, sc = canvas, None
        done = torch.zeros(B, dtype=torch.bool)                                    # this canvas stopped (adaptive)
        history = torch.full((stability_threshold or 0, B, C), -1)                 # earlier argmaxes
        for cur_step in range(steps, 0, -1):
            if force is not None and steps - cur_step < len(force["canvases"][c]):
                canvas = force["canvases"][c][steps - cur_step]
            calls += ~(done | finished)
            logits, sample, accepted, new_argmax, new_canvas = denoise_step(
                model, canvas, kv, slots, valid, pos, sc, cur_step, steps, entropy_bound, t_min, t_max, generator, rule)
            if adaptive:        # a row that stopped keeps its argmax, canvas and logits
                new_argmax = torch.where(done[:, None], argmax, new_argmax)
                new_canvas = torch.where(done[:, None], canvas, new_canvas)
                logits = torch.where(done[:, None, None], sc, logits) if sc is not None else logits
                stable = (history == new_argmax).all(-1).all(0)                    # (B,); threshold 0: always
                history = torch.cat([history, new_argmax[None]])[1:] if len(history) else history
                done |= stable & (entropy(logits).mean(-1) < confidence_threshold)
            if trace is not None:
                trace.append(dict(canvas=c, input_canvas=canvas, sample=sample, accepted=accepted, argmax=new_argmax,
                                  next_canvas=new_canvas, done=done.clone()))
            canvas, argmax, sc = new_canvas, new_argmax, logits.to(model.embed.weight.dtype)
            if done.all():
                break
        steps_per_canvas.append(steps - cur_step + 1)
        # The answer is the last argmax; the encoder commits it at the canvas's slots.
        argmax = argmax if force is None else force["commits"][c]
        finished_before = finished.clone()
        finished |= torch.isin(argmax, eos).any(-1) | (ids.shape[1] + C >= L + max_new_tokens)
        if pad_id is not None:
            after_eos = torch.isin(argmax, eos).long().cumsum(-1) - torch.isin(argmax, eos).long() > 0
            argmax = argmax.masked_fill(after_eos | finished_before[:, None], pad_id)
        ids = torch.cat([ids, argmax], dim=1)
        if finished.all():
            break
        model.encode(argmax, kv, slots, valid, pos)
    new = ids[:, L:]
    real = (new != pad_id).sum(-1) if pad_id is not None else torch.full((B,), new.shape[1])
    return dict(ids=ids, decoder_calls=calls.tolist(), steps_per_canvas=steps_per_canvas,
                tokens_per_call=(real / calls).tolist())
