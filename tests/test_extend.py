"""The fork test: one part of each of generate()'s four hooks (cache=, select=, stop=, propose=), defined here and
nowhere else, on both families, without editing a project file: what a fork of this project writes to add its
method. Each is checked by value against a reference written here, and the hooks' contracts are checked at the
boundary (a part that breaks one fails in one line naming the hook)."""
import pytest
import torch
import torch.nn.functional as F

from cache import CachePolicy, KVCache
from fastdllm import generate, pad_prompts
from reference import reference_decode
from reference import predictions
from sampler import LLaDA, NEG_INF, Proposal, StepRule, Threshold, argmax_except

PROMPTS = {"llada": torch.tensor([[815, 723, 294, 53, 204, 372, 664, 1017, 655, 689, 279, 233]]),
           "dream": torch.tensor([[775, 171, 806, 365, 316, 564, 432, 625, 575, 529]])}
KW = dict(gen_length=32, block_length=8, steps=32)
OWN = dict(gen_length=32, block_length=8)           # a fork's own step rule takes no steps=


class RefreshEvery(CachePolicy):
    """(a) Cache policy: refresh the whole canvas every k calls; in between, feed the block alone (DualCache-like).
    For Dream (shifted logits) the plan widens a block's first span by one, to the position it is predicted from."""

    def __init__(self, k: int):
        self.k = k

    def span(self, at):
        return (0, at.x.shape[1]) if at.n % self.k == 0 else (at.s, at.e)


class Margin:
    """(b) Selection rule: commit every open position whose top-1 minus top-2 probability is at least m, and at
    least the position with the largest margin (so every step commits one token and decoding terminates)."""

    def __init__(self, m: float):
        self.m = m

    def __call__(self, p, at):
        top2 = p.logits.float().softmax(-1).topk(2, dim=-1).values                 # (B, n, 2) at at.cols
        margin = torch.full(p.open.shape, NEG_INF, device=p.open.device).index_copy_(1, at.cols, top2[..., 0] - top2[..., 1])
        return Threshold(self.m)(p._replace(conf=margin.masked_fill(~p.open, NEG_INF)), at)


class ConfidentBlock:
    """(c) Stop rule: once the mean confidence of a row's open positions reaches x, its block ends: the block's
    remaining masks take this step's proposals (the model's current guesses), so the next step starts the next
    block. It ends no answer (all False); an answer still ends when no mask is left."""

    def __init__(self, x: float, mask_id: int):
        self.x, self.mask_id = x, mask_id

    def __call__(self, canvas, at, p):
        mean = p.conf.masked_fill(~p.open, 0).sum(-1) / p.open.sum(-1).clamp(min=1)
        block = canvas[:, at.s:at.e]
        canvas[:, at.s:at.e] = torch.where((block == self.mask_id) & (mean >= self.x)[:, None], p.x0, block)
        return torch.zeros(canvas.shape[0], dtype=torch.bool, device=canvas.device)


class LeftToRight(StepRule):
    """(d) Step rule: propose only the leftmost masked position, with the family's argmax there: autoregressive
    decoding on a diffusion model. It exercises the protocol: the open positions are the rule's own choice (a
    subset of at.masked), the logits come at at.cols, k = 1; any selection rule then commits exactly that token."""

    def __init__(self, mask_id: int):
        self.mask_id = mask_id

    def propose(self, logits, at):
        x0 = torch.zeros_like(at.masked, dtype=torch.long).index_copy_(1, at.cols, argmax_except(logits, self.mask_id))
        first = at.masked & (at.masked.cumsum(-1) == 1)                      # (B, N) each row's leftmost mask
        return Proposal(x0, torch.zeros(first.shape).masked_fill(~first, NEG_INF), first, first.sum(-1), logits)


@pytest.fixture
def model(request, llada, dream):
    return {"llada": llada, "dream": dream}[request.param]


FAMILIES = pytest.mark.parametrize("model,family", [("llada", "llada"), ("dream", "dream")], indirect=["model"])


@torch.inference_mode()
def masked(model, prompt):
    return F.pad(prompt, (0, KW["gen_length"]), value=model.config.mask_id)


@FAMILIES
def test_refresh_every_step_is_the_uncached_decode(model, family):
    prompt, tau = PROMPTS[family], (None if family == "llada" else 0.9)
    ours, st = generate(model, prompt, cache=RefreshEvery(1), threshold=tau, **KW)
    naive, st0 = generate(model, prompt, cache="none", threshold=tau, **KW)
    assert torch.equal(ours, naive) and st["nfe"] == st0["nfe"]
    assert torch.equal(ours, reference_decode(model, prompt, 32, 8, tau)[0])
    assert st["fed"] == [ours.shape[1]] * st["nfe"]


@FAMILIES
def test_refresh_every_k_steps_feeds_what_it_says(model, family):
    """Refresh calls feed the canvas, the others the block; for Dream a block's first step one more position."""
    canvases = []
    out, st = generate(model, PROMPTS[family], cache=RefreshEvery(4), threshold=0.9, on_step=lambda x, s: canvases.append(x.clone()), **KW)
    L, shift = out.shape[1], int(family == "dream")
    before = [masked(model, PROMPTS[family])] + canvases[:-1]
    first = [bool((x[0, P:P + 8] == model.config.mask_id).all()) for x in before
             for P in [next(p for p in range(12 if family == "llada" else 10, L, 8) if (x[0, p:p + 8] == model.config.mask_id).any())]]
    assert not (out == model.config.mask_id).any()
    assert st["fed"] == [L if n % 4 == 0 else 8 + shift * first[n] for n in range(st["nfe"])]


@torch.inference_mode()
def test_dream_block_start_reads_the_hidden_state_before_it(dream):
    """The trap RefreshEvery(2) fell into on Dream: a block's first step that is not a refresh fed [s, e), and
    Dream's first token of the block (predicted from hidden state s - 1) was read from hidden state s. Written
    here: each block's first token is the argmax of the call that fed [s - 1, e) against the cache of the
    refresh before it (or of the full forward, when the block starts on a refresh)."""
    prompt, mask_id, canvases = PROMPTS["dream"], dream.config.mask_id, []
    kw = dict(KW, steps=20)                   # 5 steps a block: blocks 2 and 4 start on a cached (odd) call
    generate(dream, prompt, cache=RefreshEvery(2), on_step=lambda x, s: canvases.append(x.clone()), **kw)
    before, L, checked = [masked(dream, prompt)] + canvases[:-1], prompt.shape[1] + 32, 0
    for n, x in enumerate(before):
        s = next(p for p in range(prompt.shape[1], L, 8) if (x[0, p:p + 8] == mask_id).any())
        if not (x[0, s:s + 8] == mask_id).all():
            continue                                                   # not a block's first step
        if n % 2 == 0:
            logits = dream(x)[0, s - 1]                               # p is predicted from p - 1
        else:
            kv = KVCache.for_model(dream, 1, L)
            dream(before[n - 1], cache=kv, start=0)                    # the refresh of call n - 1
            logits = dream(x[:, s - 1:s + 8], cache=kv, start=s - 1)[0, 0]
        assert canvases[n][0, s] == argmax_except(logits, mask_id), (n, s)
        checked += n % 2
    assert checked == 2                                                # blocks did start on cached calls


@FAMILIES
def test_margin_rule_terminates_and_above_one_commits_one_per_step(model, family):
    out, st = generate(model, PROMPTS[family], select=Margin(0.05), **KW)
    assert not (out == model.config.mask_id).any() and sum(st["committed"]) == 32
    strict, st1 = generate(model, PROMPTS[family], select=Margin(1.5), **KW)      # a margin is at most 1
    assert not (strict == model.config.mask_id).any()
    assert st1["committed"] == [1] * 32 and st1["nfe"] == 32
    assert st["nfe"] < st1["nfe"]                  # a reachable margin commits several tokens in some steps


@FAMILIES
def test_stop_rule_ends_blocks_with_their_proposals(model, family):
    """x above any confidence changes nothing; x = 0 ends every block after its first step, the block holding
    that step's argmax proposals (written here from a plain forward of the canvas the block started from)."""
    prompt, mask_id = PROMPTS[family], model.config.mask_id
    same, _ = generate(model, prompt, stop=ConfidentBlock(2.0, mask_id), threshold=0.9, **KW)
    assert torch.equal(same, generate(model, prompt, threshold=0.9, **KW)[0])
    out, st = generate(model, prompt, stop=ConfidentBlock(0.0, mask_id), threshold=0.9, **KW)
    assert st["nfe"] == 4 and sum(st["committed"]) + sum(st["filled"]) == 32 and min(st["filled"]) > 0
    x = masked(model, prompt)
    for s in range(prompt.shape[1], x.shape[1], 8):
        with torch.inference_mode():
            x[:, s:s + 8] = argmax_except(predictions(model, x)[:, s:s + 8], mask_id)
    assert torch.equal(out, x)


@FAMILIES
def test_step_rule_left_to_right_is_autoregressive_decoding(model, family):
    prompt, mask_id = PROMPTS[family], model.config.mask_id
    out, st = generate(model, prompt, propose=LeftToRight(mask_id), **OWN)
    x = masked(model, prompt)
    for p in range(prompt.shape[1], x.shape[1]):                      # the reference: one position at a time
        with torch.inference_mode():
            x[0, p] = argmax_except(predictions(model, x)[0, p], mask_id)
    assert torch.equal(out, x) and st["committed"] == [1] * 32
    cached, _ = generate(model, prompt, propose=LeftToRight(mask_id), cache="dual", select=Margin(0.5), **OWN)
    assert not (cached == mask_id).any()


@FAMILIES
def test_all_four_hooks_on_a_padded_batch_equal_each_row_alone(model, family):
    rows = [PROMPTS[family][0].tolist(), PROMPTS[family][0, 3:].flip(0).tolist()]
    ids, am = pad_prompts(rows, model.config.pad_id or 0)
    kw = dict(cache=RefreshEvery(3), select=Margin(0.2), stop=ConfidentBlock(0.6, model.config.mask_id),
              **(dict(propose=LeftToRight(model.config.mask_id), **OWN) if family == "llada" else KW))
    batch, _ = generate(model, ids, attention_mask=am, **kw)
    for i, row in enumerate(rows):
        alone, _ = generate(model, torch.tensor([row]), **kw)
        assert torch.equal(batch[i, -alone.shape[1]:], alone[0])


# ---------------------------------------------------------------------------------------- contracts
class Wrong(CachePolicy):
    def __init__(self, span):
        self.fixed = span

    def span(self, at):
        return self.fixed(at)


class HasSpan:                  # has span() but is not a CachePolicy: it must not silently run as another policy
    def span(self, at):
        return 0, at.x.shape[1]


BAD_HOOKS = {
    "select returns None": (dict(select=lambda p, at: None), TypeError, r"select= <lambda> returned None: .*\(2, 8\) bool"),
    "select returns floats": (dict(select=lambda p, at: p.conf), TypeError, r"select= .* returned a \(2, 8\) torch.float64 tensor"),
    "select returns one row for two": (dict(select=lambda p, at: p.open[:1]), TypeError, r"returned a \(1, 8\) torch.bool tensor: .*one row per batch row"),
    "select a committed position": (dict(select=lambda p, at: torch.ones_like(p.open) if at.i else Margin(2.0)(p, at)), ValueError,
                                    r"select= <lambda> chose positions outside the proposal's open positions .*overwritten"),
    "cache with span, not a policy": (dict(cache=HasSpan()), TypeError, r"cache must be a mode name .* or a cache.CachePolicy"),
    "span outside the canvas": (dict(cache=Wrong(lambda at: (0, 99) if at.n else (0, at.x.shape[1]))), ValueError,
                                r"cache= Wrong.span\(\) returned \(0, 99\) at step \d of block .* inside the canvas \[0, 44\)"),
    "span not covering the block": (dict(cache=Wrong(lambda at: (at.s + 2, at.e) if at.n else (0, at.x.shape[1]))),
                                    ValueError, r"must cover the open positions"),
    "first call not full": (dict(cache=Wrong(lambda at: (at.s, at.e))), ValueError, r"at the first call: it must feed the whole canvas"),
    "span not a pair": (dict(cache=Wrong(lambda at: 3)), TypeError, r"span\(\) returned 3: a span is a pair of ints"),
    "a set of floats": (dict(cache=Wrong(lambda at: torch.arange(at.x.shape[1]) * 1.0)), TypeError,
                        r"span\(\) returned a \(44,\) torch.float32 tensor: a set of positions is a 1-D long tensor"),
    "a set past the canvas": (dict(cache=Wrong(lambda at: torch.arange(at.x.shape[1] + 1))), TypeError,
                              r"a set of positions is a 1-D long tensor of 1 to 44 canvas positions"),
    "a set not sorted": (dict(cache=Wrong(lambda at: torch.arange(at.x.shape[1]).flip(0))), ValueError,
                         r"returned positions at step 0 of block \[12, 20\) that are not sorted and unique"),
    "a set at the first call": (dict(cache=Wrong(lambda at: torch.arange(at.s, at.e))), ValueError,
                                r"fed 8 positions at the first call: it must feed the whole canvas \(44\)"),
    "a set without the block": (dict(cache=Wrong(lambda at: torch.arange(at.x.shape[1] if at.n == 0 else at.s))),
                                ValueError, r"fed positions at step 1 of block \[12, 20\) without every open position"),
    "slots of one row for two": (dict(cache=type("Slots", (CachePolicy,), {"slots": lambda self, at, fed: fed[None]})()),
                                 TypeError, r"cache= Slots.slots\(\) returned a \(1, 44\) torch.int64 tensor: per-row slots are a \(2, 44\)"),
    "keys of the wrong shape": (dict(cache=type("Keys", (CachePolicy,), {"keys": lambda self, at: at.x[0] > 0})()),
                                TypeError, r"cache= Keys.keys\(\) returned a \(44,\) torch.bool tensor: a key mask is a \(2, 44\) bool"),
    "propose an object": (dict(propose=object()), TypeError, r"propose must be a step rule with .propose"),
    "propose opens committed": (dict(propose=type("Open", (LeftToRight,), {"propose": lambda self, logits, at: LeftToRight.propose(self, logits, at)._replace(open=torch.ones_like(at.masked))})(1000)),
                                ValueError, r"propose= Open.propose\(\) opened positions that are not masks"),
    "propose wrong shape": (dict(propose=type("Short", (LeftToRight,), {"propose": lambda self, logits, at: LeftToRight.propose(self, logits, at)._replace(k=torch.ones(1))})(1000)),
                            TypeError, r"propose= Short.propose\(\) returned k = a \(1,\) torch.float32 tensor: .*shape \(2,\)"),
    "stop returns a bool": (dict(stop=lambda x, at, p: False), TypeError, r"stop= <lambda> returned False: a stop rule returns a \(2,\) bool"),
    "stop and stop_at_eos": (dict(stop=lambda x, at, p: None, stop_at_eos=True), ValueError, r"pass stop or stop_at_eos, not both"),
    # The class where an instance is meant: it was named "type" (select=, propose=) or "not a cache policy".
    "select a class": (dict(select=Margin), TypeError,
                       r"^select= Margin is a class: pass an instance, select=Margin\(\.\.\.\)$"),
    "propose a class": (dict(propose=LeftToRight), TypeError, r"^propose= LeftToRight is a class: pass an instance"),
    "cache a class": (dict(cache=RefreshEvery), TypeError, r"^cache= RefreshEvery is a class: pass an instance"),
}


@pytest.mark.parametrize("case", BAD_HOOKS)
def test_a_broken_hook_fails_in_one_line_naming_it(llada, case):
    kw, error, pattern = BAD_HOOKS[case]
    prompt = torch.cat([PROMPTS["llada"]] * 2)
    with pytest.raises(error, match=pattern) as e:
        generate(llada, prompt, **{**(OWN if "propose" in kw else KW), **kw})
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------- no silent fork
# Each case below once ran to the end and returned a wrong answer without a word; now it is one line naming the
# hook at fault (or, where the behaviour is right, it is stated in the README's hooks table and checked by value).
class Overwrites(LeftToRight):
    """A step rule that writes into the canvas it was handed (it may not write it at all)."""

    def propose(self, logits, at):
        at.x[:, 0] = 7
        return super().propose(logits, at)


def ends_everything(x, at, p):                  # ends every row at once, leaving its masks in the answer
    return torch.ones(x.shape[0], dtype=torch.bool)


def rewrites_prompt(x, at, p):                  # a stop rule that edits the prompt
    x[:, 0] = 7
    return torch.zeros(x.shape[0], dtype=torch.bool)


SILENT = {
    "stop ends a row with masks": (dict(stop=ends_everything), ValueError,
                                   r"stop= ends_everything ended a row that still holds masks at step 1"),
    "stop overwrites the prompt": (dict(stop=rewrites_prompt), ValueError,
                                   r"stop= rewrites_prompt changed a token that was not a mask .* at step 1"),
    "propose writes the canvas": (dict(propose=Overwrites(1000)), ValueError,
                                  r"^propose= Overwrites changed a token that was not a mask"),
    "select with a wrong signature": (dict(select=lambda p, cand, k: p.open), TypeError,
                                      r"select= <lambda> takes \(p, cand, k\): a selection rule is called as rule\(proposal, at\)"),
    "stop with a wrong signature": (dict(stop=lambda x, at: None), TypeError,
                                    r"stop= <lambda> takes \(x, at\): a stop rule is called as rule\(x, at, proposal\)"),
    "propose with a wrong signature": (dict(propose=type("One", (LeftToRight,), {"propose": lambda self, logits: None})(1000)), TypeError,
                                       r"propose= One.propose takes \(logits\): a step rule's propose is called as propose\(logits, at\)"),
    "span with a wrong signature": (dict(cache=type("Spans", (CachePolicy,), {"span": lambda self, at, i: (0, 1)})()), TypeError,
                                    r"cache= Spans.span takes \(at, i\): a cache policy's span is called as span\(at\)"),
    "on_step not callable": (dict(on_step="print"), TypeError, r"on_step must be a callable on_step\(x, stats\)"),
    "on_step with a wrong signature": (dict(on_step=lambda x: None), TypeError, r"on_step= <lambda> takes \(x\)"),
    "select commits nothing": (dict(select=lambda p, at: torch.zeros_like(p.open)), ValueError,
                               r"select= <lambda> committed nothing: the block \[12, 20\) made no progress"),
    "propose opens nothing": (dict(propose=type("Shy", (LeftToRight,), {"propose": lambda self, logits, at: LeftToRight.propose(
        self, logits, at)._replace(open=torch.zeros_like(at.masked))})(1000)), ValueError,
                              r"propose= Shy.propose\(\) opened no position: the block \[12, 20\) made no progress"),
    "propose with temperature": (dict(propose=LeftToRight(1000), temperature=1.0),
                                 ValueError, r"propose= LeftToRight makes its own proposals: temperature set"),
    "propose with remasking": (dict(propose=LeftToRight(1000), remasking="random"),
                               ValueError, r"propose= LeftToRight makes its own proposals: remasking"),
    "propose with steps": (dict(propose=LeftToRight(1000), steps=32), ValueError, r"propose= LeftToRight .*: steps"),
    "propose with a generator": (dict(propose=LeftToRight(1000), generator=torch.Generator()), ValueError,
                                 r"propose= LeftToRight .*: generator"),
}


@pytest.mark.parametrize("case", SILENT)
def test_a_silent_fork_is_refused_in_one_line(llada, case):
    kw, error, pattern = SILENT[case]
    with pytest.raises(error, match=pattern) as e:
        generate(llada, PROMPTS["llada"], **{**(OWN if "propose" in kw else KW), **kw})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("error", [TypeError, RuntimeError, AttributeError])
def test_a_hook_that_raises_raises_its_own_error(llada, error):
    """A selection rule that raises on its first call was reported as "select= ... returned None" (the loop caught
    the error to name the hook, and hid it): its own error comes through, as it would from any Python call."""
    def rule(p, at):
        raise error("the rule's own message")
    with pytest.raises(error, match="^the rule's own message$"):
        generate(llada, PROMPTS["llada"], select=rule, **KW)


def fill_outside(fill):
    """A stop rule that ends the first row once its first block is decoded, filling its masks with `fill`."""
    def ends_row_0(x, at, p):
        done = ~(x[:, at.s:at.e] == at.mask_id).any(-1) & (torch.arange(x.shape[0]) == 0)
        x.masked_fill_(done[:, None] & (x == at.mask_id), fill)
        return done
    return ends_row_0


@pytest.mark.parametrize("fill", [5000, -1])
def test_a_stop_rule_that_fills_ids_outside_the_vocabulary_is_one_line(llada, fill):
    """Filling an ended row with an id the model does not have (the vocabulary is 1024): alone it was silent (the
    ids came back), in a padded batch the next call failed with an IndexError in the embedding. Refused at the step
    it happens, naming the hook."""
    pattern = r"^stop= ends_row_0 wrote a token id outside the vocabulary \[0, 1024\) at step \d+: a stop rule fills"
    rows = [PROMPTS["llada"][0].tolist(), PROMPTS["llada"][0, 5:].tolist()]
    ids, am = pad_prompts(rows, 0)
    for prompt, mask in ((PROMPTS["llada"], None), (ids, am)):
        with pytest.raises(ValueError, match=pattern) as e:
            generate(llada, prompt, attention_mask=mask, stop=fill_outside(fill), **KW)
        assert "\n" not in str(e.value)


@torch.inference_mode()
def test_dream_selection_is_called_at_a_blocks_first_step_with_its_first_position_open(dream):
    """Fast-dLLM's Dream block sampler decodes a block's first position at the block's first step, whatever its
    confidence (docs/official.md 6.2): the step rule opens that position alone, and a fork's selection rule is
    called there too (README hooks table); it is not wrapped, so its errors name it."""
    seen = []

    def spy(p, at):
        seen.append((at.i, p.open.clone()))
        return Threshold(0.9)(p, at)
    ours, _ = generate(dream, PROMPTS["dream"], select=spy, **KW)
    assert torch.equal(ours, generate(dream, PROMPTS["dream"], threshold=0.9, **KW)[0])
    first = [open_ for i, open_ in seen if i == 0]
    assert len(first) == 4 and all(o.tolist() == [[True] + [False] * 7] for o in first)
    with pytest.raises(TypeError, match=r"^select= <lambda> returned None"):
        generate(dream, PROMPTS["dream"], select=lambda p, at: None, **KW)


def test_dream_step_rule_passed_as_propose_is_the_default(dream):
    """propose=sampler.Dream(...) with the settings generate() would pick reproduces the default decode, the
    first-token rule included (it lives in the step rule, not in a wrapper the plan adds)."""
    from sampler import Dream
    mask_id, kw = dream.config.mask_id, dict(gen_length=32, block_length=8)
    for rule, tau in ((Dream(steps=32, n_blocks=4, block_length=8, alg="maskgit_plus", mask_id=mask_id,
                             schedule=False), 0.9),
                      (Dream(steps=32, n_blocks=4, block_length=8, mask_id=mask_id), None)):
        assert torch.equal(generate(dream, PROMPTS["dream"], propose=rule, threshold=tau, **kw)[0],
                           generate(dream, PROMPTS["dream"], threshold=tau, **kw)[0])


@pytest.mark.parametrize("spb", [2, 8])
def test_calls_saved_counts_the_step_rules_own_schedule(llada, spb):
    """calls_saved is the remaining blocks times the calls a block takes: a fork's LLaDA rule with its own steps per
    block (2 here, where steps= would say 8) saves 2 calls a block; decoding without early stop takes them."""
    from test_flashdlm import eos_bias
    rule = lambda: LLaDA(steps_per_block=spb, mask_id=1000)                      # noqa: E731
    kw = dict(gen_length=64, block_length=8)
    with eos_bias(llada, 28.0):
        short, st = generate(llada, PROMPTS["llada"], propose=rule(), stop_at_eos=True, **kw)
        full, st_full = generate(llada, PROMPTS["llada"], propose=rule(), **kw)
    assert st["calls_saved"] > 0 and st["calls_saved"] % spb == 0
    assert st["nfe"] + st["calls_saved"] == st_full["nfe"] == 8 * spb


@pytest.fixture(scope="module")
def demo():
    from tokenizers import Tokenizer
    from conftest import ROOT
    from model import load_model
    path = f"{ROOT}/demo/llada-arith"
    return load_model(path, device="cpu", dtype=torch.float32), Tokenizer.from_file(f"{path}/tokenizer.json")


def test_threshold_one_is_one_token_per_step_as_in_float64(demo):
    """The demo model is confident: many of its probabilities are 1 - r with r < 6e-8, which a float32 softmax
    rounds to exactly 1.0 (threshold 1.0 then commits several tokens a call: 15 calls for 32 tokens). The official
    float64 softmax keeps them below 1, so threshold 1.0 is one token per step."""
    model, tok = demo
    ids = torch.tensor([tok.encode("Tom has 23 apples and buys 45 more. How many apples does he have?",
                                   add_special_tokens=False).ids])
    out, st = generate(model, ids, gen_length=32, block_length=8, threshold=1.0, cache="dual")
    assert st["nfe"] == 32 and st["committed"] == [1] * 32
    assert torch.equal(out, generate(model, ids, gen_length=32, block_length=8, cache="dual")[0])


def test_a_confidence_within_1e7_of_the_threshold_is_decided_as_in_float64(demo):
    """LLaDA's confidence is the official float64 softmax's to 5e-8 (a float32 softmax is off by up to ~1e-6), on the
    demo's real steps: a threshold 1e-7 above or below each confidence decides as float64 does."""
    model, tok = demo
    ids = torch.tensor([tok.encode("A box has 50 books. Sam takes 12. How many books are left?",
                                   add_special_tokens=False).ids])
    steps = []

    def spy(p, at):
        steps.append((p, at))
        return Threshold(0.9)(p, at)
    generate(model, ids, gen_length=32, block_length=8, select=spy)
    checked = 0
    for p, at in steps:
        x0, ours = p.x0[:, at.cols], p.conf[:, at.cols]                                           # (1, n)
        official = torch.softmax(p.logits.double(), -1).gather(-1, x0[..., None]).squeeze(-1)   # the official conf
        assert (ours - official).abs().max() < 5e-8
        for delta in (1e-7, -1e-7):          # what Threshold compares: conf >= tau
            tau = official + delta
            assert torch.equal(ours >= tau, official >= tau)
            checked += tau.numel()
    assert checked >= 60          # every position of every step, both sides


def test_only_a_forks_hooks_are_checked_at_the_boundary():
    """make_plan wraps a fork's propose, select and stop once, so that their answers' shapes are checked as they come
    back; the built-in hooks are called as they are (a fork subclassing one is still a fork's, and named as written)."""
    import checks
    from sampler import NoStop
    from cache import DualCache
    rule, select, stop, dual, sees = LLaDA(steps_per_block=1, mask_id=5), Threshold(0.9), NoStop(), DualCache(), len
    assert checks.guarded(rule, select, stop, dual, sees, False) == (rule.propose, select, stop, dual)

    class Mine(LLaDA):
        pass

    class MyDual(DualCache):
        pass

    mine = Mine(steps_per_block=1, mask_id=5)
    propose, take, ended, theirs = checks.guarded(mine, lambda p, at: p.open, stop, MyDual(), sees, False)
    assert isinstance(propose, checks.Checked) and isinstance(take, checks.Checked) and ended is stop
    assert (checks.name(propose), checks.name(take)) == ("Mine", "<lambda>")
    assert isinstance(theirs, checks.CheckedPolicy) and checks.name(theirs) == "MyDual"


def test_a_plan_names_the_parts_it_runs(llada):
    """print(plan): the parts make_plan chose, by name (a fork's by its own name, though the loop calls it checked)."""
    from fastdllm import make_plan
    prompt, kw = torch.tensor([[815, 723, 294, 53, 204]]), dict(gen_length=16, block_length=8)
    plan, _ = make_plan(llada, prompt, dict(kw, cache="dual", threshold=0.9), None, None)
    assert str(plan).startswith("cache DualCache, step rule LLaDA, select Threshold, stop NoStop, layers "
                                "Transformer.hidden, KV cache True, shift 0, blocks [(5, 13), (13, 21)]")
    plan, _ = make_plan(llada, prompt, dict(kw, select=lambda p, at: p.open, stop_at_eos=True), None, None)
    assert "select <lambda>, stop EndOfText" in str(plan)
