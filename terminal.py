"""
terminal.py: what the command line shows and reads on a terminal while it decodes: the answer printed as it is
decided (streamer), the per-step trace (--trace, render_trace), --prompt-file's lines and --interactive's turns, each
refused in one line when it is not UTF-8 text (check_text). The text itself comes from chat.Chat.
"""
import sys

from chat import decode


def render_trace(steps: list[list[int]], tok, mask_id: int, end_ids: set[int]) -> list[str]:
    """The decoding trace, one line per step: the answer canvas after that step, with `_` = still masked,
    `$` = an end token, `[x]` = unmasked at this step. steps: the answer region's ids after each step."""
    lines, prev = [], [mask_id] * len(steps[0] if steps else [])
    for n, row in enumerate(steps, 1):
        cells = []
        for t, old in zip(row, prev):
            # A token shows as its text (" the" keeps its space); repr keeps a newline or tab inside the cell.
            s = ("_" if t == mask_id else "$" if t in end_ids else
                 repr(decode(tok, [t], skip_special_tokens=False))[1:-1])
            cells.append(f"[{s}]" if t != old else s)
        lines.append(f"step {n:2d} | {' '.join(cells)}")
        prev = row
    return lines


def read_prompts(path: str) -> list[str]:
    """--prompt-file's lines, each a prompt; a blank line stays in its place as "" (its answer is an empty line,
    so that answer N is on output line N), blank lines at the end are dropped. Read by parse_args: its errors
    come before any model."""
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.strip() for line in f]
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {path} is not valid UTF-8 text ({e.reason} at byte {e.start}): "
                         f"convert it (e.g. with iconv)") from None
    except OSError as e:   # missing, a folder, no permission
        raise ValueError(f"cannot read --prompt-file {path}: {e.strerror or e}") from None
    while prompts and not prompts[-1]:
        prompts.pop()
    if not prompts:
        raise ValueError(f"--prompt-file {path} has no prompt: write one prompt per line")
    return prompts


def check_text(text: str, what: str = "the prompt"):
    # Bytes that are not UTF-8 reach us as lone surrogates (Python's surrogateescape on argv, and on stdin
    # in a C locale), which the tokenizer refuses with a TypeError.
    if not text.isascii() and any(0xDC80 <= ord(c) <= 0xDCFF for c in text):
        raise ValueError(f"{what} is not valid UTF-8 text: pass UTF-8 (convert it with e.g. iconv)")


def streamer(chat, P: int, mask_id: int):
    """on_step for the CLI: print the answer as it is decided: up to the first still-masked position, and (a rule
    that edits) the blocks that have ended (stats["final"])."""
    new_text = chat.stream()

    def on_step(x, stats):
        row = x[0, P:].tolist()
        final = min(row.index(mask_id) if mask_id in row else len(row), stats["final"][0])
        print(new_text(row[:final], final=final == len(row)), end="", flush=True)
    return on_step


def read_turns(first: str | None = None):
    """--interactive's questions: `first` (--prompt) if given, then stdin's until its end (Ctrl-D) or exit /
    quit; an empty line asks again."""
    if first:
        print(f"user> {first}")
        yield first
    while (text := read_turn()) not in (None, "exit", "quit"):
        if text:
            yield text


def read_turn() -> str | None:
    """One --interactive question from stdin; None at its end (Ctrl-D, or the end of piped input). From a
    pipe nothing echoes the line, so it is printed here: "assistant> " then starts a line of its own."""
    try:
        text = input("user> ").strip()
    except EOFError:
        print()
        return None
    except UnicodeDecodeError:   # a strict UTF-8 stdin (a lenient one gives surrogates: check_text)
        raise ValueError("the input is not valid UTF-8 text: pass UTF-8 (convert it with e.g. iconv)") from None
    except BrokenPipeError:   # stdout closed while "user> " was written: fastdllm.py's __main__ ends quietly
        raise
    except (OSError, RuntimeError):   # stdin closed (`<&-`): "input(): lost sys.stdin", or EBADF
        raise ValueError("--interactive reads questions from stdin, which is closed: run it in a terminal or "
                         "pipe the questions in") from None
    check_text(text, "the input")
    if not sys.stdin.isatty():
        print(text)
    return text
