"""LLaDA2.0 / LLaDA2.1 (model_type "llada2_moe"; tests/golden/llada2-README.md): the official forward's logits on the
golden tiny checkpoint under the block-causal mask, the KV-cache split the block-diffusion decode uses, every routing
switch against a plain transcription of the official forward, what we refuse, and how the experts load."""
import collections
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from cache import KVCache
from conftest import GOLDEN, copy_checkpoint, read_golden
from model import load_model
from shapes import make_checkpoint

GOLD = read_golden("llada2-golden.json")
TINY = os.path.join(GOLDEN, "llada2-tiny")


@pytest.fixture(scope="module")
def llada2():
    return load_model(TINY, device="cpu", dtype=torch.float32)


def block_causal(batch: int, queries: int, keys: int, block: int, start: int = 0) -> torch.Tensor:
    """(B, 1, T, keys) bool: query q (canvas position start + q) sees key k iff q // block >= k // block."""
    q = torch.arange(start, start + queries)[:, None] // block
    return (q >= torch.arange(keys)[None, :] // block)[None, None].expand(batch, 1, queries, keys)


# float32 noise on these logits (up to ~25), each against a float64 run of the same model (measured): ours 1.5e-5, the
# official's 1.2e-5; ours against the official's 1.05e-5 (its gate and up are two matmuls, ours one: the float32 sums
# go in another order). A wrong mask, position or weight is off by O(1).
ATOL = 3e-5


def close(logits, ref, atol=ATOL):
    """Our (B, T, V) logits against a golden summary (argmax, top-5 ids and values, logsumexp, probe columns)."""
    logits = logits.double()
    top = logits.topk(5, dim=-1)
    assert list(logits.shape) == ref["shape"] and logits.argmax(-1).tolist() == ref["argmax"]
    assert top.indices.tolist() == ref["top_idx"]
    for ours, theirs in ((logits.logsumexp(-1), ref["logsumexp"]), (top.values, ref["top_val"]),
                         (logits[..., ref["cols"]], ref["col_val"])):
        assert (ours - torch.tensor(theirs, dtype=torch.float64)).abs().max() < atol


@pytest.mark.parametrize("name,block", [("bidirectional", None), ("block_causal_32", 32), ("block_causal_8", 8)])
def test_forward_matches_the_official_logits(llada2, name, block):
    """float32, within the float32 noise (ATOL): the whole canvas, and the block-causal forward the official
    generate() runs (its 0 / -inf mask as our boolean one)."""
    f = GOLD["forward"]
    ids = torch.tensor(f["input_ids"])
    mask = None if block is None else block_causal(ids.shape[0], ids.shape[1], ids.shape[1], block)
    with torch.no_grad():
        close(llada2(ids, mask=mask), f[name])


def test_the_kv_cache_split_equals_the_official_forward(llada2):
    """The split the block-diffusion decode uses (the official generate() recomputes the window instead): the
    complete prompt blocks once into the cache under the block-causal mask, then the next block alone, seeing every
    cached key and itself: equal to the official model called the same way (and to its whole-window forward)."""
    k = GOLD["kv_cache"]
    x, P, B = torch.tensor(k["input_ids"]), k["prefill_len"], k["block"]
    L = x.shape[1]
    kv = KVCache.for_model(llada2, 1, L)
    with torch.no_grad():
        close(llada2(x[:, :P], cache=kv, start=0, mask=block_causal(1, P, L, B)), k["prefill"])
        close(llada2(x[:, P:], cache=kv, start=P), k["block_logits"])
    assert k["max_abs_diff_vs_window"] < 1e-5


def test_config_reads_every_field(llada2):
    c = llada2.config
    assert (c.arch, c.family, c.mask_id, c.pad_id, c.rope_theta, c.norm_eps) == ("llada2_moe", "llada2", 156895,
                                                                                 156892, 600000, 1e-6)
    assert (c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.rotary_dim, c.ffn_dim) == (16, 2, 1, 8, 4, 48)
    m = c.moe
    assert (m.n_experts, m.top_k, m.ffn_dim, m.shared_ffn_dim, m.sparse) == (8, 2, 12, 12, (False, True, True))
    assert (m.router, m.n_group, m.topk_group, m.scale, m.expert_bias) == ("sigmoid", 4, 2, 2.5, True)
    assert c.qk_norm and c.fused_qkv and not c.qkv_bias and not c.rope_fp32 and not c.tie_embeddings


# ------------------------------------------------------------------------------------- every routing switch
def reference_logits(folder: str, ids: torch.Tensor) -> torch.Tensor:
    """The official LLaDA2 forward written out plainly on the checkpoint's own tensors (float32, no mask): a per-token
    loop over its experts, the group-limited choice spelled out with Python sets, repeat_kv, partial RoPE."""
    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    sd = {k: v.float() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    B, T = ids.shape
    D, H, KV, eps = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["rms_norm_eps"]
    hd = D // H
    rd = int(hd * hf["partial_rotary_factor"])
    E, k, G, TG = hf["num_experts"], hf["num_experts_per_tok"], hf["n_group"], hf["topk_group"]

    def norm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def mlp(x, p):
        h = F.silu(x @ sd[p + "gate_proj.weight"].T) * (x @ sd[p + "up_proj.weight"].T)
        return h @ sd[p + "down_proj.weight"].T

    inv = 1.0 / hf["rope_theta"] ** (torch.arange(0, rd, 2).float() / rd)
    ang = torch.arange(T).float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(x):
        r, rest = x[..., :rd], x[..., rd:]
        return torch.cat([r * cos + torch.cat([-r[..., rd // 2:], r[..., :rd // 2]], -1) * sin, rest], -1)

    def choose(score, bias):
        """One token's experts: groups ranked by the sum of their two best biased scores, then the k best biased
        scores inside the kept groups; weights: the unbiased scores, renormalised (k > 1), scaled."""
        biased = score + bias
        per = E // G
        rank = sorted(range(G), key=lambda g: -sorted(biased[g * per:(g + 1) * per].tolist())[-2:][0]
                      - sorted(biased[g * per:(g + 1) * per].tolist())[-1])
        kept = {e for g in rank[:TG] for e in range(g * per, (g + 1) * per)}
        chosen = sorted(kept, key=lambda e: -biased[e].item())[:k]
        w = score[chosen]
        w = w / (w.sum() + 1e-20) if k > 1 else w
        return chosen, w * hf["routed_scaling_factor"]

    x = sd["model.word_embeddings.weight"][ids]
    for i in range(hf["num_hidden_layers"]):
        a = f"model.layers.{i}."
        h = norm(x, sd[a + "input_layernorm.weight"])
        qkv = h @ sd[a + "attention.query_key_value.weight"].T
        if hf["use_qkv_bias"]:
            qkv = qkv + sd[a + "attention.query_key_value.bias"]
        q, kk, v = qkv.view(B, T, H + 2 * KV, hd).split([H, KV, KV], dim=2)
        if hf.get("use_qk_norm", True):
            q = norm(q, sd[a + "attention.query_layernorm.weight"])
            kk = norm(kk, sd[a + "attention.key_layernorm.weight"])
        q, kk = rope(q.transpose(1, 2)), rope(kk.transpose(1, 2)).repeat_interleave(H // KV, 1)
        v = v.transpose(1, 2).repeat_interleave(H // KV, 1)
        y = torch.softmax(q @ kk.transpose(-1, -2) / math.sqrt(hd), -1) @ v
        x = x + y.transpose(1, 2).reshape(B, T, D) @ sd[a + "attention.dense.weight"].T
        h = norm(x, sd[a + "post_attention_layernorm.weight"]).reshape(B * T, D)
        if i >= hf["first_k_dense_replace"]:
            scores = torch.sigmoid(h @ sd[a + "mlp.gate.weight"].T)
            out = []
            for n in range(B * T):
                chosen, w = choose(scores[n], sd[a + "mlp.gate.expert_bias"])
                out.append(sum(w[j] * mlp(h[n], f"{a}mlp.experts.{e}.") for j, e in enumerate(chosen)))
            out = torch.stack(out)
            if hf["num_shared_experts"]:
                out = out + mlp(h, a + "mlp.shared_experts.")
        else:
            out = mlp(h, a + "mlp.")
        x = x + out.view(B, T, D)
    return norm(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


SWITCHES = {
    "release": {},                                                   # 4 of 8 groups, bias, shared, layer 0 dense
    "one group": dict(n_group=1, topk_group=1),                      # plain top-k over the biased scores
    "every group kept": dict(n_group=4, topk_group=4),
    "top-1 (no renormalisation)": dict(top_k=1),
    "no shared expert": dict(num_shared_experts=None),
    "two shared experts": dict(num_shared_experts=2),
    "all sparse": dict(first_k_dense_replace=0),
    "two dense": dict(first_k_dense_replace=2),
    "q/k/v bias": dict(use_qkv_bias=True),
    "no q/k norm": dict(use_qk_norm=False),
    "full rotary": dict(partial_rotary_factor=1.0),
    "multi-head": dict(n_kv_heads=4),
    "16 experts, top-4 in 2 of 4 groups": dict(experts=16, top_k=4, n_group=4, topk_group=2),
}


@pytest.mark.parametrize("name", SWITCHES)
def test_each_switch_equals_the_official_forward(tmp_path, name):
    """Each switch the official forward reads, on a random checkpoint in the real format: our logits equal the
    plain transcription within 1e-5, in the all-experts path (many tokens) and the gathered one (a few)."""
    kw = dict(experts=8, top_k=2, expert_ffn=8, n_group=4, topk_group=2, num_shared_experts=1,
              first_k_dense_replace=1) | SWITCHES[name]
    n_kv = kw.pop("n_kv_heads", 2)
    make_checkpoint(str(tmp_path), "llada2", 32, 3, 1024, n_heads=4, n_kv_heads=n_kv, ffn=48, logit_std=2.0, **kw)
    sd = load_file(os.path.join(str(tmp_path), "model.safetensors"))
    if "model.layers.2.mlp.gate.expert_bias" in sd:   # a bias large enough to move choices (the writer's is tiny)
        for key in [k for k in sd if k.endswith("expert_bias")]:
            sd[key] = torch.randn(sd[key].shape, generator=torch.Generator().manual_seed(3)).mul(0.3).bfloat16()
        from safetensors.torch import save_file
        save_file(sd, os.path.join(str(tmp_path), "model.safetensors"), metadata={"format": "pt"})
    model = load_model(str(tmp_path), device="cpu", dtype=torch.float32)
    for ids in (torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0)), torch.tensor([[5, 9]])):
        with torch.no_grad():
            assert (model(ids) - reference_logits(str(tmp_path), ids)).abs().max() < 1e-5


def test_the_bias_and_the_group_limit_change_the_routing(llada2):
    """Both are read (neither switch is a no-op on the golden checkpoint): zeroing the expert bias, or keeping
    every group, changes the logits; the choice with the bias differs from the one without for some tokens."""
    ids = torch.tensor(GOLD["forward"]["input_ids"])
    with torch.no_grad():
        before = llada2(ids)
        moe = llada2.layers[1].mlp
        bias = moe.expert_bias.detach().clone()
        try:
            moe.expert_bias.zero_()
            assert (llada2(ids) - before).abs().max() > 1e-3
        finally:
            moe.expert_bias.copy_(bias)
        try:
            moe.topk_group = moe.n_group
            assert (llada2(ids) - before).abs().max() > 1e-3
        finally:
            moe.topk_group = llada2.config.moe.topk_group
        assert torch.equal(llada2(ids), before)


# ------------------------------------------------------------------------------------- what we refuse
REFUSED = [("score_function", "softmax"), ("norm_topk_prob", False), ("router_dtype", "bf16"),
           ("moe_router_enable_expert_bias", False), ("norm_head", True), ("norm_softmax", True),
           ("use_rmsnorm", False), ("using_split_qkv_in_self_attention", True), ("use_sliding_window", True),
           ("head_dim", 16), ("rotary_dim", 8), ("partial_rotary_factor", 0), ("first_k_dense_replace", 4),
           ("num_shared_experts", 0), ("hidden_act", "gelu"), ("rope_scaling", {"type": "yarn", "factor": 4.0}),
           ("use_bias", True)]


def edit_config(folder: str, **changes):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        hf = json.load(f)
    hf.update(changes)
    with open(path, "w") as f:
        json.dump(hf, f)
    return folder


@pytest.mark.parametrize("key,value", REFUSED, ids=lambda v: str(v))
def test_a_switch_we_do_not_implement_is_refused_in_one_line(tmp_path, key, value):
    d = edit_config(copy_checkpoint("llada2-tiny", tmp_path), **{key: value})
    with pytest.raises(ValueError, match=f"^config.json sets {key} = ") as e:
        load_model(d)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("changes", [dict(n_group=3), dict(n_group=8), dict(topk_group=5), dict(num_experts_per_tok=5),
                                     dict(num_experts=0)], ids=lambda c: str(c))
def test_a_routing_that_does_not_fit_is_one_line(tmp_path, changes):
    d = edit_config(copy_checkpoint("llada2-tiny", tmp_path), **changes)
    with pytest.raises(ValueError, match="^config.json( gives|'s routing)") as e:
        load_model(d)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------- the loader
class Allocations(TorchDispatchMode):
    """Bytes of every new CPU storage an op makes (not a view of one of its inputs), by op."""

    def __init__(self):
        super().__init__()
        self.bytes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.untyped_storage().data_ptr():
            ptr = out.untyped_storage().data_ptr()
            if not any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr for a in args):
                self.bytes[str(func)] += out.untyped_storage().nbytes()
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_experts_load_without_a_second_copy(dtype):
    """Every byte load_model allocates is a parameter's, allocated once: each expert is copied into its row of the one
    preallocated (experts, ffn, dim) stack, and gate and up into their rows of the one fused (2 ffn, dim) weight of
    the dense layer and of the shared expert; nothing is stacked or concatenated afterwards. bf16 -> bf16 on the CPU
    allocates those only: every other tensor maps the file."""
    alloc = Allocations()
    with alloc:
        model = load_model(TINY, device="cpu", dtype=dtype)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    stacks = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                 if n.rpartition(".")[2] in ("w_gate", "w_up", "w_down") and p.dim() == 3)
    fused = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "w_gate_up" in n)
    assert stacks and fused and not any("stack" in op or "cat" in op for op in alloc.bytes)
    assert sum(alloc.bytes.values()) == (params if dtype == torch.float32 else stacks + fused)
    src = load_file(os.path.join(TINY, "model.safetensors"))
    mlp = model.layers[2].mlp
    assert torch.equal(mlp.w_gate[5], src["model.layers.2.mlp.experts.5.gate_proj.weight"].to(dtype))
    assert torch.equal(mlp.w_down[5], src["model.layers.2.mlp.experts.5.down_proj.weight"].to(dtype).T)
    qkv = src["model.layers.0.attention.query_key_value.weight"].to(dtype)
    assert torch.equal(model.layers[0].attn.wqkv.weight, qkv)
    gate_up = model.layers[2].mlp.shared.w_gate_up.weight
    assert torch.equal(gate_up[12:], src["model.layers.2.mlp.shared_experts.up_proj.weight"].to(dtype))


def test_the_weight_bytes_a_call_reads(tmp_path, capsys):
    """tools/step_count.py moe --family llada2 on a 3-layer checkpoint (layer 0 dense, 1 and 2 MoE), scaled to
    LLaDA2.x-mini's 20 layers: its rows equal the bytes counted here from the checkpoint's own tensors (the dense
    layer once, 19 MoE layers, the head and final norm; the embedding aside), and the union of a call's routed
    experts lies between one token's top-k and every expert."""
    from tools.step_count import main
    E, k = 32, 4
    make_checkpoint(str(tmp_path), "llada2", 32, 3, 1024, n_heads=4, n_kv_heads=2, ffn=48, logit_std=2.0,
                    experts=E, top_k=k, expert_ffn=8)
    out = main(["moe", "--family", "llada2", "--model", str(tmp_path), "--batch", "1", "--modes", "prefix",
                "--gen-length", "32"])
    src = load_file(os.path.join(tmp_path, "model.safetensors"))
    size = lambda prefix: sum(t.numel() * 2 for n, t in src.items() if n.startswith(prefix))    # noqa: E731
    expert = size("model.layers.1.mlp.experts.0.")
    every = size("model.layers.0.") + 19 * size("model.layers.1.") + size("lm_head.") + size("model.norm.")
    rows = dict(out["rows"])
    assert rows[f"LLaDA2.x-mini: every expert (our block, {E} per layer)"] == every
    assert rows[f"LLaDA2.x-mini: one token's {k} experts per layer"] == every - 19 * (E - k) * expert
    assert k <= out["union"] <= E and set(out["fed"]) <= {32, 64} and out["fed"][32] > 0
    assert "| LLaDA2.x-flash: every expert" in capsys.readouterr().out
