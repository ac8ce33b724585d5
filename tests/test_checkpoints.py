"""
Every released checkpoint of the two families (README's model table, docs/models.md), as a tiny random checkpoint
in its exact on-disk format (tools/checkpoint.py RELEASES): its files are the real ones' (config keys, tensor
names, dtype, shards, tokenizer files, template file), its special ids and chat template are read from those
files, and the public paths answer on it offline: `python fastdllm.py --model <folder>`, cli.main in every
cache mode, serve.py. The template check renders each checkpoint's own template text with jinja2 (the
library transformers renders it with) and compares it with chat.Chat's written-out one.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.request

import pytest
import torch
from safetensors import safe_open

import bounded
import cli
from blockdiff import FAMILIES as BLOCK_FAMILIES
from chat import Chat, chat_template
from conftest import ROOT
from fastdllm import generate
from model import checkpoint_names, load_model, read_config, skeleton
from shapes import REAL_VOCAB

from tools.checkpoint import RELEASES, make_release

FLAGS = ["--gen-length", "16", "--block-length", "8"]
CONVERSATIONS = [
    [{"role": "user", "content": " Write a sort in Python.\n"}],
    [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "the cat"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]

MOE = ("inclusionAI/LLaDA-MoE-7B-A1B-Base", "inclusionAI/LLaDA-MoE-7B-A1B-Instruct")
# <|role_end|>'s id in the release was not seen (docs/models.md): the tiny copies' placement, never read by id.
ROLE_END = next(i for i, t in RELEASES[MOE[1]]["tokens"].items() if t == "<|role_end|>")


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """repo -> a tiny checkpoint folder of it (vocab 1024: the special ids at their real distance from the end)."""
    root = tmp_path_factory.mktemp("releases")
    folders = {}
    for i, repo in enumerate(RELEASES):
        folders[repo] = str(root / str(i))
        make_release(folders[repo], repo)
    return folders


def tiny_id(repo: str, real_id: int, vocab: int = 1024) -> int:
    return real_id - REAL_VOCAB[RELEASES[repo]["family"]] + vocab


def read(folder, name):
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


# The real config.json's keys, written here from the public files (docs/official.md 1, 3, 8), not read from the
# golden copies the writer starts from: LLaDA-8B-Instruct's config.json on the Hub, Dream-v0-Instruct-7B's, and the
# keys LLaDA-MoE's configuration class writes (its release has no mask_token_id: docs/models.md).
REAL_KEYS = {
    "llada": """activation_type alibi alibi_bias_max architectures attention_dropout attention_layer_norm
        attention_layer_norm_with_affine auto_map bias_for_layer_norm block_group_size block_type d_model
        embedding_dropout embedding_size eos_token_id flash_attention include_bias include_qkv_bias init_cutoff_factor
        init_device init_fn init_std input_emb_norm layer_norm_type layer_norm_with_affine mask_token_id
        max_sequence_length mlp_hidden_size mlp_ratio model_type multi_query_attention n_heads n_kv_heads n_layers
        pad_token_id precision residual_dropout rms_norm_eps rope rope_full_precision rope_theta scale_logits
        transformers_version use_cache vocab_size weight_tying""",
    "dream": """architectures attention_dropout auto_map bos_token_id eos_token_id hidden_act hidden_size
        initializer_range intermediate_size mask_token_id max_position_embeddings max_window_layers model_type
        num_attention_heads num_hidden_layers num_key_value_heads pad_token_id rms_norm_eps rope_scaling rope_theta
        sliding_window tie_word_embeddings torch_dtype transformers_version use_cache use_sliding_window vocab_size""",
    "lladamoe": """architectures attention_bias attention_dropout auto_map clip_qkv dense_intermediate_size eos_token_id
        expert_intermediate_size hidden_act hidden_size initializer_range max_position_embeddings model_type
        moe_layer_freq moe_router_enable_expert_bias moe_router_score_function norm_topk_prob num_attention_heads
        num_experts num_experts_per_tok num_hidden_layers num_key_value_heads output_router_logits pad_token_id
        partial_rotary_factor qk_layernorm rms_norm_eps rope_scaling rope_theta routed_scaling_factor
        router_aux_loss_coef router_num_group router_topk_group shared_expert_intermediate_size tie_word_embeddings
        torch_dtype transformers_version use_cache vocab_size""",
    # Efficient-Large-Model/Fast_dLLM_v2_7B's config.json (no mask id: its tokenizer's |<MASK>|).
    "fastdllm_v2": """architectures attention_dropout auto_map bd_size bos_token_id conplemenrary_mask eos_token_id
        hidden_act hidden_size initializer_range intermediate_size layer_types max_position_embeddings max_window_layers
        model_type num_attention_heads num_hidden_layers num_key_value_heads pad_token_id rms_norm_eps rope_scaling
        rope_theta sliding_window tie_word_embeddings torch_dtype transformers_version use_cache use_sliding_window
        vocab_size""",
    # JetLM/SDAR-4B-Chat's config.json on the Hub (no block_size, no mask_token_id: the GitHub training copy adds them).
    "sdar": """architectures attention_bias attention_dropout attn_implementation auto_map bos_token_id debug
        eos_token_id ep_size fuse_cross_entropy head_dim hidden_act hidden_size initializer_range intermediate_size
        max_position_embeddings max_window_layers micro_forward model_type num_attention_heads num_hidden_layers
        num_key_value_heads rms_norm_eps rope_scaling rope_theta skip_checkpoint sliding_window tie_word_embeddings
        torch_dtype transformers_version use_cache use_deepep use_sliding_window vocab_size""",
    # inclusionAI/LLaDA2.1-mini's config.json on the Hub (48 keys; no eos or mask id: generation_config.json and the
    # tokenizer's <|mask|> give them; docs/models.md).
    "llada2": """architectures attention_dropout auto_map dtype embedding_dropout first_k_dense_replace head_dim
        hidden_act hidden_size initializer_range intermediate_size max_position_embeddings max_window_layers model_type
        moe_intermediate_size moe_router_enable_expert_bias n_group norm_head norm_softmax norm_topk_prob
        num_attention_heads num_experts num_experts_per_tok num_hidden_layers num_key_value_heads num_shared_experts
        output_dropout output_router_logits pad_token_id partial_rotary_factor rms_norm_eps rope_scaling rope_theta
        rotary_dim routed_scaling_factor router_dtype score_function sliding_window tie_word_embeddings topk_group
        transformers_version use_bias use_cache use_qkv_bias use_rmsnorm use_sliding_window
        using_split_qkv_in_self_attention vocab_size"""}
REAL_TYPES = {"llada": ("llada", ["LLaDAModelLM"]), "dream": ("Dream", ["DreamModel"]),
              "lladamoe": ("llada", ["LLaDAMoEModelLM"]), "fastdllm_v2": ("Fast_dLLM_Qwen", ["Fast_dLLM_QwenForCausalLM"]),
              "sdar": ("sdar", ["SDARForCausalLM"]), "llada2": ("llada2_moe", ["LLaDA2MoeModelLM"])}      # LLaDA-MoE's release: model_type "llada" (docs/models.md)


@pytest.mark.parametrize("repo", RELEASES)
def test_files_are_the_real_format(releases, repo):
    """config.json has exactly the real file's keys (REAL_KEYS), model_type and architectures; the tensors have
    the real names, bf16, in the real number of shards named by the index; the tokenizer files are the family's
    (LLaDA: tokenizer.json; Dream: Qwen2's slow files), the template where the checkpoint keeps it."""
    d, row = releases[repo], RELEASES[repo]
    hf = read(d, "config.json")
    assert set(hf) == set(REAL_KEYS[row["family"]].split())
    assert (hf["model_type"], hf["architectures"]) == REAL_TYPES[row["family"]]
    index = read(d, "model.safetensors.index.json")["weight_map"]
    cfg = read_config(d)
    assert set(index) == set(checkpoint_names(cfg, skeleton(cfg)))
    assert sorted(set(index.values())) == [f"model-{i:05d}-of-{row['shards']:05d}.safetensors"
                                           for i in range(1, row["shards"] + 1)]
    for file in set(index.values()):
        with safe_open(os.path.join(d, file), framework="pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    files = set(os.listdir(d))
    tokenizer = {"tokenizer.json"} if row["tokenizer"] == "tokenizer.json" else {"vocab.json", "merges.txt",
                                                                                 "added_tokens.json"}
    assert tokenizer | {"tokenizer_config.json", "special_tokens_map.json"} <= files
    in_config = "chat_template" in read(d, "tokenizer_config.json")
    assert in_config == (row["template_file"] is None) and ("chat_template.jinja" in files) == (not in_config)
    assert ("generation_config.json" in files) == (row["generation"] is not None)


@pytest.mark.parametrize("repo", RELEASES)
def test_chat_renders_the_checkpoints_own_template(releases, repo):
    """Chat.render (written out) equals the checkpoint's own template text rendered by jinja2, as transformers'
    apply_chat_template renders it (trim_blocks, lstrip_blocks; bos_token from the tokenizer files)."""
    jinja2 = pytest.importorskip("jinja2")
    d = releases[repo]
    chat = Chat(d, read_config(d))
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(chat_template(d))
    bos = read(d, "tokenizer_config.json").get("bos_token")     # LLaDA-MoE names none
    assert chat.chat
    for messages in CONVERSATIONS:
        assert chat.render(messages) == template.render(messages=messages, bos_token=bos, add_generation_prompt=True)


@pytest.mark.parametrize("repo", RELEASES)
def test_special_ids_come_from_the_files(releases, repo):
    """The mask is config.json's and is the tokenizer's mask token; an answer ends at config.json's eos, the
    template's end of turn, and (DiffuCoder-Instruct, cpGRPO) the tokenizer's pad <|dlm_pad|>: the model card
    cuts its answers there, while config.json's pad_token_id stays <|endoftext|>."""
    d, row = releases[repo], RELEASES[repo]
    cfg, chat = read_config(d), Chat(d, read_config(d))
    assert chat.tok.id_to_token(cfg.mask_id) == row["mask"]
    if row["family"] == "llada":
        ends = {126081, 126348}                   # <|endoftext|>, <|eot_id|>
    elif row["family"] in ("lladamoe", "llada2"):
        ends = {156892, ROLE_END}                 # <|endoftext|>, <|role_end|> (the same Ling 2.0 tokenizer)
    else:
        ends = {151643, 151645} | ({151667} if row["pad"] == "<|dlm_pad|>" else set())   # + <|im_end|>, <|dlm_pad|>
    assert chat.stop_ids == {tiny_id(repo, i) for i in ends}
    assert cfg.pad_id == tiny_id(repo, {"llada": 126081, "lladamoe": 156892, "llada2": 156892}.get(row["family"],
                                                                                                     151643))
    word = chat.encode(" the")
    pad = chat.tok.token_to_id(row["pad"])
    assert chat.answer(word + [pad] + word) == "the"


# generate()'s end of text (stop_at_eos without eos_ids), at the real ids: what each release's own files and decode
# end the text at (docs/models.md). Dream-Coder: its tokenizer's eos <|im_end|>, which its config.json does not name.
END_OF_TEXT = {"llada": {126081}, "lladamoe": {156892}, "llada2": {156892}, "dream": {151643}, "fastdllm_v2": {151645},
               "sdar": {151645, 151643}, "Dream-org/Dream-Coder-v0-Instruct-7B": {151643, 151645}}


@pytest.mark.parametrize("repo", RELEASES)
def test_the_end_of_text_is_read_from_the_files(releases, repo):
    """config.json's eos_token_id, generation_config.json's where the family's official decode reads that file (SDAR,
    LLaDA2), and the tokenizer's eos_token (tokenizer_config.json): model.read_config, so that the API stops where
    the command line does."""
    cfg = read_config(releases[repo])
    want = END_OF_TEXT.get(repo, END_OF_TEXT[RELEASES[repo]["family"]])
    assert set(cfg.eos_ids) == {tiny_id(repo, i) for i in want}


@pytest.mark.parametrize("repo", ["inclusionAI/LLaDA2.0-mini"])
def test_llada2_stops_at_its_end_of_text_without_eos_ids(releases, repo, tmp_path):
    """LLaDA2.x's config.json names no end token, and a generation_config.json without eos_token_id left
    stop_at_eos=True through the API without any (it never stopped), while the official generate() ends at
    <|endoftext|> (156892): the tokenizer's eos_token. The decode stops as with eos_ids=[156892]."""
    d = shutil.copytree(releases[repo], str(tmp_path / "m"))
    generation = read(d, "generation_config.json")
    del generation["eos_token_id"]
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump(generation, f)
    model, eos = load_model(d, device="cpu"), tiny_id(repo, 156892)
    assert model.config.eos_ids == (eos,)
    prompt = torch.tensor([list(range(10, 23))])
    kw = dict(gen_length=96, block_length=8, threshold=0.9)
    full, _ = generate(model, prompt, **kw)
    often = full[0, 13:].bincount().argmax()          # the end token's head row: the most decoded token's, so it ends
    with torch.no_grad():
        model.lm_head.weight[eos] = model.lm_head.weight[often] * 1.01
    stopped, st = generate(model, prompt, stop_at_eos=True, **kw)
    given, gt = generate(model, prompt, stop_at_eos=True, eos_ids=[eos], **kw)
    assert stopped.tolist() == given.tolist() and st["nfe"] == gt["nfe"] and st["calls_saved"] > 0


@pytest.mark.parametrize("repo,ids", [("apple/DiffuCoder-7B-Instruct", {151643, 151645, 151667}),
                                      ("GSAI-ML/LLaDA-1.5", {126081, 126348})])
def test_the_real_vocabulary_gets_the_real_ids(tmp_path, repo, ids):
    """At the real vocabulary size every special id is the real one (a narrow, one-layer model keeps it small)."""
    d = str(tmp_path / "m")
    make_release(d, repo, d_model=8, n_layers=1, vocab=REAL_VOCAB[RELEASES[repo]["family"]], n_heads=1,
                 n_kv_heads=1, ffn=8)
    cfg = read_config(d)
    chat = Chat(d, cfg)
    assert cfg.mask_id == (126336 if "LLaDA" in repo else 151666) and chat.stop_ids == ids
    prompt = chat.encode(chat.render([{"role": "user", "content": "hi"}]))
    assert prompt[0] == (126080 if "LLaDA" in repo else 151644)     # <|startoftext|> / <|im_start|>


def test_template_and_ids_follow_the_files_not_the_name(releases, tmp_path):
    """Nothing is keyed to a repo: edit DiffuCoder-Base's files and the default system prompt and the end ids
    follow them (its template names another system prompt, its tokenizer another pad)."""
    d = str(tmp_path / "edited")
    shutil.copytree(releases["apple/DiffuCoder-7B-Base"], d)
    path = os.path.join(d, "chat_template.jinja")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace("You are a helpful assistant.", "You write Python. It\\'s short.\\nNo prose."))
    config = read(d, "tokenizer_config.json")
    config["pad_token"] = "<|fim_pad|>"
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    chat = Chat(d, read_config(d))
    assert chat.render([{"role": "user", "content": "x"}]).startswith(
        "<|im_start|>system\nYou write Python. It's short.\nNo prose.<|im_end|>\n<|im_start|>user\nx")
    assert chat.tok.token_to_id("<|fim_pad|>") in chat.stop_ids


def cli_run(*args):
    """`python fastdllm.py ARGS` in its own process group, killed whole past 120 s (tests/bounded.py)."""
    return bounded.run([sys.executable, os.path.join(ROOT, "fastdllm.py"), *args], timeout=120)


def cli_here(*args):
    """The same command line as fastdllm.py's __main__ in this process (tests/bounded.py run_main: no torch import)."""
    return subprocess.CompletedProcess(args, *bounded.run_main(os.path.join(ROOT, "fastdllm.py"), args))


# One release of each family in a process of its own (the others run the same code in-process below: a process
# costs a torch import, ~2 s of CPU).
ONE_PER_FAMILY = list({RELEASES[r]["family"]: r for r in RELEASES}.values())     # the last of each


@pytest.mark.parametrize("repo", ONE_PER_FAMILY)
def test_fastdllm_answers_offline(releases, repo):
    """`python fastdllm.py --model <folder>` as a user runs it, with the CLI's headline defaults."""
    r = cli_run("--model", releases[repo], "--prompt", "Write a sort in Python.", *FLAGS)
    assert r.returncode == 0, r.stderr
    answer, stats = r.stdout.rstrip("\n").split("\n")[-2:]
    assert stats.startswith("NFE ") and "tokens/s" in stats
    assert "<|" not in answer                     # specials never show: the answer is cut at the first end token


@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "free"])
@pytest.mark.parametrize("repo", RELEASES)
def test_every_cache_mode_answers(releases, repo, cache, monkeypatch, capsys):
    """cli.main in each cache mode: an answer without specials (cut at the first end token; LLaDA-MoE's Ling format:
    no role tag; its config.json names no mask, the tokenizer's <|mask|> is it) and its stats, and generate() got
    the checkpoint's end ids."""
    calls, real = [], cli.generate
    monkeypatch.setattr(cli, "generate", lambda model, prompt, **kw: calls.append(kw) or real(model, prompt, **kw))
    if cache == "free" and RELEASES[repo]["family"] in BLOCK_FAMILIES:   # block diffusion: an exact prefix cache
        with pytest.raises(ValueError, match="cache 'free' does not apply to a block-diffusion model"):
            cli.main(["--model", releases[repo], "--prompt", "the cat", "--cache", cache, *FLAGS])
        return
    assert cli.main(["--model", releases[repo], "--prompt", "the cat", "--cache", cache, *FLAGS]) is None
    lines = capsys.readouterr().out.splitlines()
    assert re.match(r"NFE \d+ \| ", lines[-1]) and "<|" not in lines[-2] and "<role>" not in lines[-2]
    d = releases[repo]
    assert [kw["cache"] for kw in calls] == [cache] and calls[0]["eos_ids"] == sorted(Chat(d, read_config(d)).stop_ids)


def test_served_diffucoder_answers(releases):
    """serve.py on DiffuCoder-Instruct: a chat completion, its answer cut at the checkpoint's end ids."""
    import serve
    d = releases["apple/DiffuCoder-7B-Instruct"]
    app = serve.build(serve.parse_args(["--model", d, *FLAGS, "--port", "0", "--quiet"]))
    httpd = serve.make_server(app, "127.0.0.1", 0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "Write a sort in Python."}]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{httpd.server_address[1]}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
    finally:
        httpd.shutdown()
        httpd.server_close()
        app.engine.stop()
    assert isinstance(out["choices"][0]["message"]["content"], str) and out["choices"][0]["fastdllm"]["nfe"] >= 1
    assert tiny_id("apple/DiffuCoder-7B-Instruct", 151667) in app.chat.stop_ids


def one_line_error(r, *words):
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(w in r.stderr for w in words), r.stderr


def test_unknown_or_wrong_architecture_is_one_line(releases, tmp_path):
    """An architecture we do not run (a model_type no row has), or a config that does not describe its
    weights (LLaDA-1.5's tensors under Dream-Coder's config.json), is one line; nothing loads half a model."""
    d = str(tmp_path / "unknown")
    shutil.copytree(releases["apple/DiffuCoder-7B-cpGRPO"], d)
    hf = read(d, "config.json")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**hf, "model_type": "DiffuCoderMoE", "architectures": ["DiffuCoderMoEModel"]}, f)
    one_line_error(cli_here("--model", d, "--prompt", "x", *FLAGS), "DiffuCoderMoE")
    d = str(tmp_path / "wrong")
    shutil.copytree(releases["GSAI-ML/LLaDA-1.5"], d)
    shutil.copy(os.path.join(releases["Dream-org/Dream-Coder-v0-Instruct-7B"], "config.json"), d)
    one_line_error(cli_here("--model", d, "--prompt", "x", "--no-chat", *FLAGS), "model.transformer")
    with pytest.raises(ValueError, match="unexpected tensor"):
        load_model(d, device="cpu")


def test_a_template_we_do_not_write_out_is_one_line(releases, tmp_path):
    """A chat template in neither format, or one whose markers the tokenizer lacks, is refused (never rendered
    wrong); --no-chat sends the raw prompt."""
    d = str(tmp_path / "m")
    shutil.copytree(releases["apple/DiffuCoder-7B-Instruct"], d)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    one_line_error(cli_here("--model", d, "--prompt", "x", *FLAGS), "neither LLaDA's", "--no-chat")
    r = cli_here("--model", d, "--prompt", "x", "--no-chat", *FLAGS)
    assert r.returncode == 0, r.stderr
    d = str(tmp_path / "llada")
    shutil.copytree(releases["GSAI-ML/LLaDA-1.5"], d)
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = config["chat_template"].replace("<|eot_id|>", "<|im_end|>").replace(
        "<|start_header_id|>", "<|im_start|>")
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    one_line_error(cli_here("--model", d, "--prompt", "x", *FLAGS), "<|im_start|>", "which its tokenizer lacks")


def test_weight_bytes_of_the_real_sizes(capsys):
    """README's GPU memory column: parameters x 2 bytes at each release's real config. LLaDA-8B's equals its
    safetensors index's total_size (16,031,162,368, docs/official.md 1); the Dream-7B shape's 15.23 GB is what
    DiffuCoder-7B's four shards add up to on its model page (4.88 + 4.93 + 4.33 + 1.09 GB)."""
    from tools import checkpoint
    assert checkpoint.release_bytes("GSAI-ML/LLaDA-1.5") == 16_031_162_368
    assert checkpoint.release_bytes("apple/DiffuCoder-7B-cpGRPO") == 15_231_233_024
    assert checkpoint.release_bytes(MOE[1]) == 14_713_761_792      # 7,356,880,896 parameters (docs/models.md)
    assert checkpoint.release_bytes("inclusionAI/LLaDA2.1-mini") == 32_511_286_784     # 16.26B (the card: 16B)
    assert checkpoint.release_bytes("inclusionAI/LLaDA2.0-flash") == 205_779_410_432   # 102.89B (the card: 100B)
    checkpoint.main(["--sizes"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(RELEASES) + 1 and "apple/DiffuCoder-7B-cpGRPO: 15,231,233,024 bytes (15.23 GB)" in lines
    # DiffusionGemma (tools/gemma_checkpoint.py, not yet a RELEASES row): its text model, and what a token reads
    assert lines[-1].startswith("google/diffusiongemma-26B-A4B-it: 50,501,973,624 bytes (50.50 GB); active per token")
    # Fast-dLLM v2 7B is Qwen2.5-7B-Instruct's shape, as Dream-7B: the same 7,615,616,512 parameters.
    assert "Efficient-Large-Model/Fast_dLLM_v2_7B: 15,231,233,024 bytes (15.23 GB)" in lines


# ----------------------------------------------------------------------------------------------------------
# LLaDA-MoE: Ling's chat format, the mask found in the tokenizer, the command line in every cache mode

LING_CONVERSATIONS = CONVERSATIONS + [
    # a later system message; an assistant turn with reasoning before and after the last question; tool results
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "system", "content": "late"},
     {"role": "user", "content": "b"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nwhy\n</think>\n\nb"},
     {"role": "user", "content": "c"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>x</think>\ny"},
     {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}],
    [{"role": "user", "content": "<tool_response>t</tool_response>"},     # not a question: no last question
     {"role": "assistant", "content": "<think>t</think>z"}],
]


@pytest.mark.parametrize("repo", MOE)
def test_ling_format_renders_what_the_template_renders(releases, repo):
    """chat.Chat's written-out Ling format equals jinja2's rendering of the copy's template on every kind of turn
    the format has (system, user, assistant with and without reasoning, tool results), not just a question."""
    jinja2 = pytest.importorskip("jinja2")
    d = releases[repo]
    chat = Chat(d, read_config(d))
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(chat_template(d))
    assert chat.style == "ling" and chat.system == "detailed thinking off"
    for messages in LING_CONVERSATIONS:
        assert chat.render(messages) == template.render(messages=messages, add_generation_prompt=True)
    prompt = chat.encode(chat.render([{"role": "user", "content": "hi"}]))
    assert chat.tok.id_to_token(prompt[0]) == "<role>" and chat.tok.id_to_token(prompt[-1]) == "</role>"


def test_lladamoe_real_vocabulary_gets_the_real_ids(tmp_path):
    """At LLaDA-MoE's real vocabulary (157,184) the mask is 156895 and the answer ends at 156892; config.json names
    no mask id, so read_config takes the tokenizer's <|mask|>."""
    d = str(tmp_path / "m")
    make_release(d, MOE[1], d_model=8, n_layers=1, vocab=REAL_VOCAB["lladamoe"], n_heads=1, n_kv_heads=1, ffn=8)
    cfg, hf = read_config(d), read(d, "config.json")
    assert "mask_token_id" not in hf and hf["model_type"] == "llada" and cfg.arch == "lladamoe"
    assert cfg.mask_id == 156895 and Chat(d, cfg).stop_ids == {156892, ROLE_END}


def test_the_thinking_switch_follows_the_template(releases, tmp_path):
    """The switch that ends Ling's system turn is the template's own ("on" stays on); a Ling template without
    one is refused in one line rather than rendered by a guess."""
    d = str(tmp_path / "on")
    shutil.copytree(releases[MOE[1]], d)
    config = read(d, "tokenizer_config.json")
    config["chat_template"] = config["chat_template"].replace("thinking_option = 'off'", "thinking_option = 'on'")
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    assert Chat(d, read_config(d)).render([{"role": "user", "content": "x"}]).startswith(
        "<role>SYSTEM</role>detailed thinking on<|role_end|><role>HUMAN</role>x")
    config["chat_template"] = config["chat_template"].replace("'detailed thinking ' + thinking_option + ", "")
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    one_line_error(cli_here("--model", d, "--prompt", "x", *FLAGS), "detailed thinking", "--no-chat")
    assert cli_here("--model", d, "--prompt", "x", "--no-chat", *FLAGS).returncode == 0


def test_lladamoe_multi_turn_renders_the_whole_conversation(releases, monkeypatch, capsys):
    """--interactive on LLaDA-MoE: the second prompt is the whole conversation in Ling's format (LLaDA's rule of
    keeping the ids and appending the new turn without its bos is LLaDA's header format's only)."""
    import io
    d = releases[MOE[1]]
    chat, calls, real = Chat(d, read_config(d)), [], cli.generate

    def recording(model, prompt, **kw):
        x, stats = real(model, prompt, **kw)
        calls.append((prompt[0].tolist(), x[0].tolist()))
        return x, stats
    monkeypatch.setattr(cli, "generate", recording)
    monkeypatch.setattr("sys.stdin", io.StringIO("the cat\nexit\n"))
    assert cli.main(["--model", d, "--interactive", "--prompt", "a", *FLAGS]) is None
    (first, out), (second, _) = calls
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": chat.answer(out[len(first):])},
             {"role": "user", "content": "the cat"}]
    assert first == chat.encode(chat.render(turns[:1])) and second == chat.encode(chat.render(turns))
    assert capsys.readouterr().out.count("NFE ") == 2
