"""DiffusionGemma (gemma.py, archs.py's row, tests/reference_gemma.py) against the official transformers 5.23.0 code:
its forward reference and its generate() runs on a tiny checkpoint saved by the official classes
(tests/golden/diffusiongemma/README.md says how they were made).

The sampled decodes are chaotic: every step feeds its logits back (self-conditioning), and a float32 difference in the
last bits grows about tenfold per step (docs/parity.md has the measurement), so a long sampled run equals the recorded
one only on the recorder's own kernels; the official code itself reproduces 2 of the 23 runs on our machines. What is
checked exactly is what does not depend on those bits: the runs that are decided by a wide margin, every canvas's first
steps given the recorded canvases, and the randomness every fixed-length run draws."""
import copy
import dataclasses
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from cache import KVCache
from conftest import GOLDEN
from fastdllm import generate
from gemma import check_decode, check_text_only, positions
from model import load_model, read_config
from reference_gemma import reference_generate

DG = os.path.join(GOLDEN, "diffusiongemma")
CKPT = os.path.join(DG, "tiny_dg_seed1234")
with open(os.path.join(DG, "golden_dg.json")) as f:
    RUNS = {r["settings"]["id"]: r for r in json.load(f)["runs"]}


@pytest.fixture(scope="module")
def dg():
    return {dtype: load_model(CKPT, dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}


@pytest.fixture(scope="module")
def ref():
    return load_file(os.path.join(DG, "forward_ref_seed1234.safetensors"))


def forward(model, ids, canvas, sc=False):
    """The official forward reference's calls: the prompt through the encoder, the canvas through the decoder at the
    next positions, then again with the first logits as self-conditioning."""
    L, C = ids.shape[1], canvas.shape[1]
    kv, valid = KVCache.for_model(model, ids.shape[0], L + C), torch.ones(ids.shape[0], L + C, dtype=torch.bool)
    with torch.inference_mode():
        hidden = model.encode(ids, kv, torch.arange(L), valid)
        logits = model.decode(canvas, kv, torch.arange(L, L + C), valid)
        again = model.decode(canvas, kv, torch.arange(L, L + C), valid, sc_logits=logits)
    return model.norm(hidden).float(), logits, again


@pytest.mark.parametrize("prompt", ["prompt", "prompt_long"])     # prompt_long: 20 tokens, longer than the window 12
def test_forward_matches_the_official_in_float32(dg, ref, prompt):
    hidden, logits, again = forward(dg[torch.float32], ref[f"input.{prompt}"], ref["input.canvas"])
    official = {k: ref[f"float32.{prompt}.{k}"] for k in ("encoder_last_hidden_state", "decoder_logits_no_sc",
                                                          "decoder_logits_with_sc")}
    # float32 noise: the official code on our machines is itself 6e-5 / 4e-4 from these (the feedback amplifies it)
    assert (hidden - official["encoder_last_hidden_state"]).abs().max() < 1e-5
    assert (logits - official["decoder_logits_no_sc"]).abs().max() < 3e-4
    assert (again - official["decoder_logits_with_sc"]).abs().max() < 2e-3


@pytest.mark.parametrize("prompt", ["prompt", "prompt_long"])
def test_forward_in_bf16_rounds_as_the_official(dg, ref, prompt):
    """bf16 as the reference stores it. This random tiny model amplifies rounding, so the check is relative: our bf16
    decoder logits are much closer to the official bf16 ones than the official float32 ones are (computing anything
    in the wrong dtype would not be), and the encoder within bf16 noise."""
    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()
    hidden, logits, _ = forward(dg[torch.bfloat16], ref[f"input.{prompt}"], ref["input.canvas"])
    r16, r32 = (ref[f"{d}.{prompt}.decoder_logits_no_sc"] for d in ("bfloat16", "float32"))
    assert rel(logits, r16) < 0.6 * rel(r32, r16)
    assert rel(hidden, ref[f"bfloat16.{prompt}.encoder_last_hidden_state"]) < 0.05


def test_embedding_scale_is_cast_to_the_weights_dtype():
    """sqrt(hidden) rounded to the weights' dtype, as the official embedding multiplies: 53.0 in bf16 for the release's
    2816 (the tiny model's 8.0 is exact in both)."""
    cfg = read_config(CKPT)
    with torch.device("meta"):
        from gemma import DiffusionGemma
        m = DiffusionGemma(dataclasses.replace(cfg, dim=2816)).to(torch.bfloat16)
    assert m.embed_scale().item() == 53.0
    assert abs(m.float().embed_scale().item() - 2816 ** 0.5) < 1e-5


def test_cache_has_each_layers_shape(dg):
    """Sliding layers: 2 key/value heads of 16; full layers: 1 of 32 (K = V, global_head_dim)."""
    kv = KVCache.for_model(dg[torch.float32], 3, 40)
    sliding, full = (3, 2, 40, 16), (3, 1, 40, 32)
    assert [tuple(k.shape) for k in kv.k] == [sliding, sliding, full, sliding, sliding, full]
    assert [tuple(v.shape) for v in kv.v] == [tuple(k.shape) for k in kv.k]


def test_a_left_padded_row_computes_as_it_would_alone(dg, ref):
    """Positions count from the row's first real token and pads are never attended: the padded row's encoder states
    and decoder logits equal its solo run's, also past the sliding window (prompt_long)."""
    model = dg[torch.float32]
    short, long = ref["input.prompt"], ref["input.prompt_long"]
    pad = long.shape[1] - short.shape[1]
    ids = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1), long])
    valid = torch.cat([torch.arange(long.shape[1]).expand(2, -1) >= torch.tensor([[pad], [0]]),
                       torch.ones(2, 16, dtype=torch.bool)], 1)
    L, canvas = long.shape[1], ref["input.canvas"].expand(2, -1)
    kv = KVCache.for_model(model, 2, L + 16)
    with torch.inference_mode():
        hidden = model.encode(ids, kv, torch.arange(L), valid)
        logits = model.decode(canvas, kv, torch.arange(L, L + 16), valid)
    solo_hidden, solo_logits, _ = forward(model, short, ref["input.canvas"])
    assert positions(valid)[0, pad:pad + 3].tolist() == [0, 1, 2]
    assert (model.norm(hidden[:1, pad:]).float() - solo_hidden).abs().max() < 1e-5
    assert (logits[:1] - solo_logits).abs().max() < 1e-4
    long_hidden, long_logits, _ = forward(model, long, ref["input.canvas"])
    assert (logits[1:] - long_logits).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------------ loading

def test_loading_never_reads_the_vision_tower(monkeypatch):
    """Text only: the vision tower's and its projection's tensors are skipped before they are read."""
    import safetensors
    read, real = [], safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.f.get_tensor(key)
    monkeypatch.setattr(safetensors, "safe_open", Spy)
    load_model(CKPT, dtype=torch.float32)
    assert read and not [k for k in read if "vision" in k]
    assert "model.encoder.language_model.layers.0.layer_scalar" in read


def test_tied_weights_and_the_encoders_own_scalars(dg):
    model = dg[torch.float32]
    with safetensors_open(os.path.join(CKPT, "model.safetensors")) as f:
        enc = [f.get_tensor(f"model.encoder.language_model.layers.{i}.layer_scalar").float() for i in range(6)]
        dec = [f.get_tensor(f"model.decoder.layers.{i}.layer_scalar").float() for i in range(6)]
        gate_up = f.get_tensor("model.decoder.layers.3.experts.gate_up_proj").float()
        down = f.get_tensor("model.decoder.layers.3.experts.down_proj").float()
    assert model.lm_head.weight is model.embed.weight
    assert [lay.encoder_scalar.item() for lay in model.layers] == [e.item() for e in enc] != [d.item() for d in dec]
    assert [lay.scalar.item() for lay in model.layers] == [d.item() for d in dec]
    moe = model.layers[3].moe
    assert torch.equal(moe.w_gate[1], gate_up[1, :32]) and torch.equal(moe.w_up[1], gate_up[1, 32:])
    assert torch.equal(moe.w_down[2], down[2].t())
    assert model.layers[2].attn.wv is None and model.layers[0].attn.wv is not None      # full layers: V = K


def safetensors_open(path):
    from safetensors import safe_open
    return safe_open(path, framework="pt")


def edited(tmp_path, edit, name="ckpt"):
    """A copy of the tiny checkpoint whose config.json `edit` changes (the weights linked, not copied)."""
    folder = tmp_path / name
    folder.mkdir()
    for f in os.listdir(CKPT):
        if f != "config.json":
            os.symlink(os.path.join(CKPT, f), folder / f)
    with open(os.path.join(CKPT, "config.json")) as f:
        cfg = json.load(f)
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def test_the_release_config_keys_read_as_per_layer_config(tmp_path):
    """The release's config.json has global_head_dim / num_global_key_value_heads and no per_layer_config."""
    release = edited(tmp_path, lambda c: c["text_config"].pop("per_layer_config"))
    both, only = read_config(CKPT).gemma, read_config(release).gemma
    assert only == both and both.head_dims == (16, 16, 32, 16, 16, 32) and both.kv_heads == (2, 2, 1, 2, 2, 1)


@pytest.mark.parametrize("key,value,words", [
    ("attention_bias", True, "attention_bias = true"),
    ("use_bidirectional_attention", "all", "use_bidirectional_attention"),
    ("hidden_size_per_layer_input", 256, "hidden_size_per_layer_input"),
    ("attention_k_eq_v", False, "attention_k_eq_v"),
    ("hidden_activation", "gelu", "hidden_activation"),
    ("layer_types", ["full_attention"] * 5 + ["sliding_attention"], "layer_types"),
    ("rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters"),
    ("per_layer_config", {"2": {"head_dim": 32, "sliding_window": 4}}, "per_layer_config"),
    ("final_logit_softcapping", None, "final_logit_softcapping"),
])
def test_a_config_value_fastdllm_does_not_implement_is_one_line(tmp_path, key, value, words):
    folder = edited(tmp_path, lambda c: c["text_config"].__setitem__(key, value))
    with pytest.raises(ValueError, match=words) as e:
        load_model(folder)
    assert "\n" not in str(e.value)


def test_untied_encoder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        read_config(edited(tmp_path, lambda c: c.__setitem__("tie_word_embeddings", False)))


def test_bad_input_is_one_line(dg):
    cfg = dg[torch.float32].config
    with pytest.raises(ValueError, match="image token id 258880"):
        check_text_only(cfg, torch.tensor([[2, 258880, 5]]))
    check_text_only(cfg, torch.tensor([[2, 5]]))
    with pytest.raises(ValueError, match="block_length 8 is not this checkpoint's canvas: .*canvas_length 16"):
        generate(dg[torch.float32], torch.tensor([[2, 5]]), gen_length=16, block_length=8)
    for settings, words in [((0, 0.1, 0.4, 0.8), "steps"), ((48, 0.0, 0.4, 0.8), "entropy_bound"),
                            ((48, -1, 0.4, 0.8), "entropy_bound"), ((48, 0.1, 0.8, 0.4), "t_min < t_max"),
                            ((48, 0.1, 0.4, 0.4), "t_min < t_max"), ((48, 0.1, None, 0.8), "both t_min and t_max"),
                            ((48, 0.1, 0.4, 0.8, -1, 0.005), "stability_threshold"),
                            ((48, 0.1, 0.4, 0.8, 1, None), "both stability_threshold")]:
        with pytest.raises(ValueError, match=words) as e:
            check_decode(*settings)
        assert "\n" not in str(e.value)
    check_decode(48, 0.1, 0.4, 0.8, 1, 0.005)
    check_decode(10, 1e-9, None, None)
    assert "entropy_bound" in RUNS["g_eb0_error"]["error"]          # the official refuses 0.0 too


# ------------------------------------------------------------------------------------------------ the decode

def decode(dg, run, official_positions=True, eos=None, trace=None, force=None):
    """The naive decode with the golden run's settings and seed; returns its result and the randomness fingerprint
    (the next randint the generator gives)."""
    s, eg = run["settings"], run["effective_generation_config"]
    model = copy.copy(dg[getattr(torch, s["dtype"])])
    model.config = dataclasses.replace(model.config, gemma=dataclasses.replace(model.config.gemma,
                                                                               canvas=s["canvas_length"]))
    g = torch.Generator().manual_seed(s["seed"])
    mask = None if run["attention_mask"] is None else torch.tensor(run["attention_mask"])
    start = torch.tensor(s["decoder_input_ids"]) if "decoder_input_ids" in s else None
    out = reference_generate(model, torch.tensor(run["input_ids"]), mask, s["canvas_length"], eg["max_new_tokens"],
                             eg["max_denoising_steps"], eg["entropy_bound"], eg["t_min"], eg["t_max"],
                             eg["stability_threshold"], eg["confidence_threshold"],
                             eg["eos_token_id"] if eos is None else eos, eg["pad_token_id"], g, start_canvas=start,
                             official_positions=official_positions, trace=trace, force=force)
    return out, torch.randint(0, 2 ** 31 - 1, (1,), generator=g).item()


@pytest.mark.parametrize("name", ["g_cl4_stab1", "g_b2_left_eos_trace"])
def test_golden_run_reproduced_whole(dg, name):
    """Runs decided by a wide margin (a sharp schedule, adaptive stopping firing; a left-padded batch whose row stops
    at an end token and pads the rest): everything the official returned, with its positions (slot numbers)."""
    run = RUNS[name]
    out, fingerprint = decode(dg, run)
    res = run["result"]
    assert out["ids"].tolist() == res["sequences"]
    assert out["decoder_calls"] == res["decoder_forward_passes"]
    assert out["steps_per_canvas"] == res["steps_per_canvas"]
    assert out["tokens_per_call"] == res["tokens_per_forward"]
    assert fingerprint == res["rng_fingerprint_after"]


@pytest.mark.parametrize("name", [n for n, r in RUNS.items() if "trace" in (r.get("result") or {})])
def test_golden_trace_first_steps_of_every_canvas(dg, name):
    """Given the official run's canvases (each step's input, each canvas's commit), every canvas's first 3 steps
    draw, accept, renoise and stop exactly as it did: the start canvas, the temperature schedule, the order of the
    draws, the entropy bound, the self-conditioning of steps 2 and 3, later canvases' positions and cache."""
    run, trace = RUNS[name], []
    res, L, C = run["result"], len(run["input_ids"][0]), run["settings"]["canvas_length"]
    seq = torch.tensor(res["sequences"])
    force = dict(canvases=[[torch.tensor(st["input_canvas"]) for st in c["steps"]] for c in res["trace"]],
                 commits=[seq[:, L + i * C:L + (i + 1) * C] for i in range(len(res["trace"]))])
    decode(dg, run, trace=trace, force=force)
    for c, canvas in enumerate(res["trace"]):
        ours = [t for t in trace if t["canvas"] == c]
        for i, (mine, official) in enumerate(zip(ours[:3], canvas["steps"][:3])):
            for key, theirs in (("sample", "denoiser_canvas"), ("accepted", "accepted_mask"),
                                ("argmax", "argmax_canvas"), ("next_canvas", "next_canvas"),
                                ("done", "finished_denoising_after")):
                assert mine[key].long().tolist() == official[theirs], (c, i, key)


FIXED = [n for n, r in RUNS.items() if r.get("result") and r["result"]["steps_per_canvas"] == [
    r["effective_generation_config"]["max_denoising_steps"]] * math.ceil(
    r["effective_generation_config"]["max_new_tokens"] / r["settings"]["canvas_length"])]


@pytest.mark.parametrize("name", FIXED)
def test_golden_randomness_of_every_fixed_length_run(dg, name):
    """Every run whose canvases all took their full steps (bf16, padded batches and a given start canvas included),
    with the end tokens off so that no row stops on a token of its own trajectory: the same number of steps per
    canvas, decoder calls per row, and the same randomness drawn, to the last number."""
    run = RUNS[name]
    out, fingerprint = decode(dg, run, official_positions=False, eos=())
    res = run["result"]
    assert out["steps_per_canvas"] == res["steps_per_canvas"]
    assert fingerprint == res["rng_fingerprint_after"]
    unfinished = [calls for calls, row in zip(res["decoder_forward_passes"], res["sequences"]) if row[-1] != 0]
    assert unfinished and all(calls == sum(res["steps_per_canvas"]) for calls in unfinished)
    assert set(out["decoder_calls"]) == {sum(res["steps_per_canvas"])}


# ------------------------------------------------------------------------------------------------ the release's format

def test_release_format_at_tiny_size_loads_and_chats(tmp_path):
    """tools/checkpoint.py --release google/diffusiongemma-26B-A4B-it: the release's config keys (no per_layer_config),
    two shards with their index, stacked experts, a vision tower; its chat format is Gemma 4's turns."""
    from chat import Chat
    from tools.gemma_checkpoint import TEXT_TINY, make_gemma_release, sizes
    folder = str(tmp_path / "dg")
    make_gemma_release(folder)
    model = load_model(folder)
    assert "per_layer_config" not in json.load(open(os.path.join(folder, "config.json")))["text_config"]
    assert model.config.gemma.head_dims == (16,) * 5 + (32,) and model.config.eos_ids == (1, 106, 50)
    assert sizes(TEXT_TINY)[0] == sum(p.numel() for p in model.parameters())
    chat = Chat(folder, model.config)
    assert chat.style == "gemma4" and {1, 106} <= chat.stop_ids
    text = chat.render([{"role": "system", "content": "Be brief. "}, {"role": "user", "content": " hi "},
                        {"role": "assistant", "content": "<|channel>thought\nhm<channel|>yo"},
                        {"role": "user", "content": "bye"}])
    assert text == ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nhi<turn|>\n<|turn>model\nyo<turn|>\n"
                    "<|turn>user\nbye<turn|>\n<|turn>model\n")
    # and what jinja2 renders from the checkpoint's template text, as transformers' apply_chat_template does
    jinja2 = pytest.importorskip("jinja2")
    from chat import chat_template
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(chat_template(folder))
    messages = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": " hi "},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "bye"}]
    assert chat.render(messages) == template.render(messages=messages, bos_token="<bos>", add_generation_prompt=True)


def test_a_template_that_closes_the_thought_channel_gets_it(tmp_path):
    """The larger Gemma 4 templates open the answer with an empty, closed thought channel when thinking is off (their
    default): where the checkpoint's template text does, so does ours."""
    from chat import Chat
    from tools.gemma_checkpoint import make_gemma_release
    folder = str(tmp_path / "dg")
    make_gemma_release(folder)
    with open(os.path.join(folder, "chat_template.jinja"), "a") as f:
        f.write("{%- if not enable_thinking | default(false) -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}")
    chat = Chat(folder, read_config(folder))
    assert chat.render([{"role": "user", "content": "hi"}]).endswith("<|turn>model\n<|channel>thought\n<channel|>")


def test_release_sizes_are_the_published_ones():
    """26B parameters with about 4B active (the model card; the vision tower, not counted here, is the rest)."""
    from tools.gemma_checkpoint import sizes
    total, active = sizes()
    assert 24.5e9 < total < 26e9 and 3.5e9 < active < 4.5e9
