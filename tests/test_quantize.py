"""quantize="int8" (quant.py): what load_model stores (torchao's quantize_ to the bit, quantized while reading), the
logits' error against float32 within a stated bound, every family decoding, compile=True, and the one-line
errors, torchao missing included (simulated: the tests without torchao run everywhere, those with it where it is
installed: requirements-extras.txt, which CI installs)."""
import json
import os
import re
import sys
import weakref

import pytest
import torch

import bounded
import cli
import quant
from conftest import GOLDEN, ROOT, copy_checkpoint, write_tokenizer
from fastdllm import generate, pad_prompts
from model import MoE, checkpoint_names, fused_parts, load_model, stored_at

DEMO = os.path.join(ROOT, "demo", "llada-arith")
FAMILIES = ["llada-tiny", "dream-tiny", "lladamoe-tiny", "qwen2-tiny", "fastdllm-v2-tiny", "sdar-tiny"]
ROWS = [[815, 723, 294, 53, 204, 372, 664, 1017, 655, 689, 279, 233], [44, 12, 907, 31, 5]]   # llada-golden's b1 ...


@pytest.fixture(scope="module")
def torchao():
    return pytest.importorskip("torchao", reason="torchao is not installed: pip install -r requirements-extras.txt")


FOLDERS = {}      # name -> a folder made for this module (Fast-dLLM v2's mask id lives in its tokenizer)


@pytest.fixture(scope="module", autouse=True)
def v2_folder(tmp_path_factory):
    with open(os.path.join(GOLDEN, "fastdllm-v2-golden.json")) as f:
        ids = json.load(f)["ids"]
    d = copy_checkpoint("fastdllm-v2-tiny", tmp_path_factory.mktemp("v2"))
    write_tokenizer(d, {ids["mask_id"]: "|<MASK>|", ids["stop_token"]: "<|im_end|>", ids["pad_token_id"]: "<|endoftext|>"})
    FOLDERS["fastdllm-v2-tiny"] = d


def load(name, dtype=torch.float32, **kw):
    folder = FOLDERS.get(name, name if os.path.isdir(name) else os.path.join(GOLDEN, name))
    return load_model(folder, device="cpu", dtype=dtype, **kw)


def canvas(model):
    """The golden prompts (ids folded into the vocabulary) and 32 masks after them: what a first call reads."""
    ids, _ = pad_prompts([[t % model.config.vocab_size for t in r] for r in ROWS], model.config.pad_id or 0)
    if model.config.mask_id is None:        # the causal guide reads text: the prompts alone
        return ids
    return torch.nn.functional.pad(ids, (0, 32), value=model.config.mask_id)


# ------------------------------------------------------------------------------------- what is stored
@pytest.mark.parametrize("name", FAMILIES)
def test_load_time_int8_is_torchaos_quantize_of_the_loaded_model(torchao, name):
    """Each weight quantized as it is read equals torchao's quantize_(model, Int8WeightOnlyConfig()) applied to
    the float32 model after loading (the stacks: the same rows and scales), value for value; the embedding, the
    LM head, the norms and the router keep float32."""
    from torchao.quantization import Int8Tensor
    ours, theirs = load(name, quantize="int8"), quant.quantize_int8(load(name))
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], Int8Tensor):
            assert torch.equal(a[k].qdata, b[k].qdata) and torch.equal(a[k].scale, b[k].scale), k
        else:
            assert torch.equal(a[k], b[k]), k
    kinds = {k: "int8" if isinstance(v, Int8Tensor) or v.dtype == torch.int8 else str(v.dtype) for k, v in a.items()}
    assert all(kinds[k] == "int8" for k in quant.int8_targets(ours) if k in kinds)
    assert kinds["embed.weight"] == kinds["norm.weight"] == "torch.float32"
    assert kinds.get("lm_head.weight", "torch.float32") == "torch.float32"
    assert all(v == "torch.float32" for k, v in kinds.items() if ".router." in k or k.endswith("_scale"))
    x = canvas(ours)
    with torch.inference_mode():
        assert torch.equal(ours(x), theirs(x))
    assert quant.weight_bytes(ours) < 0.85 * quant.weight_bytes(load(name))


def test_quantize_int8_is_load_models_int8_whatever_torchaos_defaults(torchao, monkeypatch):
    """quant.quantize_int8 (tools/gpu_check.py's int8 phase) names the int8 tensor load_model makes, not torchao's
    defaults, which move between releases: 0.17's Int8WeightOnlyConfig() made its older AffineQuantizedTensor (version
    1, gone in 0.18), whose bytes weight_bytes cannot read (an H200 run reported the 8B's int8 weights at bf16's
    16.03 GB). Simulated here by another default granularity (0.18 refuses version 1)."""
    from torchao.quantization import Int8Tensor, Int8WeightOnlyConfig, PerTensor
    group_size, _, inductor, version = Int8WeightOnlyConfig.__init__.__defaults__
    monkeypatch.setattr(Int8WeightOnlyConfig.__init__, "__defaults__", (group_size, PerTensor(), inductor, version))
    assert isinstance(Int8WeightOnlyConfig().granularity, PerTensor)
    ours, theirs = load("llada-tiny", quantize="int8"), quant.quantize_int8(load("llada-tiny"))
    for k in quant.int8_targets(ours):
        a, b = ours.get_parameter(k), theirs.get_parameter(k)
        assert isinstance(b, Int8Tensor) and torch.equal(a.qdata, b.qdata) and torch.equal(a.scale, b.scale), k
    assert quant.weight_bytes(theirs) == quant.weight_bytes(ours)


def test_every_linear_layer_and_expert_stack_is_a_target():
    """int8_targets is generic: every nn.Linear but the head and the router, every MoE stack (so a family built of
    the same modules is covered without a line here)."""
    model = load("lladamoe-tiny")
    targets = quant.int8_targets(model)
    linears = {n + ".weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears - targets == {"lm_head.weight"} | {n for n in linears if ".router." in n}
    stacks = {f"{n}.{s}" for n, m in model.named_modules() if isinstance(m, MoE) for s in MoE.stacks}
    assert stacks and stacks <= targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_loading_keeps_no_float_copy_of_a_quantized_weight(torchao, monkeypatch, dtype):
    """Quantized while loading: when a weight is read, every earlier weight that became int8 has been let go (its
    float tensor, and with it the pages of the file it mapped), so the float model never exists at once."""
    seen, alive, read = [], [], quant.read_once

    def spy(path, key):
        alive.append(sum(r() is not None for r in seen))
        t = read(path, key)
        if stored_at(params, parts, names[key])[0] in targets:      # an int8 weight, or a part of one (q of wqkv)
            seen.append(weakref.ref(t))
        return t
    for name in ("llada-tiny", "lladamoe-tiny"):
        model = load(name)
        names, targets = checkpoint_names(model.config, model), quant.int8_targets(model)
        params, parts = dict(model.named_parameters()), fused_parts(model)
        seen.clear(), alive.clear()
        with monkeypatch.context() as m:
            m.setattr(quant, "read_once", spy)
            load(name, dtype=dtype, quantize="int8")
        assert len(seen) > 10 and max(alive) == 0, name


# ------------------------------------------------------------------------------------- the error, bounded
@pytest.mark.parametrize("name", [*FAMILIES, DEMO, os.path.join(ROOT, "demo", "qwen2-arith")])
def test_int8_logits_stay_within_four_times_bf16s_error(torchao, name):
    """The bound: on a first call's canvas, int8 weights (float32 activations) move the logits from float32's by at
    most 4x what bf16 weights move them (the rounding every GPU run accepts). Measured 0.4x-2.6x (docs/benchmarks.md)."""
    f32, int8, bf16 = load(name), load(name, quantize="int8"), load(name, dtype=torch.bfloat16)
    x = canvas(f32)
    with torch.inference_mode():
        ref = f32(x)
        e_int8, e_bf16 = ((m(x).float() - ref).abs().max().item() for m in (int8, bf16))
    assert 0 < e_int8 <= 4 * e_bf16, (e_int8, e_bf16)


# ------------------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("name", ["llada-tiny", "dream-tiny", "lladamoe-tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_every_family_decodes_with_int8_weights(torchao, name, dtype):
    """Every cache mode decodes every position; in float32 a padded batch's rows equal their solo runs, as without
    int8."""
    model = load(name, dtype, quantize="int8")
    ids, am = pad_prompts([[t % 1000 for t in r] for r in ROWS], model.config.pad_id or 0)
    for cache in ("none", "prefix", "dual", "free"):
        out, st = generate(model, ids, attention_mask=am, gen_length=16, block_length=8, cache=cache, threshold=0.9)
        assert not (out == model.config.mask_id).any() and st["nfe"] >= 2
        if dtype == torch.float32:      # bf16 kernels may round differently at another batch size
            solo, _ = generate(model, ids[1:, -len(ROWS[1]):], gen_length=16, block_length=8, cache=cache,
                               threshold=0.9)
            assert torch.equal(out[1, -16:], solo[0, -16:]), cache


@pytest.mark.parametrize("name", ["fastdllm-v2-tiny", "sdar-tiny"])
def test_block_diffusion_decodes_with_int8_weights(torchao, name):
    """A block-causal model's caches are exact with int8 weights as without: each cache mode equals the uncached
    decode, and a padded batch's rows their solo runs (each solo answer a prefix of its row: a batch runs to the grid
    block of its longest prompt)."""
    model = load(name, quantize="int8")
    rows = [[t % 1000 for t in r] for r in ROWS]
    ids, am = pad_prompts(rows, model.config.pad_id or 0)
    kw = dict(gen_length=16, block_length=4, threshold=0.9)
    none, _ = generate(model, ids, attention_mask=am, cache="none", **kw)
    assert not (none == model.config.mask_id).any()
    out, _ = generate(model, ids, attention_mask=am, cache="prefix", **kw)
    assert torch.equal(out, none)
    for r, prompt in enumerate(rows):
        solo, _ = generate(model, torch.tensor([prompt]), cache="prefix", **kw)
        assert out[r, ids.shape[1] - len(prompt):][:solo.shape[1]].tolist() == solo[0].tolist()


@pytest.mark.parametrize("name", ["llada-tiny", "lladamoe-tiny"])
def test_compiled_int8_ids_equal_eager(torchao, name):
    """compile=True with torchao's int8 tensors and the int8 stacks: one graph (the whole canvas every call), the
    same ids as eager in float32."""
    model = load(name, quantize="int8")
    ids, am = pad_prompts(ROWS, model.config.pad_id or 0)
    kw = dict(attention_mask=am, gen_length=16, block_length=8, cache="none", threshold=0.9)
    eager, st = generate(model, ids, **kw)
    compiled, st2 = generate(model, ids, compile=True, **kw)
    assert torch.equal(compiled, eager) and st2["nfe"] == st["nfe"]


def test_the_cli_answers_the_demo_with_int8(torchao):
    r = bounded.run([sys.executable, os.path.join(ROOT, "fastdllm.py"), "--model", DEMO, "--gen-length", "32",
                     "--block-length", "8", "--quantize", "int8", "--prompt",
                     "Tom has 23 apples and buys 45 more. How many apples does he have?"], timeout=120)
    assert r.returncode == 0 and r.stdout.splitlines()[0].endswith("The answer is 68."), r.stdout + r.stderr
    assert "torchao" not in r.stderr and "Warning" not in r.stderr, r.stderr      # its import is quiet
    # The load line says int8 and the bytes it holds (it said the files' bytes, as a bf16 load does).
    model = load_model(DEMO, dtype=torch.float32, quantize="int8")       # the CLI's dtype on a CPU
    size = lambda n: rf"{n / 1e6:.1f} MB"      # noqa: E731  (the demo model is well below 0.1 GB)
    files = sum(os.path.getsize(os.path.join(DEMO, f)) for f in os.listdir(DEMO) if f.endswith(".safetensors"))
    assert re.search(rf"^loaded {re.escape(DEMO)} in [0-9.]+ s \(int8 weights: {size(quant.weight_bytes(model))} "
                     rf"held, {size(files)} read\)$", r.stderr, re.M), r.stderr


# ------------------------------------------------------------------------------------- bad input
NO_TORCHAO = r"^int8 weights \(quantize='int8', --quantize int8\) need torchao, which is not installed here: " \
             r"pip install -r requirements-extras\.txt$"


@pytest.mark.parametrize("value", ["int4", "INT8", "fp8", True])
def test_an_unsupported_quantization_is_one_line_naming_int8(value):
    with pytest.raises(ValueError) as e:
        load(DEMO, quantize=value)
    assert str(e.value) == (f"quantize={value!r} is not supported: fastdllm quantizes weights to 'int8' "
                            f"(weight-only, one scale per output channel), or not at all (None)")


def test_int8_without_torchao_is_one_line_before_any_file_is_read(without_torchao, monkeypatch):
    assert load(DEMO).config.family == "llada"      # without quantize nothing needs torchao
    monkeypatch.setattr("model.resolve_model_dir", lambda *a, **kw: pytest.fail("looked the model up first"))
    with pytest.raises(ValueError, match=NO_TORCHAO):
        load(DEMO, quantize="int8")
    monkeypatch.setattr(cli, "resolve_model_dir", lambda *a, **kw: pytest.fail("looked the model up first"))
    with pytest.raises(ValueError, match=NO_TORCHAO):
        cli.main(["--model", DEMO, "--prompt", "x", "--quantize", "int8"])


def test_a_torchao_without_its_int8_tensor_is_one_line_naming_the_version(torchao, monkeypatch):
    import logging
    import types
    monkeypatch.setitem(sys.modules, "torchao.quantization", types.ModuleType("torchao.quantization"))
    with pytest.raises(ValueError, match=rf"^torchao {re.escape(torchao.__version__)} has no Int8Tensor: pip install "
                                         r"-r requirements-extras\.txt \(torchao 0\.18\.0\)$"):
        load(DEMO, quantize="int8")
    assert logging.getLogger("torchao").level == logging.NOTSET     # its logger as it was


def test_the_cli_refuses_int4_and_int8_without_torchao_in_one_line(monkeypatch):
    """Exit status 2 and one line (fastdllm.py's __main__, tests/bounded.py run_main): --quantize int4 (argparse's
    choices, naming int8), and --quantize int8 where torchao cannot be imported (sys.modules blocks it)."""
    run = ["--model", DEMO, "--prompt", "x", "--gen-length", "8", "--block-length", "8"]
    script = os.path.join(ROOT, "fastdllm.py")
    code, out, err = bounded.run_main(script, [*run, "--quantize", "int4"])
    assert (code, out) == (2, "") and re.search(r"^error: argument --quantize: invalid choice: 'int4' \(choose from "
                                                r"'int8'\) \(see --help\)$", err.strip()), err
    monkeypatch.setitem(sys.modules, "torchao", None)
    code, out, err = bounded.run_main(script, [*run, "--quantize", "int8"])
    assert (code, out) == (2, "") and re.search("^error: " + NO_TORCHAO[1:], err.strip()), err


def test_an_already_quantized_checkpoint_is_refused_in_one_line(torchao, tmp_path):
    """A checkpoint whose weights are integers cannot be quantized again (nor loaded): one line naming it."""
    import shutil
    from safetensors.torch import load_file, save_file
    d = shutil.copytree(os.path.join(GOLDEN, "llada-tiny"), tmp_path / "q")
    path = os.path.join(d, "model-00001-of-00002.safetensors")
    tensors = load_file(path)
    key = next(k for k in tensors if k.endswith("ff_proj.weight"))
    save_file(dict(tensors, **{key: tensors[key].to(torch.int8)}), path)
    with pytest.raises(ValueError, match=rf"^tensor '{re.escape(key)}' has dtype torch.int8, not a float: this "
                                         r"checkpoint is quantized or corrupt"):
        load(str(d), quantize="int8")


def test_the_flag_reaches_every_program_that_loads_a_model(torchao, capsys):
    """--quantize int8 in serve.py and bench.py run (the CLI's flags, parsed by cli.parse_args) and bench.py modes
    (flags.py): each loads int8 weights (harness.py's quantize=: tests/test_harness.py)."""
    import bench
    import serve
    from torchao.quantization import Int8Tensor
    app = serve.build(serve.parse_args(["--model", DEMO, "--gen-length", "32", "--block-length", "8", "--quantize",
                                        "int8"]))
    assert isinstance(app.model.layers[0].attn.wqkv.weight, Int8Tensor)
    bench.main(["run", "--model", DEMO, "--gen-length", "16", "--block-length", "8", "--caches", "dual", "--quantize",
                "int8"])
    bench.main(["modes", "--d-model", "64", "--layers", "1", "--vocab", "1024", "--gen-length", "8", "--block-length",
                "8", "--prompt-length", "8", "--caches", "none", "--quantize", "int8"])
    out = capsys.readouterr().out
    assert out.count(" int8 weights on ") == 2, out
