"""
tools/gemma_checkpoint.py: google/diffusiongemma-26B-A4B-it's on-disk format at tiny sizes, and its sizes at real
size, for tools/checkpoint.py --release / --sizes (docs/diffusiongemma.md gives each fact's source).

The format is what the official classes save (huggingface/transformers v5.23.0, src/transformers/models/
diffusion_gemma/): config.json with the text model under text_config and the release's own spelling of the full
layers (global_head_dim, num_global_key_value_heads; no per_layer_config), generation_config.json with the release's
decode settings, the weights the encoder and decoder share once under the decoder's names, each layer's experts
stacked (gate_up_proj, down_proj), the encoder's own layer scalars, and a vision tower (text-only loading skips it).
Not seen, so not claimed: the release's shard count, its tokenizer and chat template files. The tokenizer written
here is word-level with Gemma's special tokens at their ids, and the template is Gemma 4's turn format as chat.py
writes it out.
"""
import json
import os

import torch
from safetensors.torch import save_file

REPO = "google/diffusiongemma-26B-A4B-it"
LAYERS_REAL = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30)]
ROPE = {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}
# The release's text_config at real size: 30 layers (5 sliding : 1 full), 2816 wide, 16 query heads; sliding layers
# 8 key/value heads of 256, window 1024; full layers 2 of 512; a dense MLP of 2112 beside 128 experts of 704, top-8.
TEXT_REAL = dict(attention_bias=False, attention_dropout=0.0, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                 final_logit_softcapping=30.0, global_head_dim=512, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                 hidden_size=2816, intermediate_size=2112, layer_types=LAYERS_REAL, max_position_embeddings=262144,
                 model_type="diffusion_gemma_text", moe_intermediate_size=704, num_attention_heads=16, num_experts=128,
                 num_global_key_value_heads=2, num_hidden_layers=30, num_key_value_heads=8, rms_norm_eps=1e-06,
                 rope_parameters=ROPE, sliding_window=1024, tie_word_embeddings=True, top_k_experts=8,
                 use_bidirectional_attention="vision", vocab_size=262144)
# The tiny size the tests run: the same switches, 6 layers (5 sliding : 1 full).
TEXT_TINY = dict(TEXT_REAL, global_head_dim=32, head_dim=16, hidden_size=64, intermediate_size=96,
                 layer_types=LAYERS_REAL[:5] + ["full_attention"], max_position_embeddings=4096, moe_intermediate_size=32,
                 num_attention_heads=4, num_experts=4, num_global_key_value_heads=1, num_hidden_layers=6,
                 num_key_value_heads=2, sliding_window=12, top_k_experts=2, vocab_size=1024)
VISION_TINY = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=3,
                   position_embedding_size=16, rms_norm_eps=1e-06)
GENERATION = {"max_denoising_steps": 48, "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig",
              "entropy_bound": 0.1}, "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1,
              "confidence_threshold": 0.005, "max_new_tokens": 256, "eos_token_id": [1, 106, 50], "pad_token_id": 0,
              "transformers_version": "5.8.0.dev0"}
SPECIAL = {0: "<pad>", 1: "<eos>", 2: "<bos>", 105: "<|turn>", 106: "<turn|>"}      # Gemma's ids
TEMPLATE = ("{{- bos_token -}}{%- for message in messages -%}{%- set role = 'model' if message['role'] == 'assistant' "
            "else message['role'] -%}{{- '<|turn>' + role + '\\n' + message['content'] | trim + '<turn|>\\n' -}}"
            "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}")


def config(text: dict) -> dict:
    return {"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma", "canvas_length": 256,
            "boi_token_id": 255999, "eoi_token_id": 258882, "image_token_id": 258880, "eos_token_id": [1, 106, 50],
            "tie_word_embeddings": True, "dtype": "bfloat16", "text_config": text, "vision_config": VISION_TINY,
            "transformers_version": "5.8.0.dev0"}


def sizes(text: dict = TEXT_REAL) -> tuple[int, int]:
    """(parameters, active parameters per token) of the text model: a token does not read the experts it does not
    choose; the tied embedding counts once (the head reads all of it at every decoder call). No vision tower."""
    D, V, E, k, Fe, ffn = (text[key] for key in ("hidden_size", "vocab_size", "num_experts", "top_k_experts",
                                                 "moe_intermediate_size", "intermediate_size"))
    heads, total, unchosen = text["num_attention_heads"], V * D + 3 * D * ffn + 2 * D, 0   # self-cond MLP, norms
    for kind in text["layer_types"]:
        full = kind == "full_attention"
        hd, kv = (text["global_head_dim"], text["num_global_key_value_heads"]) if full else (
            text["head_dim"], text["num_key_value_heads"])
        attention = D * hd * (2 * heads + kv * (1 if full else 2)) + 2 * hd          # q, o, k (and v); q/k norms
        router = D * E + D + E                                                        # and its two scales
        total += attention + 3 * D * ffn + router + 7 * D + 2 + E * 3 * Fe * D       # norms, the two scalars
        unchosen += (E - k) * 3 * Fe * D
    return total, total - unchosen


def make_gemma_release(folder: str, seed: int = 0) -> int:
    """The release's format at tiny sizes into `folder` (new or empty): config.json, generation_config.json, the
    weights in two shards with their index, the tokenizer files and a chat template. Returns the weights' bytes."""
    from layout import checkpoint_state
    from model import ModelConfig, build
    os.makedirs(folder, exist_ok=True)
    hf = config(TEXT_TINY)
    cfg = ModelConfig.from_hf(dict(hf, **{k: GENERATION[k] for k in ("eos_token_id", "pad_token_id")}))
    g = torch.Generator().manual_seed(seed)
    model = build(cfg)
    for p in model.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.05 + (1 if p.ndim == 1 else 0)).to(torch.bfloat16)
    # Every tensor under its checkpoint name (gate and up apart), but the experts, which are stacked below.
    tensors = {theirs: t for theirs, t in checkpoint_state(model).items() if ".experts." not in theirs}
    for i, layer in enumerate(model.layers):      # each layer's experts stacked, as the official class keeps them
        moe, prefix = layer.moe, f"model.decoder.layers.{i}.experts."
        tensors[prefix + "gate_up_proj"] = torch.cat([moe.w_gate, moe.w_up], dim=1).detach()
        tensors[prefix + "down_proj"] = moe.w_down.transpose(1, 2).detach()
    tensors["model.encoder.vision_tower.patch_embedder.input_proj.weight"] = torch.randn(16, 48, generator=g)
    tensors["model.encoder.embed_vision.embedding_projection.weight"] = torch.randn(64, 16, generator=g)
    names = sorted(tensors)
    shards = {f"model-0000{s + 1}-of-00002.safetensors": names[s::2] for s in range(2)}
    for file, keys in shards.items():
        save_file({k: tensors[k].to(torch.bfloat16).contiguous() for k in keys}, os.path.join(folder, file),
                  metadata={"format": "pt"})
    total = sum(t.numel() * 2 for t in tensors.values())
    files = {"config.json": hf, "generation_config.json": GENERATION,
             "model.safetensors.index.json": {"metadata": {"total_size": total},
                                              "weight_map": {k: f for f, ks in shards.items() for k in ks}},
             "tokenizer_config.json": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                                       "tokenizer_class": "GemmaTokenizer", "added_tokens_decoder": {
                                           str(i): dict(content=t, special=True) for i, t in SPECIAL.items()}}}
    for name, obj in files.items():
        with open(os.path.join(folder, name), "w") as f:
            json.dump(obj, f, indent=2)
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    write_tokenizer(folder, hf["text_config"]["vocab_size"])
    with open(os.path.join(folder, "random_checkpoint.json"), "w") as f:      # last: tools/checkpoint.py's MARKER
        json.dump(dict(written_by="tools/checkpoint.py", release=REPO, config=hf, seed=seed), f, indent=2)
    return total


def write_tokenizer(folder: str, vocab_size: int):
    """Word-level: token i is "w{i}", Gemma's special tokens at their ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {SPECIAL.get(i, f"w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(list(SPECIAL.values()))
    tok.save(os.path.join(folder, "tokenizer.json"))
