"""
Prophet: early commit once the answer is settled (Li et al., arXiv 2508.19982; code pixeli99/Prophet, its loop read in
the fork duterscmy/Prophet generate_earlyexit.py). LLaDA decodes as usual (per block exactly its steps, each the
schedule's k most confident masks) with a suffix forced into the canvas. Before each commit, once the mean top-1 minus
top-2 raw logit gap over the 5 positions two after the suffix reaches 7.5 / 5.0 / 2.5 (progress = calls / all steps
< 0.33 / < 0.67 / else), every mask left takes this call's argmax and the answer ends. Official defaults (GSM8K,
LLaDA-8B-Instruct): gen 256, block 32, steps 256, cache none, " The answer is" at answer offsets 200-202 (here from
the canvas end: -56; the default fits the demo). LLaDA only, as the official eval: exact steps make every row make
every call, so progress is (at.n + 1) / steps. Contract parts used: propose= a sampler.LLaDA whose start_block writes
the suffix, exact_steps; stop= the same object: at.logits at the window and every mask left (cache none, or prefix:
past the window, no test), fills masks; select= the schedule; cli.run's `config` and `tokenizer`.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import sampler as S  # noqa: E402


class Prophet(S.LLaDA):       # the step rule (LLaDA with the suffix) and the stop rule (the gap test) share the steps
    def __init__(self, *, suffix_ids, suffix_at: int, steps_per_block: int, mask_id: int, taus=(7.5, 5.0, 2.5)):
        if suffix_at > -max(len(suffix_ids), 1):
            raise ValueError(f"prophet: --suffix-at {suffix_at} counts from the canvas end: pass one <= "
                             f"{-max(len(suffix_ids), 1)}")
        super().__init__(steps_per_block=steps_per_block, mask_id=mask_id)
        self.exact_steps, self.suffix_at, self.taus = steps_per_block, suffix_at, taus
        self.suffix = torch.tensor(suffix_ids, dtype=torch.long)

    def start_block(self, x, s: int, e: int):
        pos = x.shape[1] + self.suffix_at + torch.arange(len(self.suffix))   # written once: then they are no masks
        x[:, pos] = torch.where(x[:, pos] == self.mask_id, self.suffix.to(x.device), x[:, pos])
        super().start_block(x, s, e)

    def __call__(self, x, at, p):
        L, (a, b), w = x.shape[1], at.span or (-1, -1), x.shape[1] + self.suffix_at + len(self.suffix) + 1   # window
        if at.n == 0:
            low = at.s - L - (not len(self.suffix))     # at.s: the answer's start; no suffix: the window may start there
            if self.suffix_at < low:
                raise ValueError(f"prophet: --suffix-at {self.suffix_at} lies before the answer: use >= {low}")
            self.total = (L - at.s) // (at.e - at.s) * self.steps_per_block     # exact steps: every row, every call
        progress, lo = (at.n + 1) / self.total, min(w, at.s) if a <= w else at.s   # prefix past the window: no test
        logits = at.logits(lo, L)                        # a feed that stops short of L (dual) is refused there
        top2 = (logits[:, w - lo:w - lo + 5] if w >= lo else logits[:, :0]).topk(2, -1).values   # [w, w + 5), cut
        gap = (top2[..., 0] - top2[..., 1]).double().mean(-1)      # NaN without a window: never passes
        tau = self.taus[0 if progress < 0.33 else 1 if progress < 0.67 else 2]
        tail, fill = x[:, at.s:], S.argmax_except(logits[:, at.s - lo:], self.mask_id)
        x[:, at.s:] = torch.where((gap >= tau)[:, None] & (tail == self.mask_id), fill, tail)
        return (x[:, at.s:] != self.mask_id).all(-1)


def hooks(suffix, suffix_at, steps_per_block, cache, early, mid, late, config, tokenizer):
    if config.family != "llada" or cache not in ("none", "prefix"):   # it reads logits outside the block
        raise ValueError(f"prophet runs LLaDA (its official eval) with --cache none (official) or prefix: got a "
                         f"{config.family} model, --cache {cache}")
    ids = tokenizer.encode(" " + suffix, add_special_tokens=False).ids if suffix else []   # " The", " answer", ...
    rule = Prophet(suffix_ids=ids, suffix_at=suffix_at, steps_per_block=steps_per_block, mask_id=config.mask_id,
                   taus=(early, mid, late))
    return dict(propose=rule, stop=rule, select=S.Schedule(), cache=cache)


if __name__ == "__main__":   # python examples/prophet.py --model demo/llada-arith --gen-length 32 --block-length 8 --prompt "..."
    import cli
    cli.run(hooks, suffix=("The answer is", "text forced into the answer ('' for none)"),
            suffix_at=(-23, "where the suffix starts, counted from the canvas end"),
            steps_per_block=(8, "denoising steps per block, exactly (the schedule's k a step)"),
            cache=("none", "KV cache: none (official) or prefix (Prophet reads logits past the block)"),
            early=(7.5, "the top-2 logit gap that ends the answer while progress (calls / all steps) < 0.33"),
            mid=(5.0, "the gap while progress < 0.67"), late=(2.5, "the gap after"))
