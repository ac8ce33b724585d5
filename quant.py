"""
quant.py: weight-only int8 (load_model(..., quantize="int8"), --quantize int8): half the bytes of bf16 weights, so
that an 8B model (16 GB in bf16) fits a 12-16 GB GPU.

Each linear layer's weight becomes int8 with one scale per output channel (symmetric), made by torchao
(github.com/pytorch/ao, an optional dependency: requirements-extras.txt) as quantize_(model, Int8WeightOnlyConfig())
makes it: a tensor subclass whose F.linear is mm(x, q.t().to(x.dtype)) * scale, which inductor fuses under
compile=True. LLaDA-MoE's expert stacks take torchao's int8 rows and scales as plain tensors, dequantized where
model.MoE.stack gathers them: torchao's int8 tensor has no view or gather of a 3-D stack (gpt-fast's mixtral-moe
int8 dequantizes after the gather too). The embedding, the LM head, the norms and the MoE router keep the model's
dtype: the head and the router decide tokens and experts, and the embedding is read one row per token.
load_model quantizes each weight as it is read (the whole model never exists in its float dtype);
docs/benchmarks.md has the bytes, the memory while loading, the speed and the logits' error.
"""
import logging
import warnings

import torch
import torch.nn as nn


QUANTIZE = ("int8",)


def int8_quantizer(quantize):
    """None -> None; "int8" -> w -> torchao's int8 tensor of w (per output channel); any other value, or no
    torchao, is one line."""
    if quantize is None:
        return None
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize={quantize!r} is not supported: fastdllm quantizes weights to 'int8' (weight-only, "
                         f"one scale per output channel), or not at all (None)")
    # torchao's import logs that its CUDA-only kernels (mxfp8, cutlass) do not load on a CPU build, and torch that
    # torchao registers an enum the old way; weight-only int8 needs neither. Its tensor has no cache key for
    # compiled graphs, which torch warns about at each compile.
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        import torchao
        from torchao.quantization import Int8Tensor, PerRow
    except ImportError:
        if "torchao" not in locals():
            raise ValueError("int8 weights (quantize='int8', --quantize int8) need torchao, which is not installed "
                             "here: pip install -r requirements-extras.txt") from None
        # a torchao older than the int8 tensor used here (tested: 0.18.0)
        raise ValueError(f"torchao {getattr(torchao, '__version__', '?')} has no Int8Tensor: pip install -r "
                         f"requirements-extras.txt (torchao 0.18.0)") from None
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
    warnings.filterwarnings("ignore", message="Int8Tensor does not implement _stable_hash_for_caching")
    return lambda w: Int8Tensor.from_hp(w, PerRow())


def is_stack(m) -> bool:
    """An expert-stack module (model.MoE: its stacked weights named in `stacks`, those stored transposed in
    `transposed`), told by its attributes: quant.py reads the model, model.py's loader imports quant.py."""
    return hasattr(type(m), "stacks")


def int8_targets(model) -> set[str]:
    """The weights quantize="int8" stores as int8: every linear layer's but the LM head's and the MoE router's, and
    the MoE expert stacks. Any family built of nn.Linear layers and MoE stacks is covered as it is."""
    out = set()
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name != "lm_head" and not name.endswith(".router"):
            out.add(name + ".weight")
        elif is_stack(m):
            out.update(f"{name}.{stack}" for stack in m.stacks)
    return out


def int8_store(state: dict, params: dict, target: str, where, w: torch.Tensor, int8, flip=False) -> None:
    """A weight read as w in the model's dtype into `state` as int8, in the parameter `target` (model.stored_at):
    where None, the whole of a linear layer's, as torchao's int8 tensor; a slice, q, k, v, gate or up, into its rows
    of the fused linear layer's int8 tensor, made at its first part (one scale per output channel: the parts' values
    and scales are the fused weight's, row for row); an int, an expert (flip: stored transposed), as its row of the
    stack's int8 values and of the stack's scales."""
    q = int8(w)
    if where is None:
        state[target] = q
    elif isinstance(where, slice):
        if target not in state:      # allocated at the first part, as load_model's float fused weights
            rows = params[target].shape[0]
            state[target] = type(q)(q.qdata.new_empty(rows, q.shape[1]), q.scale.new_empty(rows, 1), q.block_size,
                                    q.dtype, zero_point=q.zero_point.new_empty(rows, 1))
        for name in ("qdata", "scale", "zero_point"):
            getattr(state[target], name)[where].copy_(getattr(q, name))
    else:
        if target not in state:      # allocated at the stack's first expert, as load_model's float stacks
            state[target] = torch.empty(params[target].shape, dtype=torch.int8, device=w.device)
            state[target + "_scale"] = torch.empty(params[target].shape[0], w.shape[0], dtype=w.dtype, device=w.device)
        state[target][where].copy_(q.qdata.t() if flip else q.qdata)
        state[target + "_scale"][where].copy_(q.scale.flatten())


def int8_layout(model, targets: set[str]) -> None:
    """The model made ready for its int8 weights: they take no gradient (an int8 tensor cannot), and each MoE stack
    gets its scale buffer (experts, outputs), which load_model's strict load_state_dict then expects."""
    for name in targets:
        module, _, attr = name.rpartition(".")
        m = model.get_submodule(module)
        w = getattr(m, attr).requires_grad_(False)
        if is_stack(m):
            outputs = w.shape[2 if attr in m.transposed else 1]
            m.register_buffer(attr + "_scale", torch.empty(w.shape[0], outputs, dtype=w.dtype, device=w.device))


def read_once(path: str, key: str) -> torch.Tensor:
    """One tensor of a safetensors file through its own handle: once the tensor is dropped, its pages of the file
    leave the process (a handle open for the whole shard keeps every page it has read resident: up to a shard)."""
    from safetensors import safe_open
    with safe_open(path, framework="pt", device="cpu") as f:
        return f.get_tensor(key)


def quantize_int8(model):
    """A model already in memory (tools/gpu_check.py's random ones) to quantize="int8", in place, a weight at a
    time: torchao's own quantize_ for the linear layers, the expert stacks row by row as load_model stores them."""
    int8 = int8_quantizer("int8")
    from torchao.quantization import Int8WeightOnlyConfig, PerRow, quantize_
    targets = int8_targets(model)
    with torch.no_grad():
        # version=2, PerRow(): load_model's Int8Tensor, named (torchao 0.17's default is version 1, its older
        # AffineQuantizedTensor); set_inductor_config=False: torchao would otherwise change inductor's settings for
        # the whole process.
        quantize_(model, Int8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False, version=2),
                  filter_fn=lambda m, name: name + ".weight" in targets)
        for name in sorted(targets):
            module, _, attr = name.rpartition(".")
            m = model.get_submodule(module)
            if is_stack(m):
                w, state, flip = getattr(m, attr).detach(), {}, attr in m.transposed
                for e in range(w.shape[0]):
                    int8_store(state, {name: w}, name, e, w[e].t() if flip else w[e], int8, flip)
                setattr(m, attr, nn.Parameter(state[name], requires_grad=False))
                m.register_buffer(attr + "_scale", state[name + "_scale"])
    return model


def nbytes(t: torch.Tensor) -> int:
    """The bytes a weight takes: an int8 tensor's values and scales, not its nominal dtype's."""
    return t.qdata.nbytes + t.scale.nbytes if hasattr(t, "qdata") else t.nbytes


def weight_bytes(model) -> int:
    """Every parameter (a tied head once) and buffer of the model, in bytes as stored."""
    return sum(nbytes(t) for t in [*model.parameters(), *model.buffers()])


def active_bytes(model) -> int:
    """The part of weight_bytes one token reads: all but, in each mixture-of-experts block (model.MoE), the experts
    it does not choose (all but its top_k), the "active parameters" of a model card (DiffusionGemma: ~4B of 26B)."""
    unchosen = 0
    for m in (m for m in model.modules() if getattr(m, "stacks", None)):     # an expert stack, told by its attributes
        stacked = sum(nbytes(t) for n in m.stacks for t in (getattr(m, n), getattr(m, n + "_scale", None))
                      if t is not None)
        unchosen += stacked * (m.w_gate.shape[0] - m.top_k) // m.w_gate.shape[0]
    return weight_bytes(model) - unchosen
