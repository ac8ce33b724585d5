"""The command line end to end on the fixture checkpoints, as a user runs it (a subprocess for the headline run,
fastdllm.py's __main__ in this process for the rest; no test-only branch): the same path a GPU user takes with
the real 8B checkpoint, minus the download."""
import io
import os
import subprocess
import sys

import pytest

import bounded
import cli as command_line
from conftest import ROOT, copy_checkpoint, write_tokenizer

LLADA_CHAT = {1000: "<|mdm_mask|>", 1022: "<|endoftext|>", 1019: "<|startoftext|>",
              1020: "<|start_header_id|>", 1021: "<|end_header_id|>", 1023: "<|eot_id|>"}
DREAM_CHAT = {1023: "<|mask|>", 1000: "<|endoftext|>", 1001: "<|im_start|>", 1002: "<|im_end|>"}


def cli_process(*args, stdin=None):
    """`python fastdllm.py ARGS`, as a user runs it."""
    return bounded.run([sys.executable, os.path.join(ROOT, "fastdllm.py"), *args], input=stdin, timeout=120)


def cli(*args, stdin=None):
    """The same as fastdllm.py's __main__ in this process (tests/bounded.py run_main: no torch import a run)."""
    return subprocess.CompletedProcess(args, *bounded.run_main(os.path.join(ROOT, "fastdllm.py"), args, stdin))


@pytest.fixture(scope="module")
def llada_dir(tmp_path_factory):
    d = copy_checkpoint("llada-tiny", tmp_path_factory.mktemp("cli"))
    write_tokenizer(d, LLADA_CHAT)
    return d


@pytest.mark.parametrize("name,specials", [("llada-tiny", LLADA_CHAT), ("dream-tiny", DREAM_CHAT)])
def test_cli_prints_answer_and_stats(tmp_path, name, specials):
    d = copy_checkpoint(name, tmp_path)
    write_tokenizer(d, specials)
    r = cli_process("--model", d, "--prompt", "w5 w6 w7", "--gen-length", "32", "--block-length", "8")
    assert r.returncode == 0, r.stderr
    answer, stats = r.stdout.strip().splitlines()[-2:]
    assert answer.strip() and all(w.startswith("w") for w in answer.split())   # decoded words, specials dropped
    assert stats.startswith("NFE ") and "tokens/s" in stats


def test_cli_modes_and_baseline(llada_dir):
    """--cache none --threshold none is the plain baseline: NFE = steps = gen_length."""
    r = cli("--model", llada_dir, "--prompt", "w1 w2", "--gen-length", "16", "--block-length", "8",
            "--cache", "none", "--threshold", "none")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith("NFE 16 ")


def test_cli_interactive_two_turns(llada_dir):
    r = cli("--model", llada_dir, "--interactive", "--gen-length", "16", "--block-length", "8",
            stdin="w1 w2\nw3\nexit\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("assistant>") == 2 and r.stdout.count("NFE") == 2


def test_cli_checks_settings_before_loading_the_model():
    """A typo in a flag must not cost an 8B load: settings are checked first (the model path here does
    not even exist, and the error is about the flag)."""
    r = cli("--model", "/nonexistent/model", "--prompt", "hi", "--cache", "full")
    assert r.returncode == 2 and "unknown cache mode 'full'" in r.stderr and "Traceback" not in r.stderr


def test_cli_default_gen_length_fits_the_model():
    """The docstring's own example: the demo model has 64 positions, so the default 256 can't fit. Without
    --gen-length it is cut to the largest block multiple that fits, said in one line (here 32, the answer
    length the demo was trained for, so the answer is right); given, it is an error."""
    prompt = "Tom has 23 apples and buys 45 more. How many apples does he have?"
    demo = os.path.join(ROOT, "demo", "llada-arith")
    r = cli("--model", demo, "--prompt", prompt)
    assert r.returncode == 0, r.stderr
    loaded, *notes = r.stderr.strip().splitlines()       # stderr: the load's summary line, then the note
    assert loaded.startswith(f"loaded {demo} in ") and loaded.endswith(" MB)")
    assert notes == [
        "note: the prompt (18 tokens) + gen-length 256 exceed the model's 64 positions: generating 32 tokens "
        "(pass --gen-length to choose)"]
    answer, stats = r.stdout.strip().splitlines()[-2:]
    assert answer == "45 + 23 = 68. The answer is 68." and stats.startswith("NFE ")
    r = cli("--model", demo, "--prompt", prompt, "--gen-length", "256")
    assert r.returncode == 2 and "exceeds the model's 64 positions" in r.stderr


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        command_line.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())     # argparse wraps lines
    for default in ("(default: 256,", "(default: 32;", "(default: dual)", "(default: 0.9;", "(default: 0.0)",
                    "(default: gen-length;", "(default: 0)", "(default: 8)"):
        assert default in text, default
    # It said "for LLaDA and Dream"; a block-diffusion answer is not gen-length tokens: each family's meaning.
    assert all(f in text.split(". The defaults")[0] for f in ("LLaDA,", "LLaDA-MoE", "Dream", "Fast-dLLM v2", "SDAR",
                                                             "LLaDA2.0/2.1"))
    assert ("SDAR to prompt + this rounded up to a block; Fast-dLLM v2 this // block blocks (at least one) after the "
            "prompt's last whole block, plus one token") in text and "LLaDA2 exactly this" in text


def recording_generate(monkeypatch):
    """command_line.generate (fastdllm.generate), recording each call's prompt and keyword arguments."""
    calls, real = [], command_line.generate
    monkeypatch.setattr(command_line, "generate", lambda model, prompt, **kw: calls.append((prompt, kw)) or
                        real(model, prompt, **kw))
    return calls


def test_cli_interactive_without_chat_template_answers_each_question_alone(tmp_path, monkeypatch, capsys):
    """Without a chat template there are no turns to keep: the second prompt is the second question only
    (it used to be every question so far, which filled the demo model's context in ~5 turns)."""
    d = copy_checkpoint("llada-tiny", tmp_path)
    write_tokenizer(d, {1000: "<|mdm_mask|>", 1022: "<|endoftext|>"})     # no chat tokens
    calls = recording_generate(monkeypatch)
    monkeypatch.setattr("sys.stdin", io.StringIO("w1 w2 w3\nw4\nexit\n"))
    command_line.main(["--model", d, "--interactive", "--gen-length", "8", "--block-length", "8"])
    assert [prompt[0].tolist() for prompt, _ in calls] == [[1, 2, 3], [4]]
    assert capsys.readouterr().out.count("assistant>") == 2


DEMO = os.path.join(ROOT, "demo", "llada-arith")
QUESTIONS = ["Tom has 23 apples and buys 45 more. How many apples does he have?",
             "A box has 24 apples. Tom takes 10. How many apples are left?",
             "Sara has 31 pens and finds 17 more. How many pens does she have?"]


def run_main(capsys, *args):
    """main() in this process (no subprocess: these tests only read what it prints)."""
    assert command_line.main(list(args)) is None
    return capsys.readouterr().out.splitlines()


def test_streamed_answer_equals_the_unstreamed_one(capsys):
    """The CLI prints the answer block by block as it is decided; the pieces add up to the final answer."""
    common = ("--model", DEMO, "--gen-length", "32", "--block-length", "8", "--prompt", QUESTIONS[0])
    streamed = run_main(capsys, *common)
    plain = run_main(capsys, *common, "--no-stream")
    assert streamed[0] == plain[0] == "45 + 23 = 68. The answer is 68."
    assert streamed[1].startswith("NFE ")


def test_streaming_prints_pieces_as_steps_decide_them(monkeypatch, capsys):
    pieces = []
    real_print = print
    monkeypatch.setattr("builtins.print", lambda *a, **k: (pieces.append(a[0]) if k.get("end") == "" else None,
                                                          real_print(*a, **k)))
    run_main(capsys, "--model", DEMO, "--gen-length", "32", "--block-length", "8", "--prompt", QUESTIONS[0])
    assert len([p for p in pieces if p]) >= 2 and "".join(pieces) == "45 + 23 = 68. The answer is 68."


def test_early_stop_saves_calls_and_keeps_the_answer(capsys):
    common = ("--model", DEMO, "--gen-length", "40", "--block-length", "8", "--prompt", QUESTIONS[0])
    stop, full = run_main(capsys, *common), run_main(capsys, *common, "--no-early-stop")
    assert stop[0] == full[0]
    nfe = lambda lines: int(lines[1].split()[1])   # noqa: E731
    assert nfe(stop) < nfe(full)


def test_prompt_file_answers_in_input_order(tmp_path, capsys):
    """--prompt-file with --batch-size: left-padded batches, each answer as the single-prompt run gives it."""
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(QUESTIONS) + "\n\n")
    lines = run_main(capsys, "--model", DEMO, "--gen-length", "32", "--block-length", "8",
                     "--prompt-file", str(f), "--batch-size", "2")
    alone = [run_main(capsys, "--model", DEMO, "--gen-length", "32", "--block-length", "8", "--prompt", q)[0]
             for q in QUESTIONS]
    assert lines[:3] == alone and lines[3].startswith("3 prompts | NFE ")


def test_trace_shows_each_step(capsys):
    lines = run_main(capsys, "--model", DEMO, "--gen-length", "32", "--block-length", "8", "--trace",
                     "--prompt", QUESTIONS[1])
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert len(steps) == int(lines[-1].split()[1])                 # one line per model call
    assert "[" in steps[0] and "_" in steps[0] and lines[-2] == "24 - 10 = 14. The answer is 14."


def test_guided_cli_answers_offline(capsys):
    lines = run_main(capsys, "--model", DEMO, "--guide", os.path.join(ROOT, "demo", "qwen2-arith"),
                     "--gen-length", "32", "--prompt", QUESTIONS[0])
    # The guided answer, not the unguided one ("45 + 23 = 68. The answer is 68.", the demo model's own at its
    # CLI defaults): a command line that dropped --guide, or decoded with the guide's settings ignored, fails.
    assert lines[0] == "23 + 45 = 68. The answer is 68."
    assert "guide calls" in lines[1]


def test_guided_cli_refuses_a_guide_with_other_ids(llada_dir):
    r = cli("--model", DEMO, "--guide", os.path.join(ROOT, "tests", "golden", "qwen2-tiny"), "--prompt", "x")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "guide" in r.stderr


def test_prompt_file_blank_lines_keep_the_answers_aligned(tmp_path, capsys):
    """Issue 28: blank lines were skipped silently, so answer N no longer answered line N. Now a blank line gets
    an empty answer line; blank lines at the end of the file are dropped."""
    f = tmp_path / "prompts.txt"
    f.write_text(f"{QUESTIONS[0]}\n\n   \n{QUESTIONS[1]}\n\n\n")
    lines = run_main(capsys, "--model", DEMO, "--gen-length", "32", "--block-length", "8", "--prompt-file", str(f),
                     "--batch-size", "1")
    alone = [run_main(capsys, "--model", DEMO, "--gen-length", "32", "--block-length", "8", "--prompt", q)[0]
             for q in QUESTIONS[:2]]
    assert lines[:4] == [alone[0], "", "", alone[1]] and all(lines[:1] + lines[3:4])
    assert lines[4].startswith("2 prompts (2 blank lines: empty answers) | NFE ") and len(lines) == 5
    assert command_line.read_prompts(str(f)) == [QUESTIONS[0], "", "", QUESTIONS[1]]
    f.write_text("\n\n")
    with pytest.raises(ValueError, match="has no prompt"):
        command_line.read_prompts(str(f))
