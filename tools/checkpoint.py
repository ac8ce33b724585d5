"""
tools/checkpoint.py: writes random checkpoints in the real on-disk formats (shapes.py makes them), and the released
checkpoints' formats at tiny sizes (--release), for benchmarks and tests that need a model of a given shape and not
its knowledge.

    python tools/checkpoint.py /tmp/mid                                  # LLaDA, d_model 512, 4 layers, 126k vocab
    python tools/checkpoint.py /tmp/d --family dream --d-model 256 --layers 2 --vocab 1024 --shards 3
    python tools/checkpoint.py /tmp/dc --release apple/DiffuCoder-7B-Instruct   # a released checkpoint's format
    python tools/checkpoint.py --sizes                                           # their bf16 weight bytes

A checkpoint goes into a new or empty folder only, and its last file, random_checkpoint.json, says that this
tool wrote it and with which settings: bench.py --dir reuses such a folder and refuses every other non-empty
one, so no file of anyone else's is ever overwritten.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # run as a script from anywhere

import torch  # noqa: E402

import flags  # noqa: E402
from flags import Parser, nonempty, shape_arguments  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from shapes import (FASTDLLM_V2_GENERATION, MARKER, REAL_VOCAB, SDAR_GENERATION, SHAPES, TOKENIZER_SPECIALS,  # noqa: E402
                    check_fits, held_checkpoint, hf_config, shape_config, write, write_weights, write_word_tokenizer)
from tools import gemma_checkpoint  # noqa: E402

# ----------------------------------------------------------------------------------------------------------
# The released checkpoints, each at tiny sizes in its exact on-disk format: config.json with the real keys and
# values except the sizes, the real tensor names and shard count, and the real tokenizer files' special tokens
# (each at its real distance from the end of the vocabulary, so the real vocabulary gets the real ids) and chat
# template. docs/models.md gives each fact's source, and which ones no public copy of the file confirmed.

# Special tokens by real id. LLaDA: docs/official.md 1 (tokenizer_config.json). Qwen2.5's 22, the first 14 special;
# Dream adds <|beginoftext|> and <|mask|> (docs/official.md 3); DiffuCoder-Instruct adds <|dlm_pad|>.
LLADA_TOKENS = {126080: "<|startoftext|>", 126081: "<|endoftext|>", 126082: "[CLS]", 126083: "[gMASK]",
                126336: "<|mdm_mask|>", 126340: "<role>", 126341: "</role>", 126346: "<|start_header_id|>",
                126347: "<|end_header_id|>", 126348: "<|eot_id|>"}
QWEN_TOKENS = dict(enumerate(
    ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
     "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
     "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
     "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"], start=151643))
QWEN_NOT_SPECIAL = set(range(151657, 151665))
DREAM_TOKENS = {**QWEN_TOKENS, 151665: "<|beginoftext|>", 151666: "<|mask|>"}
DIFFUCODER_TOKENS = {**DREAM_TOKENS, 151667: "<|dlm_pad|>"}
# LLaDA-MoE: the Ling 2.0 tokenizer's end of text and mask at the reported ids (dInfer's eos 156892 and mask 156895;
# the mask's name is dllm's, the end's is not confirmed). The role tags its template writes are tokens of it (dllm makes
# <|role_end|> LLaDA-MoE's end of turn) at ids no public copy showed: nothing reads them by id, so the tiny copy
# puts them just above the mask (docs/models.md, LLaDA-MoE).
LLADAMOE_TOKENS = {156892: "<|endoftext|>", 156895: "<|mask|>", 156896: "<role>", 156897: "</role>",
                   156898: "<|role_end|>"}

# Chat templates, written here (jinja, as tokenizer_config.json holds them) to render what each model's own does:
# LLaDA's (docs/official.md 1: bos once, header + trimmed content + <|eot_id|> per message, the assistant header
# always), and ChatML with a default system prompt, in Dream-v0's form (the system inside the loop) and Qwen2.5's
# (before it).
LLADA_TEMPLATE = ("{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
                  "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
                  "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
                  "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}")
DREAM_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                  "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
                  "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
QWEN25_TEMPLATE = ("{%- if messages[0]['role'] == 'system' %}\n"
                   "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n{%- else %}\n"
                   "    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n{%- endif %}\n"
                   "{%- for message in messages %}\n    {%- if not (loop.first and message.role == 'system') %}\n"
                   "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
                   "    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n"
                   "    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")

# Ling 2.0's format, which LLaDA-MoE-Instruct's template is reported to write (docs/models.md: its own template
# text was not seen): the system turn (first system message + newline, then the thinking switch), each message in
# role tags closed by <|role_end|> (a tool-result run as one OBSERVATION turn; an assistant's text after </think>,
# its reasoning kept only after the last question), then the assistant's tag. Tool definitions and calls left out.
LING_TEMPLATE = """{%- set thinking_option = 'off' %}
{{- '<role>SYSTEM</role>' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{% endif %}
{{- 'detailed thinking ' + thinking_option + '<|role_end|>' }}
{%- set ns = namespace(last=messages|length - 1, found=false) %}
{%- for m in messages|reverse %}
    {%- if not ns.found and m.role == 'user' and not (m.content.startswith('<tool_response>')
                                                   and m.content.endswith('</tool_response>')) %}
        {%- set ns.found = true %}{% set ns.last = messages|length - loop.index %}
    {%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{{- '<role>HUMAN</role>' + m.content + '<|role_end|>' }}
    {%- elif m.role == 'system' and not loop.first %}{{- '<role>SYSTEM</role>' + m.content + '<|role_end|>' }}
    {%- elif m.role == 'assistant' %}
        {%- set text = m.content %}{% set thought = '' %}
        {%- if '</think>' in text %}
            {%- set thought = text.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set text = text.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last and thought %}
            {%- set text = '\\n<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' + text %}
        {%- endif %}
        {{- '<role>ASSISTANT</role>' + text + '<|role_end|>' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<role>OBSERVATION</role>' }}{% endif %}
        {{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|role_end|>' }}{% endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<role>ASSISTANT</role>' }}{% endif %}"""

# Dream's generation_config.json (docs/official.md 3, verbatim; its ids follow config.json).
DREAM_GENERATION = dict(_from_model_config=True, alg="origin", alg_temp=None, eps=0.001, mask_token_id=None,
                        output_history=False, steps=512, temperature=0.0, top_k=None, top_p=None,
                        transformers_version="4.46.2")


QWEN3_TOKENS = {**QWEN_TOKENS, 151665: "<tool_response>", 151666: "</tool_response>", 151667: "<think>",
                151668: "</think>", 151669: "<|MASK|>"}
# Qwen3's ChatML (no default system prompt), as SDAR's chat_template.jinja writes a conversation without tools.
QWEN3_TEMPLATE = ("{%- for message in messages %}\n    {{- '<|im_start|>' + message.role + '\\n' + message.content + "
                  "'<|im_end|>\\n' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}"
                  "\n{%- endif %}\n")

LLADA_ROW = dict(family="llada", shape="llada-8b", shards=6, tokens=LLADA_TOKENS, tokenizer="tokenizer.json",
                 tokenizer_class="PreTrainedTokenizerFast", model_max_length=4096, bos="<|startoftext|>",
                 eos="<|endoftext|>", pad="<|endoftext|>", mask="<|mdm_mask|>", template=LLADA_TEMPLATE,
                 template_file=None, ids={}, generation=None)
DREAM_ROW = dict(family="dream", shape="dream-7b", shards=4, tokens=DREAM_TOKENS, tokenizer="slow",
                 tokenizer_class="DreamTokenizer", model_max_length=131072, bos="<|beginoftext|>",
                 eos="<|endoftext|>", pad="<|endoftext|>", mask="<|mask|>", template=DREAM_TEMPLATE,
                 template_file=None, ids=dict(bos_token_id=151643, eos_token_id=151643, pad_token_id=151643),
                 generation=DREAM_GENERATION)
DIFFUCODER_ROW = {**DREAM_ROW, "template": QWEN25_TEMPLATE, "template_file": "chat_template.jinja"}
# LLaDA-MoE: tokenizer.json, the template inside tokenizer_config.json (the file listing has no chat_template.jinja
# and a 4.59 kB tokenizer_config.json), no bos; `config` edits config.json at real values (the release's
# model_type "llada", its config class LLaDAConfig, 8192 positions), `drop` removes keys (no mask_token_id: the
# mask is the tokenizer's <|mask|>). generation_config.json exists; of its fields only config.json's ids are written.
LLADAMOE_ROW = dict(family="lladamoe", shape="lladamoe-7b", shards=3, tokens=LLADAMOE_TOKENS,
                    tokenizer="tokenizer.json", tokenizer_class="PreTrainedTokenizerFast", model_max_length=8192,
                    bos=None, eos="<|endoftext|>", pad="<|endoftext|>", mask="<|mask|>", template=LING_TEMPLATE,
                    template_file=None, ids={}, generation=dict(_from_model_config=True),
                    config=dict(model_type="llada", max_position_embeddings=8192, auto_map={
                        "AutoConfig": "configuration_lladamoe.LLaDAConfig",
                        "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM",
                        "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM"}), drop=("mask_token_id",))
# Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_7B): Qwen2.5's slow tokenizer files (vocab.json, merges.txt,
# added_tokens.json with |<MASK>| at 151665), no bos token, eos <|im_end|>, pad <|endoftext|>, the template in
# chat_template.jinja; config.json: model_type Fast_dLLM_Qwen, bd_size 32, bos 151643, eos = pad 151645, no mask id.
FASTDLLM_V2_ROW = dict(family="fastdllm_v2", shape="fastdllm-v2-7b", shards=4,
                       tokens={**QWEN_TOKENS, 151665: "|<MASK>|"}, tokenizer="slow", tokenizer_class="Qwen2Tokenizer",
                       model_max_length=131072, bos=None, eos="<|im_end|>", pad="<|endoftext|>", mask="|<MASK>|",
                       template=QWEN25_TEMPLATE, template_file="chat_template.jinja", ids={},
                       generation=dict(FASTDLLM_V2_GENERATION, bos_token_id=151643, pad_token_id=151643,
                                       eos_token_id=[151645, 151643]))
# SDAR (JetLM/SDAR-4B-Chat): Qwen3's tokenizer.json, |<MASK|> 151669 an added token not flagged special, eos = pad
# <|endoftext|>, no bos; config.json as the Hub's (no block_size, no mask_token_id: the decode's, the tokenizer's).
SDAR_ROW = dict(family="sdar", shape="sdar-4b", shards=2, tokens=QWEN3_TOKENS, tokenizer="tokenizer.json",
                tokenizer_class="Qwen2Tokenizer", model_max_length=131072, bos=None, eos="<|endoftext|>",
                pad="<|endoftext|>", mask="<|MASK|>", template=QWEN3_TEMPLATE, template_file="chat_template.jinja", ids={},
                not_special=set(range(151657, 151665)) | set(range(151665, 151670)),
                generation=dict(SDAR_GENERATION, bos_token_id=151643, pad_token_id=151643, eos_token_id=[151645, 151643]),
                drop=("block_size", "mask_token_id"))
# LLaDA2.x: the golden tiny config.json's keys (the release's), the Ling 2.0 tokenizer as LLaDA-MoE's plus its bos
# <|startoftext|> (tokenizer_config.json names it; its id was not seen: the tiny copy puts it below the end token),
# the template inside tokenizer_config.json, 32768 positions; generation_config.json: eos = pad = 156892. The shard
# counts were not seen: the mini's is LLaDA2.0-mini-preview's first commit's (7), the flash's the same guess.
LLADA2_TOKENS = {156891: "<|startoftext|>", **LLADAMOE_TOKENS}
LLADA2_ROW = dict(family="llada2", shape="llada2-mini", shards=7, tokens=LLADA2_TOKENS, tokenizer="tokenizer.json",
                  tokenizer_class="PreTrainedTokenizerFast", model_max_length=32768, bos="<|startoftext|>",
                  eos="<|endoftext|>", pad="<|endoftext|>", mask="<|mask|>", template=LING_TEMPLATE,
                  template_file=None, ids={}, drop=("mask_token_id",),
                  generation=dict(eos_token_id=156892, pad_token_id=156892, do_sample=False))
# One row per released checkpoint; `ids` are config.json's special ids (real values), `eos`/`pad`/`bos`/
# `mask` the tokenizer files' tokens, `tokenizer` "tokenizer.json" or Qwen2's "slow" files. The weights' shape at
# real size is SHAPES[shape]; REAL_VOCAB[family] is its vocabulary.
RELEASES = {
    "GSAI-ML/LLaDA-8B-Base": LLADA_ROW,
    "GSAI-ML/LLaDA-8B-Instruct": LLADA_ROW,
    "GSAI-ML/LLaDA-1.5": LLADA_ROW,
    "inclusionAI/LLaDA-MoE-7B-A1B-Base": LLADAMOE_ROW,
    "inclusionAI/LLaDA-MoE-7B-A1B-Instruct": LLADAMOE_ROW,
    "inclusionAI/LLaDA2.0-mini": LLADA2_ROW,
    "inclusionAI/LLaDA2.0-flash": {**LLADA2_ROW, "shape": "llada2-flash"},
    "inclusionAI/LLaDA2.1-mini": LLADA2_ROW,
    "inclusionAI/LLaDA2.1-flash": {**LLADA2_ROW, "shape": "llada2-flash"},
    "Dream-org/Dream-v0-Base-7B": DREAM_ROW,
    "Dream-org/Dream-v0-Instruct-7B": DREAM_ROW,
    # Qwen2.5-Coder's tokenizer: <|im_end|> ends its text; its generation config lists both end tokens.
    "Dream-org/Dream-Coder-v0-Instruct-7B": {**DREAM_ROW, "template": QWEN25_TEMPLATE, "eos": "<|im_end|>",
                                            "ids": dict(bos_token_id=151665, eos_token_id=151643, pad_token_id=151643),
                                            "generation": {**DREAM_GENERATION, "eos_token_id": [151645, 151643]}},
    "apple/DiffuCoder-7B-Base": DIFFUCODER_ROW,
    # Instruct-tuned with a new pad token at fixed length: the tokenizer's pad is <|dlm_pad|>, config.json's stays.
    "apple/DiffuCoder-7B-Instruct": {**DIFFUCODER_ROW, "tokens": DIFFUCODER_TOKENS, "pad": "<|dlm_pad|>"},
    "apple/DiffuCoder-7B-cpGRPO": {**DIFFUCODER_ROW, "tokens": DIFFUCODER_TOKENS, "pad": "<|dlm_pad|>"},
    "Efficient-Large-Model/Fast_dLLM_v2_7B": FASTDLLM_V2_ROW,
    "JetLM/SDAR-4B-Chat": SDAR_ROW,
    "JetLM/SDAR-8B-Chat": {**SDAR_ROW, "shape": "sdar-8b"},
}


def release_bytes(repo: str) -> int:
    """The bf16 bytes of a released checkpoint's weights: its real config's parameter count x 2."""
    shape = SHAPES[RELEASES[repo]["shape"]]
    hf = hf_config(shape["family"], shape["d_model"], shape["n_layers"], shape["vocab"], shape["n_heads"],
                   shape["n_kv_heads"], shape["ffn"], shape.get("head_dim"))
    with torch.device("meta"):
        return 2 * sum(p.numel() for p in Transformer(ModelConfig.from_hf(hf)).parameters())


def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet, in byte order: printable bytes stand for themselves, the others for
    chr(256 + n) (space -> "Ġ", newline -> "Ċ")."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


# A few merges, so the tiny tokenizers are byte-level BPE with merges, as the real ones ("the", " the", "in").
MERGES = [("h", "e"), ("t", "he"), ("Ġ", "the"), ("i", "n"), ("Ġ", "Ġ")]


def write_release_tokenizer(folder: str, row: dict, at) -> None:
    """The row's tokenizer files, its special tokens at ids at(real id): LLaDA's tokenizer.json, or Dream's slow
    files (vocab.json, merges.txt, added_tokens.json); then tokenizer_config.json and special_tokens_map.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: b for b, c in enumerate(byte_chars())}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tokens = {at(i): t for i, t in row["tokens"].items()}
    special = lambda i: i - at(0) not in row.get("not_special", QWEN_NOT_SPECIAL)      # noqa: E731  (i: an id here)
    entry = lambda i: dict(content=tokens[i], lstrip=False, normalized=False, rstrip=False, single_word=False,
                           special=special(i))                 # noqa: E731
    if row["tokenizer"] == "tokenizer.json":
        tok = Tokenizer(models.BPE({**vocab, **{t: i for i, t in tokens.items()}}, MERGES))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([tokens[i] for i in sorted(tokens)])
        tok.save(os.path.join(folder, "tokenizer.json"))
    else:
        files = {"vocab.json": vocab, "added_tokens.json": {t: i for i, t in tokens.items()}}
        for name, obj in files.items():
            with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                json.dump(obj, f, ensure_ascii=False, indent=2)
        with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES))
    names = {f"{k}_token": row[k] for k in ("bos", "eos", "pad") if row[k]}      # LLaDA-MoE names no bos
    config = {"add_bos_token": False, "add_eos_token": False,
              "added_tokens_decoder": {str(i): entry(i) for i in sorted(tokens)}, **names,
              "model_max_length": row["model_max_length"], "tokenizer_class": row["tokenizer_class"]}
    if row["template_file"] is None:
        config["chat_template"] = row["template"]
    else:
        with open(os.path.join(folder, row["template_file"]), "w", encoding="utf-8") as f:
            f.write(row["template"])
    special_map = {**{k: entry(next(i for i in tokens if tokens[i] == v)) for k, v in names.items()},
                   "additional_special_tokens": [tokens[i] for i in sorted(tokens) if special(i)]}
    if row["tokenizer"] == "slow":     # Dream's tokenizer class names its mask
        special_map["mask_token"] = row["mask"]
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=2)


def make_release(folder: str, repo: str, d_model: int = 64, n_layers: int = 2, vocab: int = 1024, n_heads: int = 4,
                 n_kv_heads: int = 2, ffn: int = 192, seed: int = 0) -> int:
    """A random checkpoint of the released `repo` (RELEASES) at these sizes, in its exact format: config.json,
    generation_config.json, the weights in its real shards, its tokenizer files and chat template. Every special id
    keeps its real distance from the end of the vocabulary: vocab=REAL_VOCAB[family] gives the real ids.
    Returns the weights' bytes."""
    row = RELEASES[repo]
    if held_checkpoint(folder, folder) is not None:
        raise ValueError(f"{folder} already holds a checkpoint: pass a new or empty folder")
    at = lambda i: i - REAL_VOCAB[row["family"]] + vocab       # noqa: E731  (a real id -> its id here)
    hf = hf_config(row["family"], d_model, n_layers, vocab, n_heads, n_kv_heads, ffn)
    hf.update({key: at(i) for key, i in row["ids"].items()})
    hf = {k: v for k, v in {**hf, **row.get("config", {})}.items() if k not in row.get("drop", ())}
    total = write_weights(folder, hf, row["shards"], 1.13, 13.0, seed, "cpu")
    files = {"config.json": hf}
    if row["generation"] is not None:
        eos = row["generation"].get("eos_token_id")      # a real id (or list of them), else config.json's
        eos = hf["eos_token_id"] if eos is None else [at(i) for i in eos] if isinstance(eos, list) else at(eos)
        files["generation_config.json"] = {**row["generation"],
                                           **{k: at(row["generation"][k]) if k in row["generation"] else hf[k]
                                              for k in ("bos_token_id", "pad_token_id") if k in hf or k in row["generation"]},
                                           "eos_token_id": eos}
    for name, obj in files.items():
        with open(os.path.join(folder, name), "w") as f:
            json.dump(obj, f, indent=2)
    write_release_tokenizer(folder, row, at)
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump(dict(written_by="tools/checkpoint.py", release=repo, config=hf, seed=seed), f, indent=2)
    return total


def main(argv=None):
    p = Parser(prog="tools/checkpoint.py", description="Write a random checkpoint in the real on-disk format.")
    p.add_argument("out", type=nonempty, nargs="?", help="the folder to write (new or empty)")
    p.add_argument("--release", choices=[*RELEASES, gemma_checkpoint.REPO], metavar="REPO", help="a released "
                   "checkpoint's exact format at tiny sizes (tests' size; no shape flags): "
                   + ", ".join([*RELEASES, gemma_checkpoint.REPO]))
    p.add_argument("--sizes", action="store_true", help="print each released checkpoint's bf16 weight bytes at its "
                   "real size (parameters x 2), then exit")
    shape_arguments(p)
    p.add_argument("--tokenizer", action="store_true", help="also write a word-level tokenizer.json with the "
                   "family's special tokens (lladamoe), for the command line")
    args = p.parse_args(argv)
    if args.tokenizer and args.family not in TOKENIZER_SPECIALS:
        raise ValueError(f"--tokenizer writes {', '.join(TOKENIZER_SPECIALS)} tokenizers only: for {args.family}, "
                         f"copy a real tokenizer into the folder")
    if args.sizes:
        for repo in RELEASES:
            print(f"{repo}: {release_bytes(repo):,} bytes ({release_bytes(repo) / 1e9:.2f} GB)")
        # DiffusionGemma (tools/gemma_checkpoint.py): its text model, and what one token reads (top-8 of 128 experts)
        total, active = gemma_checkpoint.sizes()
        print(f"{gemma_checkpoint.REPO}: {2 * total:,} bytes ({2 * total / 1e9:.2f} GB); active per token "
              f"{2 * active:,} bytes ({2 * active / 1e9:.2f} GB, {active / 1e9:.2f}B parameters)")
        return
    if not args.out:
        raise ValueError("no folder to write: pass one (or --sizes)")
    if args.release:
        changed = sorted(k for k in SHAPE_DESTS if getattr(args, k) != p.get_default(k))
        if changed:
            raise ValueError(f"--{changed[0].replace('_', '-')} does not apply with --release, which writes the "
                             f"release's tiny test size: drop it")
        held_checkpoint(args.out, args.out)
        size = (gemma_checkpoint.make_gemma_release(args.out) if args.release == gemma_checkpoint.REPO else
                make_release(args.out, args.release))
        print(f"{args.out}: {args.release} at tiny sizes, {size / 1e6:.2f} MB of weights")
        return
    hf = shape_config(args)
    held_checkpoint(args.out, args.out)
    check_fits(hf, args.out, torch.device("cpu"), torch.bfloat16)    # the shards are made in bf16 in memory
    size = write(args.out, args)
    if args.tokenizer:
        write_word_tokenizer(args.out, args.family)
    print(f"{args.out}: {size / 1e9:.3f} GB")


SHAPE_DESTS = {"family", "d_model", "layers", "heads", "kv_heads", "ffn", "vocab", "shards", "gain", "logit_std"}

if __name__ == "__main__":
    flags.run(main)
