"""A naive decode, written apart from fastdllm.generate(): the oracle the fast paths are tested against.

No cache, no batching tricks, no shared code with the decoding loop: every step is one plain forward of the
whole canvas. Block by block, each step commits the most confident masked token of the block and, with a
threshold, every masked token whose confidence reaches it (Fast-dLLM 3.3, Theorem 1). Confidence is the
probability of the argmax token (never the mask token itself), in the precision each official sampler uses:
float64 for LLaDA, float32 for Dream. Fast-dLLM's Dream sampler decodes the first token of a block at the
block's first step, whatever its confidence; the first step of a block does that and nothing else.
"""
import torch


@torch.inference_mode()
def reference_decode(model, prompt, gen_length: int, block_length: int, threshold: float | None = None):
    """-> (canvas (B, P + gen_length), model calls). One token per step when threshold is None."""
    cfg = model.config
    B, P = prompt.shape
    x = torch.cat([prompt, torch.full((B, gen_length), cfg.mask_id, dtype=torch.long)], dim=1)
    calls = 0
    for s in range(P, P + gen_length, block_length):
        e, first = s + block_length, True
        while (x[:, s:e] == cfg.mask_id).any():
            logits = model(x)[:, s:e]                                   # (B, N, V): the block's predictions
            calls += 1
            probs = logits.double().softmax(-1) if cfg.family == "llada" else logits.float().softmax(-1)
            probs[..., cfg.mask_id] = -1                                # never propose the mask itself
            conf, token = probs.max(-1)                                 # (B, N)
            masked = x[:, s:e] == cfg.mask_id
            conf = conf.masked_fill(~masked, float("-inf"))
            if cfg.family == "dream" and first:
                take = torch.zeros_like(masked)
                take[:, 0] = True
            else:
                take = torch.zeros_like(masked).scatter_(1, conf.argmax(-1, keepdim=True), True)
                if threshold is not None:
                    take |= conf >= threshold
            take &= masked
            x[:, s:e] = torch.where(take, token, x[:, s:e])
            first = False
    return x, calls
