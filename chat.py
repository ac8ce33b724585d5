"""
chat.py: text <-> token ids for the CLI: the checkpoint's tokenizer through `tokenizers`, its chat template (the
three formats of the released checkpoints, LLaDA's headers, Qwen's ChatML and Ling's role tags, written out here;
the checkpoint's own template text says which, and its default system prompt: no `transformers`, no jinja), its
end tokens from its own files, two views of an answer while it is being decoded (the per-step trace and the
block-by-block stream), and --interactive's turns, read from stdin.
generate() works on ids and never needs this file; the command line's own helpers are cli.py's.

LLaDA ships a tokenizer.json. Dream ships none: only Qwen2's "slow" files (vocab.json, merges.txt, the added
tokens in tokenizer_config.json) and its own Python tokenizer class, so `qwen2_tokenizer` builds from them the
tokenizer that HF's Qwen2TokenizerFast would (transformers' Qwen2Converter), with the same ids.
"""
import json
import os
import re


# Qwen2's pre-tokenizer split. Unlike GPT-4's it takes digits one at a time (\p{N}, not \p{N}{1,3}), so a
# number is always one token per digit, whatever merges.txt says.
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def read_json(path: str, default=None):
    """The file's JSON, or `default` when there is no such file."""
    if not os.path.isfile(path):
        return default
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): re-download it") from None


def read_object(model_dir: str, name: str) -> dict:
    """A small JSON file of the checkpoint that holds one object ({} when there is no such file)."""
    obj = read_json(os.path.join(model_dir, name), {})
    if not isinstance(obj, dict):
        raise ValueError(f"{os.path.join(model_dir, name)} is not a JSON object: re-download it")
    return obj


def load_tokenizer(model_dir: str):
    """The model's tokenizer.json, or else the tokenizer its vocab.json + merges.txt describe."""
    from tokenizers import Tokenizer
    path = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(path):
        try:
            return Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception with the serde error
            raise ValueError(f"{path} is not a readable tokenizer.json ({e}): re-download it") from None
    if os.path.isfile(os.path.join(model_dir, "vocab.json")) and os.path.isfile(os.path.join(model_dir, "merges.txt")):
        return qwen2_tokenizer(model_dir)
    raise FileNotFoundError(f"{path} is missing: the CLI needs the model's tokenizer, and {model_dir} has no "
                            f"tokenizer.json, nor vocab.json + merges.txt: re-download the model folder (the Python "
                            f"API generate() works on ids without it)")


def added_tokens(model_dir: str) -> dict:
    """{id: AddedToken}: tokenizer_config.json's added_tokens_decoder with its flags, plus any token that only
    the older added_tokens.json lists (special if special_tokens_map.json names it, as transformers does)."""
    from tokenizers import AddedToken
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    config, names, legacy = (read_json(os.path.join(model_dir, name), {}) for name in
                             ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"))
    try:
        flags = ("single_word", "lstrip", "rstrip", "normalized", "special")
        added = {int(i): AddedToken(t["content"], **{k: bool(t[k]) for k in flags if k in t})
                 for i, t in config.get("added_tokens_decoder", {}).items()}
        named = set()   # special_tokens_map.json: {"eos_token": "..." or {"content": ...}, "additional_...": [...]}
        for v in names.values():
            named |= {t["content"] if isinstance(t, dict) else t for t in (v if isinstance(v, list) else [v])}
        legacy = {int(i): content for content, i in legacy.items()}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{config_path}, special_tokens_map.json or added_tokens.json is malformed "
                         f"({type(e).__name__}: {e}): re-download the tokenizer files") from None
    for i, content in legacy.items():
        special = content in named
        if added.setdefault(i, AddedToken(content, special=special, normalized=not special)).content != content:
            raise ValueError(f"added_tokens.json puts {content!r} at id {i}, where {config_path} has "
                             f"{added[i].content!r}: re-download the tokenizer files")
    return added


def qwen2_tokenizer(model_dir: str):
    """Byte-level BPE from vocab.json + merges.txt (no unknown token: every byte is in the vocab), NFC,
    Qwen2's split, the ByteLevel decoder, and the added tokens at their ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    vocab_path, merges_path = os.path.join(model_dir, "vocab.json"), os.path.join(model_dir, "merges.txt")
    vocab = read_json(vocab_path)
    if not isinstance(vocab, dict):
        raise ValueError(f"{vocab_path} is not a token -> id object: re-download it")
    try:
        with open(merges_path, encoding="utf-8") as f:
            # As the slow tokenizer reads it: an optional "#version: ..." first line, then "left right" per line.
            merges = [line.split() for i, line in enumerate(f)
                      if line.strip() and not (i == 0 and line.startswith("#version"))]
    except UnicodeDecodeError as e:
        raise ValueError(f"{merges_path} is not UTF-8 text ({e}): re-download it") from None
    bad = next((m for m in merges if len(m) != 2), None)
    if bad is not None:
        raise ValueError(f"{merges_path} has the line {' '.join(bad)!r}, not two tokens: re-download it")
    # `tokenizers` gives a new added token the next free id, not the id it was saved with, but keeps the id of a
    # token the model's vocab already has. So each added token goes into the BPE vocab at its own id first (no
    # merge produces it, so BPE never emits it); registering it below then keeps that id, gaps or not.
    added = added_tokens(model_dir)
    owner = {i: t for t, i in vocab.items()}
    for i, t in added.items():
        if vocab.get(t.content, i) != i or owner.get(i, t.content) != t.content:
            raise ValueError(f"{model_dir}: the added token {t.content!r} (id {i}) clashes with vocab.json "
                             f"({t.content!r} -> {vocab.get(t.content)}, id {i} -> {owner.get(i)!r}): "
                             f"re-download the tokenizer files")
        vocab[t.content] = i
    try:
        tok = Tokenizer(models.BPE(vocab, [tuple(m) for m in merges], unk_token=None))
    except Exception as e:  # e.g. a merge of a token vocab.json lacks
        raise ValueError(f"{vocab_path} and {merges_path} do not fit together ({e}): re-download them") from None
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        # Bytes -> the 256 printable stand-ins the vocab is written in; no GPT-2 regex: the split above replaces it.
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)   # offsets only; ids are unaffected
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([added[i] for i in sorted(added)])   # keeps each one's `special` flag
    return tok


def decode(tok, ids: list[int], skip_special_tokens: bool = True) -> str:
    """tok.decode, except that an id the tokenizer has no token for shows as <unk:ID>. Dream's head has more
    rows (152,064) than its tokenizer has tokens (151,667); `tokenizers` would drop such ids silently (and
    Dream's own tokenizer crashes on them, DreamLM/Dream#54)."""
    text, run = "", []
    for t in ids:
        if tok.id_to_token(t) is None:
            text += tok.decode(run, skip_special_tokens=skip_special_tokens) + f"<unk:{t}>"
            run = []
        else:
            run.append(t)
    return text + tok.decode(run, skip_special_tokens=skip_special_tokens)


# ----------------------------------------------------------------------------------------------------------
# Chat templates and special ids, from the checkpoint's own files (docs/models.md: each checkpoint's facts)

# The chat formats of the released checkpoints, written out in Chat.render: LLaDA's Llama-3-style headers
# (LLaDA-8B-Instruct, LLaDA-1.5), Qwen's ChatML (Dream-v0, Dream-Coder, DiffuCoder), the role tags of Ant's
# Ling 2.0 tokenizer (LLaDA-MoE: docs/models.md says what is known of its template) and Gemma 4's turns
# (DiffusionGemma; docs/diffusiongemma.md). Each is named by its turn markers; the last one ends an assistant turn.
STYLES = {"llada": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "chatml": ("<|im_start|>", "<|im_end|>"),
          "ling": ("<role>", "</role>", "<|role_end|>"), "gemma4": ("<|turn>", "<turn|>")}
# A ChatML template's default system prompt is one string literal: '<|im_start|>system\n' + text + '<|im_end|>'.
DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system(?:\\n|\n)((?:[^'\"\\<]|\\.)*)<\|im_end\|>")
# A Ling template ends its system turn with a thinking switch: the literal 'detailed thinking off', or
# 'detailed thinking ' + thinking_option after {% set thinking_option = 'off' %}.
THINKING = re.compile(r"""detailed thinking (?:(on|off)\b|['"]\s*\+\s*thinking_option)""")
THINKING_OPTION = re.compile(r"""set\s+thinking_option\s*=\s*['"](on|off)['"]""")
# A Gemma 4 template that, with thinking off (its default), opens the answer with an empty, closed thought channel
# (the larger Gemma 4 checkpoints' templates do; the E-series' do not): the literal '<|channel>thought\n<channel|>'.
NO_THINKING = "<|channel>thought\n<channel|>"


def chat_template(model_dir: str) -> str | None:
    """The checkpoint's chat template text: chat_template.jinja (newer transformers save it there: DiffuCoder), else
    tokenizer_config.json's "chat_template" (a string, or a list of named ones: "default"); None if neither."""
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text ({e.reason}): re-download it") from None
    text = read_object(model_dir, "tokenizer_config.json").get("chat_template")
    if isinstance(text, list):
        text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
    return text if isinstance(text, str) else None


def template_style(text: str) -> str | None:
    """Which written-out format a template is: the one whose every turn marker it uses, and no other's."""
    styles = [name for name, markers in STYLES.items() if all(m in text for m in markers)]
    return styles[0] if len(styles) == 1 else None


def default_system(text: str) -> str | None:
    """The system prompt a ChatML template adds when the conversation has none (None: it adds none). It is the
    template's own literal (a jinja string: backslash escapes), so a checkpoint's own wording is kept."""
    found = {re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], s) for s in DEFAULT_SYSTEM.findall(text)}
    if len(found) > 1:
        raise ValueError(f"names {len(found)} different default system prompts")
    return found.pop() if found else None


def thinking_line(text: str) -> str:
    """The line a Ling template writes at the end of its system turn ("detailed thinking off"): the template's own
    switch, so a checkpoint that thinks by default keeps it. A template without one, or with two, is refused."""
    options = THINKING_OPTION.findall(text)
    found = {m[1] or (options[0] if len(options) == 1 else None) for m in THINKING.finditer(text)}
    if len(found) != 1 or None in found:
        raise ValueError("has no single 'detailed thinking on|off' switch, which fastdllm's written-out Ling format "
                         "ends the system turn with")
    return f"detailed thinking {found.pop()}"


def token_name(value) -> str | None:
    """A tokenizer file's special token entry: "<|x|>" or {"content": "<|x|>", ...} (None if absent)."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def id_list(value) -> list:
    return [i for i in (value if isinstance(value, list) else [value]) if type(i) is int]


class Chat:
    """The model's tokenizer, its chat template and its end tokens. The template's format is written out in
    render(); which one, its default system prompt and its bos come from the checkpoint's own template text
    (chat_template()). Special ids are looked up in the checkpoint's own files, never hard-coded:
    stop_ids = config.json's and generation_config.json's eos ids, the tokenizer's eos and pad tokens (the pad a
    fixed-length-trained model writes after its answer: DiffuCoder's <|dlm_pad|>), and the template's end of turn.
    family: whose multi-turn rule the CLI follows; "llada" (keep the ids, LLaDA's chat.py) only for LLaDA's own
    header format, so LLaDA-MoE (the llada decoding family, Ling's format) re-renders the conversation instead."""

    def __init__(self, model_dir: str, cfg, chat: bool = True):
        self.tok = load_tokenizer(model_dir)
        names = {**read_object(model_dir, "special_tokens_map.json"), **read_object(model_dir, "tokenizer_config.json")}
        text = chat_template(model_dir)
        if text is None:
            # A folder without a template (our test fixtures, the demo): the family's format as LLaDA-8B-Instruct's
            # and Dream-v0-Instruct's templates write it, used when the tokenizer has its markers.
            self.style = {"llada": "llada", "diffusion_gemma": "gemma4"}.get(cfg.family, "chatml")
            self.system = None if self.style != "chatml" else "You are a helpful assistant."
            self.bos = {"llada": "<|startoftext|>", "gemma4": "<bos>"}.get(self.style, "")
            self.no_thinking = ""
        else:
            where = f"{model_dir}: its chat template"
            self.style = template_style(text)
            if self.style is None and chat:
                raise ValueError(f"{where} is neither LLaDA's (<|start_header_id|> ... <|eot_id|>), ChatML "
                                 f"(<|im_start|> ... <|im_end|>), Ling's (<role>HUMAN</role> ... <|role_end|>) nor "
                                 f"Gemma 4's (<|turn> ... <turn|>), the four fastdllm writes out: pass --no-chat to "
                                 f"send the raw prompt")
            try:   # ChatML: its default system prompt; Ling: the thinking switch that ends its system turn
                self.system = (None if not chat else default_system(text) if self.style == "chatml" else
                               thinking_line(text) if self.style == "ling" else None)
            except ValueError as e:
                raise ValueError(f"{where} {e}: pass --no-chat to send the raw prompt") from None
            self.bos = (token_name(names.get("bos_token")) or "") if "bos_token" in text else ""
            # The jinja source spells the newline as a backslash and an n.
            self.no_thinking = NO_THINKING if NO_THINKING.replace("\n", "\\n") in text else ""
        markers = STYLES.get(self.style, ())
        present = [self.tok.token_to_id(m) is not None for m in markers]
        if text is not None and chat and not all(present):
            missing = next(m for m, ok in zip(markers, present) if not ok)
            raise ValueError(f"{model_dir}: its chat template uses {missing}, which its tokenizer lacks: re-download "
                             f"the tokenizer files, or pass --no-chat")
        # A tokenizer without the chat tokens (our demo model) gets the raw prompt.
        self.chat = chat and bool(markers) and all(present)
        self.family = cfg.family if self.style != "ling" else cfg.arch
        generation = read_object(model_dir, "generation_config.json")
        ends = [token_name(names.get("eos_token")), token_name(names.get("pad_token"))] + list(markers[-1:])
        self.stop_ids = (set(cfg.eos_ids) | set(id_list(generation.get("eos_token_id")))
                         | {self.tok.token_to_id(t) for t in ends if t}) - {None, cfg.mask_id}

    def render(self, messages: list[dict]) -> str:
        if not self.chat:
            return "\n".join(m["content"] for m in messages if m["role"] == "user")
        if self.style == "llada":
            # LLaDA-8B-Instruct, LLaDA-1.5: bos, then header/content/<|eot_id|> per message; the assistant header is
            # always appended (the template ignores add_generation_prompt).
            turns = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
                            for m in messages)
            return self.bos + turns + "<|start_header_id|>assistant<|end_header_id|>\n\n"
        if self.style == "ling":
            return self.render_ling(messages)
        if self.style == "gemma4":
            # Gemma 4's turns (DiffusionGemma), as its template writes a conversation of text without tools: bos,
            # <|turn>role\n + the content trimmed + <turn|>\n per message (assistant -> model, its thought channels
            # dropped), then <|turn>model\n, and the empty thought channel when the template pre-seeds one.
            def content(m):
                text = m["content"] if m["role"] != "assistant" else re.sub(r"<\|channel>.*?<channel\|>", "",
                                                                            m["content"], flags=re.S)
                return text.strip()
            turns = "".join(f"<|turn>{'model' if m['role'] == 'assistant' else m['role']}\n{content(m)}<turn|>\n"
                            for m in messages)
            return self.bos + turns + "<|turn>model\n" + self.no_thinking
        # ChatML (Qwen2.5: Dream, Dream-Coder, DiffuCoder): the template's default system prompt when none is given.
        if self.system is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system}] + messages
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return turns + "<|im_start|>assistant\n"

    def render_ling(self, messages: list[dict]) -> str:
        """Ling's format (LLaDA-MoE), as its template writes a conversation without tool calls: one system turn
        that holds the first system message (if any) + a newline, then the thinking switch; per message
        <role>HUMAN</role>, <role>ASSISTANT</role> or (a later) <role>SYSTEM</role> + content + <|role_end|>, contents
        untrimmed, and a run of tool results as one <role>OBSERVATION</role> turn; then <role>ASSISTANT</role>. An
        assistant turn keeps its text after a </think>; after the last user question its reasoning stays too."""
        def is_question(m):
            c = m["content"]
            return m["role"] == "user" and not (c.startswith("<tool_response>") and c.endswith("</tool_response>"))
        last_question = next((i for i in reversed(range(len(messages))) if is_question(messages[i])),
                             len(messages) - 1)
        system = messages[0]["content"] + "\n" if messages[0]["role"] == "system" else ""
        out = f"<role>SYSTEM</role>{system}{self.system}<|role_end|>"
        for i, m in enumerate(messages):
            role, content = m["role"], m["content"]
            if role == "user" or role == "system" and i > 0:
                out += f"<role>{'HUMAN' if role == 'user' else 'SYSTEM'}</role>{content}<|role_end|>"
            elif role == "assistant":
                if "</think>" in content:
                    thought, content = content.split("</think>")[0], content.split("</think>")[-1].lstrip("\n")
                    thought = thought.rstrip("\n").split("<think>")[-1].lstrip("\n").strip("\n")
                    if i > last_question and thought:
                        content = f"\n<think>\n{thought}\n</think>\n\n{content}"
                out += f"<role>ASSISTANT</role>{content}<|role_end|>"
            elif role == "tool":
                first = i == 0 or messages[i - 1]["role"] != "tool"
                last = i == len(messages) - 1 or messages[i + 1]["role"] != "tool"
                out += ("<role>OBSERVATION</role>" if first else "") + "\n<tool_response>\n" + content
                out += "\n</tool_response>" + ("<|role_end|>" if last else "")
        return out + "<role>ASSISTANT</role>"

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def answer(self, ids: list[int]) -> str:
        """The answer text: cut at the first end-of-turn / end-of-text token, specials dropped."""
        cut = next((i for i, t in enumerate(ids) if t in self.stop_ids), len(ids))
        return decode(self.tok, ids[:cut]).strip()

    def stream(self):
        """For printing an answer while it is decoded, block by block. Returns new_text(decided, final=False):
        call it with the answer's decided ids (those before its first still-masked position) as they grow; it
        returns the text added since its last call. The pieces add up to answer(ids): pass final=True on the
        last call, unless the decided ids already hold an end token."""
        shown = ""

        def new_text(decided: list[int], final: bool = False) -> str:
            nonlocal shown
            text = self.answer(decided)
            if not final and not any(t in self.stop_ids for t in decided):
                # Hold back what may still change: the replacement char of a multi-byte character whose
                # remaining bytes are in tokens not decided yet, and whitespace answer() would strip at the end.
                # Decided tokens never change, so what is left is a prefix of every later text.
                text = re.sub(r"[\s\ufffd]+$", "", text)
            piece, shown = text[len(shown):], text
            return piece

        return new_text
