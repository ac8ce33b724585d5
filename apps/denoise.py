"""
denoise.py: serve.py's two endpoints for the page, without HTTP: what GET /v1/denoise/info says the loaded model
accepts, and the events of POST /v1/denoise/stream (docs/serve.md, "The per-step event stream").

The stream's contract holds for every rule, one that edits included (LLaDA2.1's T2T, llada2.py):
- one "step" event per model call of the answer: the calls generate() counts for its row (stats["row_nfe"]), so
  the events number the answer's `nfe`, whatever the call did;
- each event lists what its call changed of the answer, in three kinds: `committed` (a mask the model decided),
  `edited` (a token the rule rewrote) and `filled` (a mask the stop rule set to end of text once the answer ended).
  Over the events, committed + filled are the answer's positions, each once; `masks_left` never grows;
- "done" then lists `cut`: what the final answer changes after the last call (a block-diffusion answer ends at its
  first end token, and what follows becomes the pad: Fast-dLLM v2's early stop, LLaDA2's always).
"""
import torch

from api import usage
from blockdiff import FAMILIES as BLOCK_FAMILIES, SDAR_REMASKING
from cache import CACHE_POLICIES
from chat import decode
from options import checked, settings
from llada2 import EDITING_ONLY
from sampler import DREAM_REMASKING, LLADA_REMASKING

EDITING = ("editing_threshold", *EDITING_ONLY)       # LLaDA2.1's editing settings, request fields too

# A value of each decoding setting a request may send (api.FIELDS) that its own check takes, to ask generate()'s
# checks whether the loaded model reads it; LLaDA2.1's two that need editing_threshold are asked with it.
PROBES = {"threshold": 0.9, "factor": 1.0, "temperature": 0.5, "top_p": 0.5, "top_k": 1, "editing_threshold": 0.5,
          "max_post_steps": 1, "num_to_transfer": 1}
NEEDS = {"max_post_steps": {"editing_threshold": 0.5}, "num_to_transfer": {"editing_threshold": 0.5}}


def accepts(model, block_length) -> dict:
    """What a request may set on this model, as generate()'s own checks answer (options.checked: no model call)
    for a one-token prompt and one block: {"cache_modes", "remasking_modes", "settings"}."""
    cfg = model.config
    gen = block_length or cfg.block or 32
    prompt = torch.tensor([[int(cfg.mask_id == 0)]], device=model.lm_head.weight.device)

    def takes(**kw) -> bool:
        try:
            checked(model, prompt, dict(gen_length=gen, block_length=block_length) | kw)
            return True
        except ValueError:
            return False
    caches = [c for c in CACHE_POLICIES if takes(cache=c)]
    remasking = [r for r in dict.fromkeys(LLADA_REMASKING + DREAM_REMASKING + SDAR_REMASKING) if takes(remasking=r)]
    own = [k for k, v in PROBES.items() if takes(**{k: v} | NEEDS.get(k, {}))]
    steps = ["steps"] * takes(steps=gen)
    return {"cache_modes": caches, "remasking_modes": remasking,
            "settings": ["cache", "block_length", *steps, *own, *["remasking"] * bool(remasking)]}


class Calls:
    """The worker's side of a batch: after each call (on_step's stats), which rows it was a call of (row_nfe grew)
    and how many masks the model committed in each (row_committed): a read of two (B,) tensors, made while a client
    streams steps."""

    def __init__(self, rows: int):
        self.nfe, self.committed = [0] * rows, [0] * rows

    def step(self, stats) -> list:
        """-> per row: None (not its call), or the masks the model committed in it."""
        nfe, committed = stats["row_nfe"].tolist(), stats["row_committed"].tolist()
        out = [c - c0 if n > n0 else None for n, n0, c, c0 in zip(nfe, self.nfe, committed, self.committed)]
        self.nfe, self.committed = nfe, committed
        return out


class Answer:
    """The stream's side of one answer: its first n positions as the last event left them, and each call's canvas
    against them -> that call's changes, by kind."""

    def __init__(self, n: int, mask_id: int, cell):
        self.canvas, self.mask_id, self.cell = [mask_id] * n, mask_id, cell

    def step(self, ids: list, committed: int) -> dict:
        M, ids = self.mask_id, ids[:len(self.canvas)]
        unmasked = [p for p, (t, old) in enumerate(zip(ids, self.canvas)) if old == M and t != M]
        edited = [p for p, (t, old) in enumerate(zip(ids, self.canvas)) if M != old != t]
        # The model commits in its block; the built-in stop rules fill after every token decoded (EndOfText: the
        # blocks after a finished one; FlashDLM's rule: past the right-most token), so of the masks this call decided
        # the first `committed` are the model's. (It may commit past the n shown, in the last block: no fill there.)
        k = min(committed, len(unmasked))
        self.canvas = ids
        return {"committed": self.cells(unmasked[:k]), "edited": self.cells(edited),
                "filled": self.cells(unmasked[k:]), "masks_left": ids.count(M)}

    def end(self, ids: list) -> list:
        """The final answer's changes after the last call (the end cut)."""
        ids, before = ids[:len(self.canvas)], self.canvas
        self.canvas = ids
        return self.cells([p for p, (t, old) in enumerate(zip(ids, before)) if t != old])

    def cells(self, positions: list) -> list:
        return [self.cell(p, self.canvas[p]) for p in positions]


def events(app, req, worker):
    """The stream's events (dicts) from the worker's for the request's one job: "start", a "step" per call of the
    answer, "done" (or "error"). The start waits for the first call: it says how many positions the answer shows
    (gen_length, fewer where a block-diffusion answer runs to a nearer grid block's edge), and where its blocks lie:
    a block-diffusion model's grid starts at the prompt's first token, so its answer starts `block_offset` into one."""
    (job,), cfg = req.jobs, app.cfg
    mask_id, gen = cfg.mask_id, job.kw["gen_length"]
    G = gen if job.guided else settings(cfg, dict(gen_length=gen, block_length=job.kw["block_length"])).block_length
    cell = lambda p, t: {"pos": p, "id": t, "text": app.token_text(t), "end": t in app.chat.stop_ids}  # noqa: E731
    answer, step = None, 0
    for _, kind, payload in worker:
        if kind == "error":
            yield {"type": "error"} | payload.body()
            return
        if answer is None:
            answer = Answer(min(gen, len(payload["ids"])), mask_id, cell)
            yield {"type": "start", "id": req.id, "model": app.name, "prompt": decode(app.chat.tok, job.ids, False),
                   "prompt_tokens": len(job.ids), "gen_length": gen, "positions": len(answer.canvas),
                   "max_tokens": job.max_tokens, "block_length": G, "block_offset": len(job.ids) % G if
                   cfg.family in BLOCK_FAMILIES and not job.guided else 0, "mask": app.token_text(mask_id),
                   "settings": job.settings()}
        if kind == "step":
            step += 1
            yield {"type": "step", "step": step, **answer.step(payload["ids"], payload["committed"]),
                   "final": min(payload["final"], len(answer.canvas))}
            continue
        text, reason, n = app.finish(job, payload["ids"])
        yield {"type": "done", "text": text, "finish_reason": reason, "cut": answer.end(payload["ids"]),
               "usage": usage(len(job.ids), n), "fastdllm": payload["fastdllm"]}
