"""
layout.py: where each tensor of a checkpoint goes in our model, for load_model (model.py), the writers of random
checkpoints (tools/checkpoint.py) and demo/train.py: the name map of each architecture (archs.WEIGHT_MAP) expanded to
every layer and expert, and the tensors that land in a part of one of our parameters: an expert's row of a stacked
MoE weight, and q, k, v (gate, up) in their rows of the fused projection the model holds to run one matmul, not three.
"""
import torch
import torch.nn as nn

from archs import TRANSPOSED, WEIGHT_MAP


def checkpoint_names(cfg, model: nn.Module) -> dict[str, str]:
    """checkpoint tensor name -> our tensor name, every layer (and expert) expanded, for the tensors the config's
    model has (model.skeleton(cfg) where there is none yet): no bias LLaDA does not use, no second copy of a tied head, no experts in a dense layer. An expert's
    tensor is one row of a stacked parameter: our name is '<stacked>.<expert>'; q, k, v, gate and up are rows of a
    fused parameter (fused_parts)."""
    params = dict(model.named_parameters()) | fused_parts(model)     # a tied head is listed once, as the embedding
    out = {}
    for ours, theirs in WEIGHT_MAP[cfg.arch].items():
        for i in range(cfg.n_layers) if "{}" in ours else [0]:
            o, t = ours.replace("{}", str(i), 1), theirs.replace("{}", str(i), 1)
            if "{}" in o and o[:-3] in params:       # 'layers.i.mlp.w_gate.{}': one tensor per expert
                out.update({t.format(e): o.format(e) for e in range(params[o[:-3]].shape[0])})
            elif o in params:
                out[t] = o
    return out


def fused_parts(model) -> dict[str, tuple[str, slice]]:
    """Each tensor that checkpoints store apart and the model holds fused (the `parts` of Attention and MLP) -> (the
    fused parameter, its rows there): 'layers.0.attn.wk.weight' -> ('layers.0.attn.wqkv.weight', slice(4096, 8192))."""
    out = {}
    for name, m in model.named_modules():
        for fused, parts in getattr(m, "parts", {}).items():
            rows = 0
            for part, n in parts.items():
                for kind in ("weight", "bias"):
                    if getattr(getattr(m, fused), kind) is not None:
                        out[f"{name}.{part}.{kind}"] = (f"{name}.{fused}.{kind}", slice(rows, rows + n))
                rows += n
    return out


def stored_at(params: dict, parts: dict, ours: str) -> tuple[str, int | slice | None, tuple, bool]:
    """Our tensor `ours` (checkpoint_names) -> (the parameter it is loaded into, where there: None (all of it), an
    expert's row of a stack, or rows of a fused parameter; its shape as stored; stored transposed?)."""
    if ours in params:
        return ours, None, tuple(params[ours].shape), False
    if ours in parts:
        fused, rows = parts[ours]
        return fused, rows, (rows.stop - rows.start, *params[fused].shape[1:]), False
    stack, _, e = ours.rpartition(".")
    flip = stack.rpartition(".")[2] in TRANSPOSED
    return stack, int(e), tuple(params[stack].shape[1:])[::-1 if flip else 1], flip


def checkpoint_state(model) -> dict[str, torch.Tensor]:
    """The model's tensors under the checkpoint's names and in its layout (what load_model reads back; a fused
    parameter's parts and a stack's experts apart): demo/train.py saves its models with it."""
    params, parts = dict(model.named_parameters()), fused_parts(model)
    out = {}
    for theirs, ours in checkpoint_names(model.config, model).items():
        target, where, _, flip = stored_at(params, parts, ours)
        t = params[target].detach() if where is None else params[target].detach()[where]
        out[theirs] = (t.t() if flip else t).contiguous()
    return out
