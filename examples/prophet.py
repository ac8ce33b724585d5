"""
Prophet, early commit once the answer is settled (Li et al., "Diffusion Language Models Know the Answer Before
Decoding", arXiv 2508.19982; code pixeli99/Prophet, its loop read in the public fork duterscmy/Prophet:
generate_earlyexit.py, eval_llada.py). LLaDA decodes as usual (the schedule's k most confident masks a step, greedy)
with a suffix forced into the canvas ("The answer is"). Once the mean top-1 minus top-2 raw logit gap over the 5
answer positions two after the suffix reaches 7.5 / 5.0 / 2.5 (progress = calls / total steps below 0.33 / below
0.67 / else), every mask left takes this call's argmax. Official defaults (GSM8K, LLaDA-8B-Instruct): gen 256,
block 32, steps 256, no cache, the suffix at answer offsets 200-202 (window 204-208). Offsets count here from the
canvas end, one flag for any --gen-length (official: --suffix-at -56 at gen 256); the default fits the demo (gen 32:
offset 9, where it writes it). Contract: propose= a sampler.LLaDA whose start_block writes the suffix (masks only),
with exact_steps (a block takes its steps, as officially); stop= the same object: at.logits(lo, L) at the window and
every mask left (a feed covering them: cache none, or prefix, whose later steps skip the test once past the window),
at.s at at.n == 0; select= the schedule. A row's progress counts its own calls (those it makes alone).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import sampler as S  # noqa: E402
from cache import NoCache, PrefixCache  # noqa: E402


class Prophet(S.LLaDA):
    """The step rule (LLaDA with the suffix) and the stop rule (the gap test) in one object: they share the steps."""

    def __init__(self, *, suffix_ids, suffix_at: int, steps_per_block: int, mask_id: int, taus=(7.5, 5.0, 2.5)):
        if not suffix_at < 0 <= -suffix_at - len(suffix_ids):
            raise ValueError(f"prophet: --suffix-at {suffix_at} counts from the canvas end (-1 is its last position): "
                             f"the suffix's {len(suffix_ids)} token(s) need one <= {-max(len(suffix_ids), 1)}")
        super().__init__(steps_per_block=steps_per_block, mask_id=mask_id)
        self.exact_steps, self.suffix_at, self.taus = steps_per_block, suffix_at, torch.tensor(taus).double()
        self.suffix, self.canvas = torch.tensor(suffix_ids, dtype=torch.long), None

    def start_block(self, x, s: int, e: int):
        pos = x.shape[1] + self.suffix_at + torch.arange(len(self.suffix))   # written once: then they are no masks
        x[:, pos] = torch.where(x[:, pos] == self.mask_id, self.suffix.to(x.device), x[:, pos])
        self.canvas = x                                   # this generation's step rule: each block takes its steps
        super().start_block(x, s, e)

    def __call__(self, x, at, p):
        L, (a, b) = x.shape[1], at.span or (-1, -1)
        if b != L or at.i == 0 and a > 0:
            raise ValueError("prophet reads logits at the answer window and at every mask left: use cache 'none' "
                             "(official) or 'prefix'")
        if at.n == 0 and L + self.suffix_at < at.s:      # at.s: the answer's start, on the first call
            raise ValueError(f"prophet: --suffix-at {self.suffix_at} lies before the answer: pass one in "
                             f"[{at.s - L}, -1]")
        served = at.masked.any(-1) | (self.canvas is x)  # the calls a row makes alone (a block waits for no row)
        self.calls = served.double() if at.n == 0 else self.calls + served
        self.total = (L - at.s) // (at.e - at.s) * self.steps_per_block if at.n == 0 else self.total
        w = L + self.suffix_at + len(self.suffix) + 1    # the window [w, w + 5), cut at the end
        lo = min(w, at.s) if a + at.shift <= w else at.s  # prefix, past the window: no test
        logits = at.logits(lo, L)
        top2 = (logits[:, w - lo:w - lo + 5] if w >= lo else logits[:, :0]).topk(2, -1).values
        gap = (top2[..., 0] - top2[..., 1]).double().mean(-1)      # NaN without a window: never passes
        progress, taus = self.calls / self.total, self.taus.to(x.device)
        tau = torch.where(progress < 0.33, taus[0], torch.where(progress < 0.67, taus[1], taus[2]))
        tail, fill = x[:, at.s:], S.argmax_except(logits[:, at.s - lo:], self.mask_id)
        x[:, at.s:] = torch.where((gap >= tau)[:, None] & (tail == self.mask_id), fill, tail)
        return (x[:, at.s:] != self.mask_id).all(-1)


def hooks(suffix, suffix_at, steps_per_block, cache, early, mid, late):
    """The command line's hooks. A fork's builder sees its own flags only: the suffix's ids and the mask id come
    from the --model folder, read here."""
    import cli
    from chat import load_tokenizer
    from model import read_config, resolve_model_dir
    if cache not in ("none", "prefix"):
        raise ValueError(f"--cache {cache}: prophet reads logits outside the block: use none (official) or prefix")
    folder = resolve_model_dir(cli.own_flags(sys.argv[1:], model="GSAI-ML/LLaDA-8B-Instruct")[0]["model"])
    ids = load_tokenizer(folder).encode(" " + suffix, add_special_tokens=False).ids if suffix else []
    rule = Prophet(suffix_ids=ids, suffix_at=suffix_at, steps_per_block=steps_per_block,
                   mask_id=read_config(folder).mask_id, taus=(early, mid, late))
    return dict(propose=rule, stop=rule, select=S.Schedule(), cache=NoCache() if cache == "none" else PrefixCache())


if __name__ == "__main__":   # python examples/prophet.py --model demo/llada-arith --gen-length 32 --block-length 8 --prompt "..."
    import cli
    cli.run(hooks, suffix="The answer is", suffix_at=-23, steps_per_block=8, cache="none", early=7.5, mid=5.0, late=2.5)
