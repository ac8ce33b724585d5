"""
family.py: what a decoding family gives the plan (fastdllm.make_plan), the protocol every family's own file follows:
`Family` (its defaults, its refusals, its canvas, its parts: LLADA here, dream.DREAM, blockdiff.BLOCK, guided.GUIDED,
uniform.GEMMA; options.FAMILIES maps a checkpoint's family to one), `Canvas` (where a call's rows sit), `Parts` (what the
loop calls); the canvas LLaDA, Dream and a guided call share (`answer_canvas`); and LLaDA's parts, the simplest family's
(`llada_parts`: the step rule sampler.LLaDA, a selection rule, a cache policy, a stop rule), which the others vary.
"""
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from cache import CACHE_POLICIES, CachePolicy
from sampler import LLaDA, Schedule, parallel_rule, stop_rule


class Canvas(NamedTuple):
    """Where a call's rows sit (a family's `canvas`): the canvas it starts from and what the model call needs."""
    x: torch.Tensor            # (B, L) the prompts and the masked answers
    blocks: list               # [(s, e)] the blocks of the answers, left to right
    prompt: torch.Tensor       # (B, 2) long: each row's prompt [begin, end) on the canvas
    pos: torch.Tensor | None   # (B, L) RoPE positions, or None: 0 .. L-1 in every row
    mask: torch.Tensor | None  # (B or 1, 1, L, L) bool attention mask, or None: every key
    sees: Callable             # b -> where the keys a query of a span ending at b sees end: the canvas's end, or a
                               #   block-causal model's grid block's (blockdiff.py), a canvas's (uniform.py)
    ends: torch.Tensor         # (B,) where each row's answer ends on the canvas (a block-diffusion row's: its own)
    fill: int                  # what an ended answer's masks become
    output: Callable           # the canvas -> generate()'s ids
    view: Callable             # the canvas -> on_step's: output's layout without its end cut (an edit may move the end)


class Family(NamedTuple):
    """A decoding family's part of a call's set-up (fastdllm.make_plan), all from the family's own file: LLADA below,
    dream.DREAM, blockdiff.BLOCK (Fast-dLLM v2, SDAR, LLaDA2), guided.GUIDED (FlashDLM's guided diffusion)."""
    defaults: Callable   # (cfg, st, given) -> {setting: value}: its own defaults, for the settings left None
    check: Callable      # (cfg, st, given, longest, name) -> None: what it refuses beyond options.py's, in one line
                         #   naming the setting (name(key): as the caller words it; longest: the longest prompt)
    canvas: Callable     # (prompt, attention_mask, st, cfg, eos) -> Canvas
    parts: Callable      # (model, st, given, generator, canvas, eos) -> Parts


class Parts(NamedTuple):
    """What the loop calls, from a family's settings (Family.parts)."""
    step_rule: object
    select: Callable
    cache: object              # a cache.CachePolicy
    stop: Callable
    layers: Callable | None = None   # run -> the loop's call around `run` (model.hidden, as graphs.py runs it)
    view: Callable | None = None     # the canvas -> on_step's, if not Canvas.view (DiffusionGemma: the step's argmax)


def pad_prompts(rows: list[list[int]], pad_id: int):
    """Prompts of different lengths -> (ids (B, P), attention_mask (B, P)), left-padded so that every answer
    starts at the same canvas position."""
    P = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (P - len(r)) + list(r) for r in rows])
    return ids, (torch.arange(P) >= torch.tensor([[P - len(r)] for r in rows])).long()


def same(x):
    return x


def answer_canvas(prompt, attention_mask, st, cfg, eos) -> Canvas:
    """[prompt, MASK x gen_length], the answers after a common prompt width, in blocks of block_length. A left-padded
    row's real tokens count from position 0 (pos) and its pads neither attend nor are attended to (mask), so each row
    decodes as it would alone."""
    (B, P), device = prompt.shape, prompt.device
    x = F.pad(prompt, (0, st.gen_length), value=cfg.mask_id)
    lengths = attention_mask.to(device).long().sum(-1) if attention_mask is not None else torch.full((B,), P,
                                                                                                     device=device)
    pos = mask = None
    if attention_mask is not None and (attention_mask == 0).any():
        m = F.pad(attention_mask.to(device).bool(), (0, st.gen_length), value=True)
        pos, mask = (m.long().cumsum(-1) - 1).masked_fill(~m, 1), m[:, None, None, :] & m[:, None, :, None]
    return Canvas(x=x, blocks=[(s, s + st.block_length) for s in range(P, x.shape[1], st.block_length)],
                  prompt=torch.stack([P - lengths, torch.full_like(lengths, P)], -1), pos=pos, mask=mask,
                  sees=lambda b: x.shape[1], ends=torch.full_like(lengths, x.shape[1]),
                  fill=int(eos[0]) if len(eos) else cfg.mask_id, output=same, view=same)


def llada_parts(model, st, given, generator, c: Canvas, eos):
    """LLaDA's step rule, selection rule, cache policy and stop rule from the call's settings `st`: its schedule
    ranked as the official call ranks at the official width around the block [s, e) (ties decide alike): FlashDLM's
    topk over the canvas, Fast-dLLM's sort of the fed chunk."""
    select = parallel_rule(st) or (Schedule(lambda at: (at.s, at.x.shape[1] - at.e), topk=True) if st.cache == "free"
                                   else Schedule(lambda at: (at.s - at.span[0], at.span[1] - at.e) if at.span else (0, 0)))
    rule = st.propose or LLaDA(steps_per_block=st.steps // (st.gen_length // st.block_length),
                               temperature=st.temperature, remasking=st.remasking, generator=generator,
                               mask_id=model.config.mask_id)
    cache = st.cache if isinstance(st.cache, CachePolicy) else CACHE_POLICIES[st.cache]()
    return Parts(rule, select, cache, stop_rule(st, c, eos, model.config.mask_id))


# LLaDA's part of the set-up (family.Family): its one default, low_confidence remasking; no refusal of its own (every
# LLaDA refusal is options.py's: its samplers' options, check_family; the other families' settings, check_readers).
LLADA = Family(defaults=lambda cfg, st, given: dict(remasking=st.remasking or "low_confidence"),
               check=lambda cfg, st, given, longest, name=None: None, canvas=answer_canvas, parts=llada_parts)
