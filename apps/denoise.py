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
A uniform-state model (DiffusionGemma: no mask, canvases of random tokens) has its own kinds (Canvases): `drafted`,
the step's argmax where it changed on the canvas being denoised, and `committed`, a canvas once it has ended.
"""
import torch

from api import usage
from blockdiff import FAMILIES as BLOCK_FAMILIES, SDAR_REMASKING
from cache import CACHE_POLICIES
from chat import decode
from options import checked, settings
from llada2 import EDITING_ONLY
from sampler import DREAM_REMASKING, LLADA_REMASKING
from uniform import OWN as GEMMA_OWN

EDITING = ("editing_threshold", *EDITING_ONLY)       # LLaDA2.1's editing settings, request fields too
OWN = (*EDITING, *GEMMA_OWN)                        # a family's own settings an answer reports, if it decoded with them

# A value of each decoding setting a request may send (api.FIELDS) that its own check takes, to ask generate()'s
# checks whether the loaded model reads it; LLaDA2.1's two that need editing_threshold are asked with it.
PROBES = {"threshold": 0.9, "factor": 1.0, "temperature": 0.5, "top_p": 0.5, "top_k": 1, "editing_threshold": 0.5,
          "max_post_steps": 1, "num_to_transfer": 1, "entropy_bound": 0.5, "t_min": 0.1, "t_max": 0.9,
          "stability_threshold": 2, "confidence_threshold": 0.01}
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


def info(app) -> dict:
    """GET /v1/denoise/info: the model, what a request may set on it (accepts) and the server's defaults (a family's
    own, where the model reads them: LLaDA2.1's editing settings; DiffusionGemma's, as its checkpoint decides them)."""
    a, cfg = app.args, app.cfg
    own = {n: getattr(a, n) for n in EDITING if n in app.accepts["settings"]}
    if "entropy_bound" in app.accepts["settings"]:
        st = settings(cfg, {n: getattr(a, n) for n in GEMMA_OWN if hasattr(a, n)} | {"block_length": a.block_length})
        own |= {n: getattr(st, n) for n in GEMMA_OWN}
    return {"model": app.name, "family": cfg.family, "max_positions": cfg.max_seq_len, "chat_template": app.chat.chat,
            "guide": a.guide, **app.accepts, "mask": app.token_text(cfg.mask_id) if cfg.mask_id >= 0 else None,
            "defaults": {"max_tokens": None if a.fit_gen_length else a.gen_length, "block_length": a.block_length,
                         "steps": a.steps, "cache": a.cache, "threshold": a.threshold, "factor": a.factor,
                         "temperature": a.temperature, "guide": app.guide is not None} | own}


def made(stats, i: int, answer: list, stop_ids, uniform: bool) -> int:
    """What row i's calls made, for its tokens per call: the tokens the model committed; a uniform-state model's
    (DiffusionGemma's) accepted samples are renoised until its canvas ends, so its answer's tokens up to its first end
    token instead, as the official counts them."""
    if not uniform:
        return stats["row_committed"][i]
    return next((k for k, t in enumerate(answer) if t in stop_ids), len(answer))


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

    def step(self, ids: list, committed: int, final: int = 0) -> dict:
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


class Canvases(Answer):
    """A uniform-state answer (DiffusionGemma), which has no mask: its canvases of G positions are decided one by one,
    each by the calls that denoise it. A call's changes: `drafted`, the positions of the canvas being denoised whose
    argmax this call changed (what it would answer now; the next call may change it again), and `committed`, the
    positions of a canvas that has ended (stats["final"]: no later call changes them), each once. `masks_left`
    counts the positions not yet committed."""

    def __init__(self, n: int, G: int, cell):
        self.canvas, self.G, self.cell, self.final = [None] * n, G, cell, 0

    def step(self, ids: list, committed: int, final: int = 0) -> dict:
        n, done = len(self.canvas), min(final, len(self.canvas))
        # The canvas this call denoised: the one after those committed, unless this call ended it (the next one has
        # not started); the canvases after it are not shown.
        shown = done if done > self.final else min(done + self.G, n)
        drafted = [p for p in range(done, shown) if ids[p] != self.canvas[p]]
        decided, self.final, self.canvas = list(range(self.final, done)), done, ids[:shown] + self.canvas[shown:]
        return {"committed": self.cells(decided), "drafted": self.cells(drafted), "edited": [], "filled": [],
                "masks_left": n - done}

    def end(self, ids: list) -> list:
        """The final answer's changes after the last call: the pad after its first end token, and the positions no
        event committed (a row whose canvas ended while the batch's went on)."""
        ids, before = ids[:len(self.canvas)], self.canvas
        self.canvas = ids
        return self.cells([p for p, (t, old) in enumerate(zip(ids, before)) if p >= self.final or t != old])


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
            n = min(gen, len(payload["ids"]))
            answer = Answer(n, mask_id, cell) if mask_id >= 0 else Canvases(n, G, cell)
            yield {"type": "start", "id": req.id, "model": app.name, "prompt": decode(app.chat.tok, job.ids, False),
                   "prompt_tokens": len(job.ids), "gen_length": gen, "positions": len(answer.canvas),
                   "max_tokens": job.max_tokens, "block_length": G, "block_offset": len(job.ids) % G if
                   cfg.family in BLOCK_FAMILIES and not job.guided else 0,
                   "mask": app.token_text(mask_id) if mask_id >= 0 else None,
                   "settings": job.settings()}
        if kind == "step":
            step += 1
            yield {"type": "step", "step": step, **answer.step(payload["ids"], payload["committed"], payload["final"]),
                   "final": min(payload["final"], len(answer.canvas))}
            continue
        text, reason, n = app.finish(job, payload["ids"])
        yield {"type": "done", "text": text, "finish_reason": reason, "cut": answer.end(payload["ids"]),
               "usage": usage(len(job.ids), n), "fastdllm": payload["fastdllm"]}
