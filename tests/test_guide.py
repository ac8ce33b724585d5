"""
The guide of FlashDLM's guided diffusion (arXiv 2505.21467, section 4): the causal Qwen2 family in model.py,
its state (guided.Guide), the acceptance rules (guided.accept_drafts) and the shared-vocabulary check
(guided.check_guide). Golden numbers are the official code's (tests/golden/flashdlm-golden.json).
"""
import functools
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from reference import predictions
from tokenizers import Tokenizer, models

from conftest import GOLDEN, copy_checkpoint
from cache import KVCache
from guided import Guide, accept_drafts, check_guide
from model import ModelConfig, load_model

ATOL = 1e-4   # spec: the guide's logits within 1e-4 of the official float32 run


@pytest.fixture(scope="module")
def golden(flashdlm_golden):
    return flashdlm_golden


@pytest.fixture(scope="module")
def qwen(qwen2):
    return qwen2


def check_guide_summary(logits, ref):
    """Our (T, V) next-token logits against the golden guide_forward summary."""
    logits = logits.double()
    assert logits.argmax(-1).tolist() == ref["argmax_all_rows"]
    at = logits[ref["positions"]]
    assert at.argmax(-1).tolist() == ref["argmax"]
    assert (at.logsumexp(-1) - torch.tensor(ref["logsumexp"], dtype=torch.float64)).abs().max() < ATOL
    top = at.topk(5, dim=-1)
    assert top.indices.tolist() == ref["top5_ids"]
    assert (top.values - torch.tensor(ref["top5_values"], dtype=torch.float64)).abs().max() < ATOL
    assert (at[:, ref["probe_cols"]] - torch.tensor(ref["probe_values"], dtype=torch.float64)).abs().max() < ATOL


# ------------------------------------------------------------------------------------------ the model
def test_guide_forward_matches_golden(qwen, golden):
    ref = golden["guide_forward"]
    assert qwen.config.causal and not qwen.config.shift and qwen.config.vocab_size == ref["vocab_size"]
    ids = torch.tensor([ref["input_ids"]])
    with torch.no_grad():
        full = qwen(ids)[0]                                             # uncached: row i predicts token i+1
        # cached_two_chunks: the same text in two chunks through the KV cache (the official split)
        kv, a = KVCache.for_model(qwen, 1, ids.shape[1]), ref["cached_two_chunks"]["split"]
        two = torch.cat([qwen(ids[:, :a], cache=kv)[0], qwen(ids[:, a:], cache=kv, start=a)[0]])
    check_guide_summary(full, ref)
    check_guide_summary(two, ref)
    # Logits reach ~50, where a float32 step is 4e-6: the official cached run is 1.24e-5 off its own uncached one;
    # ours 3.2e-5 on an AVX-512 Xeon (its SDPA kernel's fast exp), a few float32 steps either way.
    assert (two - full).abs().max() <= 4 * ref["cached_two_chunks"]["max_abs_diff_vs_uncached"]


def test_causal_attention_ignores_the_future(qwen):
    """Changing a later token changes no earlier row (the diffusion families would change every row)."""
    ids = torch.arange(3, 20)[None]
    with torch.no_grad():
        a, b = qwen(ids)[0], qwen(ids.index_fill(1, torch.tensor([10]), 999))[0]
    assert torch.equal(a[:10], b[:10]) and not torch.allclose(a[10:], b[10:])


def test_tied_head_is_the_embedding_loaded_once(qwen):
    assert qwen.lm_head.weight is qwen.embed.weight                     # one Parameter, not a copy
    assert len(list(qwen.parameters())) == len(dict(qwen.named_parameters()))
    assert "lm_head.weight" not in dict(qwen.named_parameters())
    stored = load_file(os.path.join(GOLDEN, "qwen2-tiny", "model.safetensors"))
    assert torch.equal(qwen.embed.weight, stored["model.embed_tokens.weight"].float())


def rewrite(tmp_path, edit_state=None, **config):
    d = copy_checkpoint("qwen2-tiny", tmp_path)
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(config)
    with open(path, "w") as f:
        json.dump(cfg, f)
    if edit_state:
        state = load_file(os.path.join(d, "model.safetensors"))
        edit_state(state)
        save_file(state, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    return d


def test_untied_head_loads_its_own_tensor(tmp_path):
    head = torch.randn(1024, 32).bfloat16()
    d = rewrite(tmp_path, lambda s: s.update({"lm_head.weight": head}), tie_word_embeddings=False)
    m = load_model(d)
    assert m.lm_head.weight is not m.embed.weight and torch.equal(m.lm_head.weight, head.float())


@pytest.mark.parametrize("case,edit,config,error", [
    ("missing embedding", lambda s: s.pop("model.embed_tokens.weight"), {},
     r"'model\.embed_tokens\.weight' is missing"),
    ("head stored but tied", lambda s: s.update({"lm_head.weight": torch.zeros(1024, 32)}), {},
     r"stores lm_head\.weight but config\.json sets tie_word_embeddings: true"),
    ("untied, no head", None, {"tie_word_embeddings": False},
     r"'lm_head\.weight' is missing .*tie_word_embeddings: true"),
    ("no q bias", lambda s: s.pop("model.layers.1.self_attn.q_proj.bias"), {},
     r"'model\.layers\.1\.self_attn\.q_proj\.bias' is missing"),
    ("sliding window", None, {"use_sliding_window": True}, r"config\.json sets use_sliding_window = True"),
    ("gelu", None, {"hidden_act": "gelu"}, r"config\.json sets hidden_act = 'gelu'"),
    ("no vocab_size", None, {"vocab_size": None}, r"vocab_size = None, not a positive integer"),
])
def test_qwen2_loader_errors(tmp_path, case, edit, config, error):
    d = rewrite(tmp_path, edit, **config)
    with pytest.raises(ValueError, match=error):
        load_model(d)


# ------------------------------------------------------------------------------------------ verification
def test_accept_drafts_rules():
    # one row per draft; vocabulary of 6, probabilities 0.5, 0.2, 0.15, 0.1, 0.05, 0 (logit -inf)
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    logits = p.log().expand(6, 6)
    drafts = torch.arange(6)
    assert accept_drafts(logits, drafts).tolist() == [True] + [False] * 5
    assert accept_drafts(logits, drafts, "topk", k=3).tolist() == [True] * 3 + [False] * 3
    assert accept_drafts(logits, drafts, "topk", k=6).tolist() == [True] * 6
    # within the top 3 AND at least 0.3 of the top probability (0.15 qualifies, 0.1 would not)
    assert accept_drafts(logits, drafts, "topk_relative", k=3, ratio=0.3).tolist() == [True] * 3 + [False] * 3
    assert accept_drafts(logits, drafts, "topk_relative", k=5, ratio=0.39).tolist() == [True, True] + [False] * 4
    assert accept_drafts(logits.double(), drafts, "topk", k=2).dtype == torch.bool
    with pytest.raises(ValueError, match="unknown acceptance rule 'greedy'"):
        accept_drafts(logits, drafts, "greedy")


def recorder(reject_at=None):
    """An acceptance rule (batch of one row) that keeps every logits row it is shown and rejects draft
    `reject_at` (a position in the whole draft list, counted across chunks)."""
    seen = []

    def accept(logits, drafts):
        seen.append(logits[0].clone())
        ok = torch.ones(drafts.shape, dtype=torch.bool)
        start = sum(len(s) for s in seen[:-1])
        if reject_at is not None and start <= reject_at < start + drafts.shape[1]:
            ok[0, reject_at - start] = False
        return ok
    return accept, seen


@pytest.mark.parametrize("chunk", [1, 3, 32])
def test_chunked_cached_verification_equals_one_causal_forward(qwen, chunk):
    """Over several steps of prefill / verify / commit, with rejections that leave stale slots in the cache,
    every logits row the rule sees equals the uncached causal forward over the committed text + drafts."""
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, 1000, (9,), generator=g)
    L = 9 + 20                                        # the canvas: the drafts always run to its end
    guide = Guide(qwen, 1, L)
    with torch.no_grad():
        assert guide.prefill(text[None]) == 1 and guide.length.tolist() == [8]
        for reject_at, commit in [(5, 5), (0, 1), (None, 7), (2, 1)]:   # commit 7 of 14, 1 after 2: eos cuts
            drafts = torch.randint(0, 1000, (L - len(text),), generator=g)
            accept, seen = recorder(reject_at)
            n, at, calls = guide.verify(torch.cat([text, drafts])[None], accept, chunk=chunk)
            N = len(drafts)
            assert n.tolist() == [N if reject_at is None else reject_at]
            assert calls == len(seen) == (-(-N // chunk) if reject_at is None else reject_at // chunk + 1)
            ref = qwen(torch.cat([text, drafts])[None])[0, len(text) - 1:-1]   # rows predicting d0, d1, ...
            got = torch.cat(seen)
            # Equal up to float32 rounding, and the guide's choices exactly. Other chunk shapes sum in another
            # order: on logits up to ~60 that is up to ~1e-4 here (a few float32 steps of 4e-6 per layer; the
            # official cached forward is 1.24e-5 off its own uncached one). A wrong position or a stale cache
            # slot is off by O(1).
            torch.testing.assert_close(got, ref[:len(got)], rtol=0, atol=ATOL)
            assert torch.equal(got.argmax(-1), ref[:len(got)].argmax(-1))
            if reject_at is not None:              # the guide's logits at the rejected draft, for speculative
                torch.testing.assert_close(at[0], ref[reject_at], rtol=0, atol=ATOL)
            guide.commit(torch.tensor([commit]), torch.tensor([False]))
            text = torch.cat([text, drafts[:commit]])
            assert guide.length.tolist() == [len(text) - 1]


def test_batched_verification_equals_each_row_alone(qwen):
    """Three rows, left-padded prompts of different lengths, committing different amounts: one forward per
    chunk serves them all, and every row's verdicts and logits are the ones it gets alone (the same canvas
    slots, its own RoPE positions from its first real token, pads never attended). A finished row leaves."""
    accept = functools.partial(accept_drafts, rule="topk", k=512)
    g = torch.Generator().manual_seed(1)
    lens, P, G = [9, 4, 6], 9, 24
    L = P + G
    rows = [torch.randint(0, 1000, (n,), generator=g) for n in lens]
    canvas = torch.stack([torch.cat([torch.full((P - n,), 1000), r, torch.randint(0, 1000, (G,), generator=g)])
                          for r, n in zip(rows, lens)])
    real = torch.arange(L) >= torch.tensor([[P - n] for n in lens])
    pos = (real.long().cumsum(-1) - 1).clamp(min=0)
    batch = Guide(qwen, 3, L, pos, real)
    alone = [Guide(qwen, 1, n + G) for n in lens]
    calls, solo_calls = batch.prefill(canvas[:, :P]), 0
    last = torch.full((3,), P - 1)                        # each row's last committed position
    sizes = []
    with torch.no_grad():
        for i, n in enumerate(lens):
            solo_calls += alone[i].prefill(canvas[i:i + 1, P - n:P])
        while len(batch.rows):
            served = batch.rows.tolist()
            nb, atb, c = batch.verify(canvas, accept, chunk=4)
            calls += c
            for i in served:
                ns, ats, c = alone[i].verify(canvas[i:i + 1, P - lens[i]:], accept, chunk=4)
                solo_calls += c
                assert nb[i] == ns[0]
                torch.testing.assert_close(atb[i], ats[0], rtol=0, atol=ATOL)
            # commit the accepted run and the next draft (as if the guide's token were the draft), to the end
            commit = torch.minimum(nb + 1, L - 1 - last)
            last += commit
            for i in served:
                alone[i].commit(commit[i:i + 1], torch.tensor([False]))
            batch.commit(commit, last == L - 1)
            assert batch.cache.k[0].shape[0] == len(batch.rows)       # a finished row has left the guide's batch
            sizes.append(len(batch.rows))
    assert calls < solo_calls and len(set(sizes) - {3}) >= 2        # rows finished at different steps


def test_prefill_of_a_single_token_makes_no_call(qwen):
    guide = Guide(qwen, 1, 8)
    assert guide.prefill(torch.tensor([[5]])) == 0 and guide.length.tolist() == [0]
    n, at, calls = guide.verify(torch.tensor([[5, 1, 2]]), recorder()[0])
    assert (n.tolist(), calls) == ([2], 1)


def test_guide_refuses_diffusion_model_and_long_text(qwen):
    dream = load_model(os.path.join(GOLDEN, "dream-tiny"))
    with pytest.raises(ValueError, match="the guide must be a causal LM"):
        Guide(dream, 1, 16)
    with pytest.raises(ValueError, match="longer than the guide's 32768 positions"):
        Guide(qwen, 1, 40000)


def test_guide_pieces_reproduce_the_golden_guided_runs(qwen, golden):
    """A minimal driver of the pieces (Dream drafts, Guide.verify, accept_drafts, Guide.commit), in the
    official default mode, reproduces every golden prompt_frozen run, assisted and speculative: ids, Dream
    forwards, guide forwards and tokens committed per step. The decoding loop proper is fastdllm.generate's;
    this pins down the guide's call count: a prefix push, then one call per chunk up to the first chunk with
    a rejection. One golden count is off by one on purpose: in the verify-chunk-4 run one step accepts 5
    drafts (two chunks), and the official bookkeeping records only the last chunk's 4 fed tokens as cached,
    so its next step re-pushes one token the cache already holds (a spurious guide forward that also
    duplicates a token in its cache, without changing any verdict of this run). We do not reproduce that bug."""
    dream = load_model(os.path.join(GOLDEN, "dream-tiny"))
    mask, eos = golden["special_ids"]["mask"], golden["special_ids"]["eos"]
    runs = [r for r in golden["runs"] if r["family"] == "guided" and r["settings"]["cache_mode"] == "prompt_frozen"]
    assert len(runs) == 12
    for run in runs:
        st, acc = run["settings"], run["settings"]["acceptance"]
        speculative = st["method"] == "guided_speculative"
        accept = functools.partial(accept_drafts, rule=acc["rule"], k=acc.get("k", 5), ratio=acc.get("ratio", 0.95),
                                   threshold=acc.get("threshold", 0.1))
        prompt = torch.tensor(golden["prompts"][run["prompt"]])
        P, L = len(prompt), len(prompt) + st["gen_length"]
        x = torch.cat([prompt, torch.full((st["gen_length"],), mask)])
        kv, guide = KVCache.for_model(dream, 1, L), Guide(qwen, 1, L)
        nfe, calls, per = 0, guide.prefill(prompt[None]), []
        with torch.no_grad():
            while (x == mask).any():
                a = 0 if nfe == 0 else P           # step 0: the whole canvas; then the generation part
                logits = predictions(dream, x[None, a:], cache=kv, start=a)[0]     # aligned within the chunk
                logits[:, eos] += st.get("eos_bias", {}).get("dream", 0.0)
                nfe += 1
                first = int((x == mask).nonzero()[0])
                drafts = logits[first - a:].argmax(-1)
                n, at, c = guide.verify(torch.cat([x[:first], drafts])[None], accept, chunk=st["verify_chunk"])
                n, calls = int(n[0]), calls + c
                if speculative:                    # the accepted run, then the guide's own token
                    new = torch.cat([drafts[:n], at[0].argmax()[None]])[:len(drafts)]
                else:                              # the accepted run; a rejected first draft is committed anyway
                    new = drafts[:max(n, 1)]
                if (new == eos).any():
                    new = new[:int((new == eos).nonzero()[0]) + 1]
                x[first:first + len(new)] = new
                if new[-1] == eos:
                    x[x == mask] = eos
                guide.commit(torch.tensor([len(new)]), torch.tensor([not (x == mask).any()]))
                per.append(len(new))
        assert (x.tolist(), nfe, per) == (run["output"], run["nfe"], run["committed_per_step"]), run["name"]
        bug = 1 if run["name"] == "as_prompt_topk512_g64_vb4" else 0
        assert calls == run["ar_calls"] - bug, run["name"]


# ------------------------------------------------------------------------------------------ shared ids
def word_tokenizer(words: dict[int, str], specials=()) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({w: i for i, w in words.items()}, unk_token=words[0]))
    tok.add_special_tokens(list(specials))
    return tok


def test_check_guide_accepts_the_golden_pair_and_refuses_mismatches():
    dream = ModelConfig(family="dream", vocab_size=1024, mask_id=1023, eos_id=1000)
    guide = ModelConfig(family="qwen2", vocab_size=1024, mask_id=None, eos_id=1000, tie_embeddings=True)
    check_guide(dream, guide)
    # the mask is never written, so a guide may lack its row when it is the last id (the demo pair)
    check_guide(dream, ModelConfig(family="qwen2", vocab_size=1023, mask_id=None, eos_id=1000))
    with pytest.raises(ValueError, match="the guide has 1000 token ids but the diffusion model can write ids up to 1022"):
        check_guide(dream, ModelConfig(family="qwen2", vocab_size=1000, mask_id=None, eos_id=999))
    with pytest.raises(ValueError, match=r"end-of-text id 1000 is none of the guide's special ids \[7, 8\]"):
        check_guide(dream, ModelConfig(family="qwen2", vocab_size=1024, mask_id=None, eos_id=7, bos_id=8))
    # the real pair: Dream-7B ends with 151643, which Qwen2.5-1.5B-Instruct names as its bos (eos <|im_end|>)
    check_guide(ModelConfig(family="dream", vocab_size=152064, mask_id=151666, eos_id=151643),
                ModelConfig(family="qwen2", vocab_size=151936, mask_id=None, eos_id=151645, bos_id=151643))
    with pytest.raises(ValueError, match="the guide is a dream model, not a causal LM"):
        check_guide(dream, dream)
    with pytest.raises(ValueError, match="not a diffusion LM"):
        check_guide(guide, guide)


def test_check_guide_compares_tokens_when_given_tokenizers():
    """Real pairs: Dream-7B has 152064 rows, Qwen2.5-1.5B 151936, and the instruct guide's eos id is
    <|im_end|>; what must agree is the token behind every id the diffusion model can write."""
    words = {i: f"w{i}" for i in range(8)} | {5: "<eos>", 6: "<bos>", 7: "<mask>"}
    model_tok = word_tokenizer(words, ["<eos>", "<bos>", "<mask>"])
    dream = ModelConfig(family="dream", vocab_size=16, mask_id=7, eos_id=5)    # padding rows past the tokenizer
    guide = ModelConfig(family="qwen2", vocab_size=12, mask_id=None, eos_id=4)   # its own eos id differs
    guide_words = {i: w for i, w in words.items() if i < 6}                     # lacks <bos> and <mask>
    check_guide(dream, guide, model_tok, word_tokenizer(guide_words, ["<eos>"]))
    with pytest.raises(ValueError, match="token id 3 is 'w3' to the diffusion model but 'x3' to the guide"):
        check_guide(dream, guide, model_tok, word_tokenizer(guide_words | {3: "x3"}, ["<eos>"]))
    with pytest.raises(ValueError, match="end-of-text id 5 is '<eos>' to the diffusion model but 'w5'"):
        check_guide(dream, guide, model_tok, word_tokenizer(guide_words | {5: "w5"}))
    with pytest.raises(ValueError, match="token id 4 is 'w4' to the diffusion model but None"):   # not special
        check_guide(dream, guide, model_tok, word_tokenizer({i: w for i, w in guide_words.items() if i != 4}))
