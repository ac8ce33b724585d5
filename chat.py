"""
chat.py: text <-> token ids for the CLI: the checkpoint's tokenizer through `tokenizers`, and each family's
chat template, written out here from the models' tokenizer_config.json templates (no `transformers`).
generate() works on ids and never needs this file.
"""
import os


class Chat:
    """tokenizer.json through `tokenizers`, plus each family's chat template. Special ids are looked up in
    the checkpoint's own tokenizer, never hard-coded."""

    def __init__(self, model_dir: str, cfg, chat: bool = True):
        from tokenizers import Tokenizer
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: the CLI needs the model's tokenizer.json "
                                    f"(the Python API generate() works on ids without it)")
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception with the serde error
            raise ValueError(f"{path} is not a readable tokenizer.json ({e}): re-download it") from None
        self.family = cfg.family
        header = "<|start_header_id|>" if cfg.family == "llada" else "<|im_start|>"
        # A tokenizer without the chat tokens (our demo model) gets the raw prompt.
        self.chat = chat and self.tok.token_to_id(header) is not None
        ends = ("<|eot_id|>", "<|im_end|>", "<|endoftext|>")
        self.stop_ids = {cfg.eos_id} | {self.tok.token_to_id(t) for t in ends} - {None}

    def render(self, messages: list[dict]) -> str:
        if not self.chat:
            return "\n".join(m["content"] for m in messages if m["role"] == "user")
        if self.family == "llada":
            # LLaDA-8B-Instruct: bos, then header/content/<|eot_id|> per message; the assistant header is
            # always appended (its template ignores add_generation_prompt).
            turns = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
                            for m in messages)
            return "<|startoftext|>" + turns + "<|start_header_id|>assistant<|end_header_id|>\n\n"
        # Dream-v0-Instruct: Qwen2.5's template with its default system prompt.
        if messages[0]["role"] != "system":
            messages = [{"role": "system", "content": "You are a helpful assistant."}] + messages
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return turns + "<|im_start|>assistant\n"

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def answer(self, ids: list[int]) -> str:
        """The answer text: cut at the first end-of-turn / end-of-text token, specials dropped."""
        cut = next((i for i, t in enumerate(ids) if t in self.stop_ids), len(ids))
        return self.tok.decode(ids[:cut], skip_special_tokens=True).strip()
