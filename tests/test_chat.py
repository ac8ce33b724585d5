"""
chat.py: Dream's tokenizer built from its slow-tokenizer files (it ships no tokenizer.json), the chat templates,
the decoding trace and the answer stream. The tokenizer folder is written into tmp_path: a byte-level vocab
(token id = byte value for the 256 single bytes), a few merges, and Dream's real added tokens at their real ids.
CPU only, no network.
"""
import json
import os
import random
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from chat import Chat, chat_template, default_system, template_style, thinking_line
from terminal import render_trace
from model import ModelConfig

# Qwen2.5's added tokens (ids 151643..151664, the tool/fim/repo ones not special) and Dream's two (151665, 151666).
QWEN_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
              "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
              "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
              "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
ADDED = QWEN_ADDED + ["<|beginoftext|>", "<|mask|>"]
NOT_SPECIAL = set(QWEN_ADDED[14:])
EOS, IM_START, IM_END, MASK = 151643, 151644, 151645, 151666
# Ranked merges. "1 2" and "Ġ 1" must never apply (Qwen2 splits digits one by one, without a leading space).
# "!Ċ" forms only if the pre-tokenizer keeps newlines with the punctuation before them, as Qwen2's does.
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ã", "©"), ("!", "Ċ"), ("Ċ", "Ċ"), ("Ġ", "Ġ"), ("1", "2"),
          ("Ġ", "1")]
DREAM = ModelConfig(family="dream", vocab_size=152064, mask_id=MASK, eos_id=EOS, bos_id=EOS, pad_id=EOS)


def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet, in byte order: printable bytes stand for themselves, the others for
    chr(256 + n) (space -> "Ġ", newline -> "Ċ")."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


def base_vocab() -> dict:
    vocab = {c: b for b, c in enumerate(byte_chars())}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    return vocab


def write_slow_tokenizer(d, first_added=EOS, in_config=ADDED) -> str:
    """Dream's tokenizer file set: vocab.json, merges.txt (with its #version line), tokenizer_config.json (the
    added tokens of `in_config` in added_tokens_decoder), added_tokens.json (all), special_tokens_map.json."""
    os.makedirs(d, exist_ok=True)
    ids = {t: first_added + k for k, t in enumerate(ADDED)}
    entry = lambda t: dict(content=t, lstrip=False, normalized=False, rstrip=False, single_word=False,
                           special=t not in NOT_SPECIAL)
    files = {
        "vocab.json": base_vocab(),
        "tokenizer_config.json": {"added_tokens_decoder": {str(ids[t]): entry(t) for t in in_config},
                                  "bos_token": "<|beginoftext|>", "eos_token": "<|endoftext|>",
                                  "pad_token": "<|endoftext|>", "tokenizer_class": "DreamTokenizer"},
        "added_tokens.json": ids,
        "special_tokens_map.json": {"additional_special_tokens": QWEN_ADDED[1:14], "mask_token": "<|mask|>",
                                    "bos_token": entry("<|beginoftext|>"), "eos_token": entry("<|endoftext|>"),
                                    "pad_token": entry("<|endoftext|>")},
    }
    for name, obj in files.items():
        with open(os.path.join(d, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False)
    with open(os.path.join(d, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES))
    return str(d)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return Chat(write_slow_tokenizer(tmp_path_factory.mktemp("dream")), DREAM)


def tokens(chat, text):
    return [chat.tok.id_to_token(i) for i in chat.encode(text)]


def as_bytes(s: str) -> list[str]:
    """The single-byte tokens of s's UTF-8 bytes."""
    return [byte_chars()[b] for b in s.encode()]


@pytest.mark.parametrize("text,expected", [
    ("the the", ["t", "he", "Ġthe"]),               # merges apply in rank order, within a pre-token
    ("x 123", ["x", "Ġ", "1", "2", "3"]),           # digits one by one, the space apart: "12", "Ġ1" never form
    ("café", ["c", "a", "f", "Ã©"]),                # é = C3 A9, merged
    ("cafe\u0301", ["c", "a", "f", "Ã©"]),          # NFC first: e + combining acute = é
    ("中文", as_bytes("中文")),                       # 3 bytes each, no merges
    ("😀!", as_bytes("😀!")),
    ("a\n\nb", ["a", "ĊĊ", "b"]),                   # a newline run is its own pre-token
    ("Hi!\n\n", ["H", "i", "!Ċ", "Ċ"]),             # punctuation takes the newlines after it
    ("a   b", ["a", "ĠĠ", "Ġ", "b"]),               # whitespace run: all but the last space, then " b"
    ("IT'S", ["I", "T", "'", "S"]),
])
def test_slow_tokenizer_pieces(chat, text, expected):
    assert tokens(chat, text) == expected


def test_slow_tokenizer_ids(chat):
    vocab = base_vocab()
    assert chat.encode(" the 中") == [vocab["Ġthe"], 0x20, 0xE4, 0xB8, 0xAD]
    # Chat markers and Dream's mask are single ids at their real ids, also glued to text.
    assert chat.encode("<|im_start|>user\nhi<|im_end|>") == [IM_START, *b"user\nhi", IM_END]
    assert chat.encode("x<|mask|><|endoftext|>") == [ord("x"), MASK, EOS]
    assert chat.tok.token_to_id("<|beginoftext|>") == 151665 and chat.tok.id_to_token(151664) == "<|file_sep|>"
    specials = {int(i) for i, t in chat.tok.get_added_tokens_decoder().items() if t.special}
    assert specials == set(range(151643, 151657)) | {151665, 151666}


@pytest.mark.parametrize("text", ["the the", "x 123", "café 中文 😀", "a\n\n  b\t\r\n c  ", "IT'S don't",
                                  "<|im_start|>user\nhi<|im_end|>\n<tool_call>{}</tool_call>"])
def test_decode_encode_roundtrip(chat, text):
    assert chat.tok.decode(chat.encode(text), skip_special_tokens=False) == text


def test_dream_chat_template(chat):
    """docs/official.md 3: Qwen2.5's template with the default system prompt; answers end at eos or
    <|im_end|>."""
    prompt = chat.render([{"role": "user", "content": "Hi"}])
    assert prompt == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                      "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = chat.encode(prompt)
    assert chat.chat and ids.count(IM_START) == 3 and ids.count(IM_END) == 2
    assert ids[-11:] == [IM_START, *b"assistant\n"] and chat.stop_ids == {EOS, IM_END}
    assert chat.answer(chat.encode(" the end<|im_end|>\n<|endoftext|> junk")) == "the end"


def test_unknown_ids_decode_to_a_placeholder(chat):
    """Dream's head has rows past the tokenizer's last id (DreamLM/Dream#54): they show as <unk:ID>."""
    the = base_vocab()["Ġthe"]
    assert chat.tok.id_to_token(151700) is None
    assert chat.answer([ord("a"), 151700, the, 999_999, EOS, 151701]) == "a<unk:151700> the<unk:999999>"
    assert render_trace([[MASK, 151700]], chat.tok, MASK, chat.stop_ids) == ["step  1 | _ [<unk:151700>]"]


def test_added_tokens_json_alone(tmp_path):
    """A token only added_tokens.json lists still gets its id; special_tokens_map.json makes it special."""
    chat = Chat(write_slow_tokenizer(tmp_path, in_config=ADDED[:-1]), DREAM)
    assert chat.encode("a<|mask|>") == [ord("a"), MASK]
    assert chat.answer([ord("a"), MASK, ord("b")]) == "ab"


def test_matches_qwen2_tokenizer_json(tmp_path):
    """Cross-check against the layout HF's Qwen2TokenizerFast saves as tokenizer.json (as in Qwen's own
    repos), loaded by `tokenizers` itself. Its added tokens get consecutive ids after the vocab, so here both
    sides use that dense layout."""
    d = write_slow_tokenizer(tmp_path, first_added=len(base_vocab()))
    ours = Chat(d, DREAM).tok
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+")
    hf = {"version": "1.0", "truncation": None, "padding": None,
          "added_tokens": [dict(id=len(base_vocab()) + k, content=t, single_word=False, lstrip=False, rstrip=False,
                                normalized=False, special=t not in NOT_SPECIAL) for k, t in enumerate(ADDED)],
          "normalizer": {"type": "NFC"},
          "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
              {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False}, byte_level]},
          "post_processor": byte_level, "decoder": byte_level,
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                    "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                    "vocab": base_vocab(), "merges": [f"{a} {b}" for a, b in MERGES]}}
    from tokenizers import Tokenizer
    ref = Tokenizer.from_str(json.dumps(hf))
    rng = random.Random(0)
    alphabet = list("the 12 aT'sS'LL\n\r\t!?.,-_é中😀\u00a0\u3000") + ["<|im_start|>", "<|mask|>", "<tool_call>"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(300)]
    for text in texts:
        ids = ref.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False).ids == ids, repr(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_render_trace(chat):
    the = base_vocab()["Ġthe"]
    steps = [[MASK, MASK, MASK, MASK], [MASK, the, MASK, MASK], [ord("\n"), the, EOS, MASK],
             [ord("\n"), the, EOS, EOS]]
    assert render_trace(steps, chat.tok, MASK, chat.stop_ids) == [
        "step  1 | _ _ _ _",
        "step  2 | _ [ the] _ _",
        "step  3 | [\\n]  the [$] _",
        "step  4 | \\n  the $ [$]",
    ]
    assert render_trace([], chat.tok, MASK, chat.stop_ids) == []


def test_demo_trace_uses_render_trace(monkeypatch, capsys):
    """demo/eval.py --trace prints what terminal.render_trace returns, for the steps generate() took."""
    sys.path.insert(0, os.path.join(ROOT, "demo"))
    import eval as demo_eval
    import torch
    from model import load_model
    from tokenizers import Tokenizer
    calls = []
    monkeypatch.setattr(demo_eval, "render_trace", lambda steps, *a: calls.append(steps) or ["LINE"] * len(steps))
    shipped = os.path.join(ROOT, "demo", "llada-arith")
    model = load_model(shipped, device="cpu", dtype=torch.float32)
    demo_eval.trace(model, Tokenizer.from_file(os.path.join(shipped, "tokenizer.json")), demo_eval.heldout(1)[0],
                    0.9, "dual")
    out = capsys.readouterr().out
    nfe = int(re.search(r"NFE (\d+)", out)[1])
    assert len(calls) == 1 and len(calls[0]) == nfe and all(len(row) == 32 for row in calls[0])
    assert out.splitlines().count("  LINE") == nfe


@pytest.mark.parametrize("text,final", [("Hi 中文 😀 é!\n\nthe end", False), ("\n  the 12 中", True)])
def test_stream_pieces_add_up_to_the_answer(chat, text, final):
    """Decided prefixes grow one token at a time, so some end inside a multi-byte character: those bytes wait,
    and no piece shows a replacement char. The pieces add up to answer() of the whole canvas."""
    ids = chat.encode(text) + ([] if final else [IM_END, EOS, EOS, 151700])
    new_text = chat.stream()
    pieces = [new_text(ids[:n]) for n in range(len(ids))]
    pieces.append(new_text(ids, final=final))
    assert "".join(pieces) == chat.answer(ids) == text.strip()
    assert not any("\ufffd" in p for p in pieces) and sum(p != "" for p in pieces) > 3
    # Without the hold-back, a prefix that ends inside 中 would show a replacement char.
    assert "\ufffd" in chat.tok.decode(chat.encode("中")[:1])


def test_stream_shows_a_broken_character_once_the_end_is_decided(chat):
    """A character cut short right before the end token stays in the answer (as a replacement char): the stream
    holds it back only while the answer may still go on."""
    ids = chat.encode("ok 中")[:-1] + [IM_END, EOS]
    new_text = chat.stream()
    pieces = [new_text(ids[:n]) for n in range(len(ids) + 1)]
    assert pieces[-3:] == ["", " \ufffd", ""] and "".join(pieces) == chat.answer(ids) == "ok \ufffd"


@pytest.mark.parametrize("edit,error,pattern", [
    (lambda d: [os.remove(os.path.join(d, f)) for f in ("merges.txt",)], FileNotFoundError,
     r"tokenizer\.json is missing: the CLI needs the model's tokenizer, and .* has no tokenizer\.json, "
     r"nor vocab\.json \+ merges\.txt: re-download"),
    (lambda d: open(os.path.join(d, "vocab.json"), "w").write('{"a": '), ValueError,
     r"vocab\.json is not valid JSON .*: re-download it"),
    (lambda d: open(os.path.join(d, "merges.txt"), "a").write("Ġ zz\n"), ValueError,
     r"vocab\.json and .*merges\.txt do not fit together .*: re-download them"),
    (lambda d: open(os.path.join(d, "merges.txt"), "a").write("a b c\n"), ValueError,
     r"merges\.txt has the line 'a b c', not two tokens: re-download it"),
    (lambda d: json.dump({"<|mask|>": 5}, open(os.path.join(d, "added_tokens.json"), "w")), ValueError,
     r"added token '<\|mask\|>' \(id 5\) clashes with vocab\.json .*: re-download the tokenizer files"),
    (lambda d: json.dump({"added_tokens_decoder": {"x": {}}}, open(os.path.join(d, "tokenizer_config.json"), "w")),
     ValueError, r"tokenizer_config\.json, special_tokens_map\.json or added_tokens\.json is malformed"),
])
def test_bad_tokenizer_files(tmp_path, edit, error, pattern):
    d = write_slow_tokenizer(tmp_path)
    edit(d)
    with pytest.raises(error) as e:
        Chat(d, DREAM)
    assert len(str(e.value).splitlines()) == 1 and re.search(pattern, str(e.value)), str(e.value)


def test_hub_download_fetches_dream_tokenizer_files(monkeypatch):
    """resolve_model_dir's allow-list takes Dream's slow-tokenizer files, and never a pickle or code."""
    import fnmatch
    import huggingface_hub
    from model import resolve_model_dir
    seen = {}
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, allow_patterns: seen.update(p=allow_patterns))
    resolve_model_dir("Dream-org/Dream-v0-Instruct-7B")
    allowed = lambda f: any(fnmatch.fnmatchcase(f, p) for p in seen["p"])   # as huggingface_hub filters files
    for f in ("config.json", "model-00001-of-00004.safetensors", "model.safetensors.index.json", "vocab.json",
              "merges.txt", "tokenizer_config.json", "added_tokens.json", "special_tokens_map.json",
              "chat_template.jinja"):      # DiffuCoder keeps its template there
        assert allowed(f), f
    for f in ("pytorch_model.bin", "model.pt", "tokenization_dream.py", "modeling_dream.py", "training_args.pkl"):
        assert not allowed(f), f


def test_cli_runs_a_dream_folder_with_only_the_slow_tokenizer(tmp_path):
    """What Dream-org's repos ship (no tokenizer.json): the CLI builds the tokenizer and answers. The tiny
    Dream checkpoint's ids line up with the real layout: eos 1000 = <|endoftext|>, mask 1023 = <|mask|>."""
    import subprocess
    import sys
    from conftest import ROOT, copy_checkpoint
    d = copy_checkpoint("dream-tiny", tmp_path)
    write_slow_tokenizer(d, first_added=1000)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "fastdllm.py"), "--model", d, "--prompt", "the 12",
                        "--gen-length", "16", "--block-length", "8"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    answer, stats = r.stdout.rstrip("\n").split("\n")[-2:]
    assert stats.startswith("NFE ") and "<unk:" in answer     # the random model writes ids the tokenizer lacks


def test_template_text_is_read_where_the_checkpoint_keeps_it(tmp_path):
    """chat_template.jinja (newer transformers) wins over tokenizer_config.json's "chat_template", which may be a
    string or a list of named templates ("default" is the chat one)."""
    d = write_slow_tokenizer(tmp_path)
    assert chat_template(d) is None
    config_path = os.path.join(d, "tokenizer_config.json")
    config = json.load(open(config_path))
    json.dump({**config, "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default",
                                                                                   "template": "D"}]},
              open(config_path, "w"))
    assert chat_template(d) == "D"
    open(os.path.join(d, "chat_template.jinja"), "w").write("J")
    assert chat_template(d) == "J"


@pytest.mark.parametrize("text,system", [
    ("{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}", "You are a helpful assistant."),
    ("{{ '<|im_start|>system\\nIt\\'s \\\"short\\\".\\nTwo lines.<|im_end|>\\n' }}", "It's \"short\".\nTwo lines."),
    ("{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}", None),    # the caller's own only
])
def test_default_system_prompt_is_the_templates_own_literal(text, system):
    assert template_style(text + "<|im_end|>") == "chatml" and default_system(text) == system


def test_two_default_system_prompts_are_refused(tmp_path):
    d = write_slow_tokenizer(tmp_path)
    open(os.path.join(d, "chat_template.jinja"), "w").write(
        "{{ '<|im_start|>system\\nA<|im_end|>' }}{{ '<|im_start|>system\\nB<|im_end|>' }}")
    with pytest.raises(ValueError, match="names 2 different default system prompts: pass --no-chat"):
        Chat(d, DREAM)
    assert not Chat(d, DREAM, chat=False).chat


LING_TURNS = "{{ '<role>HUMAN</role>' + m.content + '<|role_end|>' }}{{ '<role>ASSISTANT</role>' }}"


@pytest.mark.parametrize("text,line", [
    ("{%- set thinking_option = 'off' %}{{ 'detailed thinking ' + thinking_option + '<|role_end|>' }}",
     "detailed thinking off"),
    ('{% set thinking_option = "on" %}{{ "detailed thinking " + thinking_option }}', "detailed thinking on"),
    ("{{ '<role>SYSTEM</role>detailed thinking on<|role_end|>' }}", "detailed thinking on"),
])
def test_ling_thinking_switch_is_the_templates_own(text, line):
    """Ling's format (LLaDA-MoE) is the template with its three role markers; the switch that ends its system
    turn is read from the template, as a literal or as thinking_option's value."""
    assert template_style(text + LING_TURNS) == "ling" and thinking_line(text + LING_TURNS) == line


@pytest.mark.parametrize("text", [
    LING_TURNS,                                                                          # no switch
    "{{ 'detailed thinking on' }}{{ 'detailed thinking off' }}" + LING_TURNS,          # two
    "{{ 'detailed thinking ' + thinking_option }}" + LING_TURNS,                        # a variable never set
])
def test_a_ling_template_without_one_switch_is_refused(text):
    with pytest.raises(ValueError, match="no single 'detailed thinking on|off' switch"):
        thinking_line(text)


def test_ling_lite_role_tags_without_role_end_are_not_lings_format():
    """Ling-lite's older template (role tags, no <|role_end|>) writes turns differently: not recognised, so it
    is refused (pass --no-chat) rather than rendered in the newer format."""
    lite = ("{% for message in messages %}{{ '<role>' + message['role'] | upper + '</role>' + message['content'] }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<role>ASSISTANT</role>' }}{% endif %}")
    assert template_style(lite) is None and template_style(lite + "<|role_end|>") == "ling"
