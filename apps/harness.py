"""
harness.py: fastdllm as an lm-evaluation-harness model, so that every decoding method of generate() is scored
on lm-eval's tasks (GSM8K, HumanEval, MATH...) the way the Fast-dLLM and FlashDLM tables are.

    pip install -r requirements-eval.txt
    python apps/harness.py --model fastdllm --model_args model=demo/llada-arith,block_length=8 \
        --include_path demo --tasks demo_arith --output_path out            # offline, CPU, seconds
    accelerate launch apps/harness.py --model fastdllm --model_args model=GSAI-ML/LLaDA-8B-Instruct \
        --tasks gsm8k --num_fewshot 5 --output_path out                      # the paper's GSM8K row

`python apps/harness.py ARGS` is lm-eval's own command line (`lm-eval run ARGS`) with the model "fastdllm"
registered, as lm-eval's docs do it for a model outside its tree (`@register_model`, then `cli_evaluate()`).
Its --model_args are model (folder or Hugging Face id), guide, dtype, device, quantize, batch_size, seed, and every
setting of fastdllm.generate() (gen_length, block_length, steps, cache, threshold, factor, ...: read from
fastdllm.Settings, so a setting added there works here unchanged); the defaults are the CLI's, the method's
headline setting (dual cache, threshold 0.9, block 32). docs/eval.md has the details; in short:
- generate_until only. A request's `max_gen_toks` (else gen_length) is rounded up to a multiple of
  block_length, and its answer is cut at the first end token, then at the first of its `until` strings.
  loglikelihood tasks are refused in one line, before any weights are read: a masked-diffusion model's
  likelihood needs a Monte Carlo estimate (LLaDA's mc_num), out of scope here.
- --apply_chat_template renders with the model's own template (chat.Chat, as the CLI); without it the raw
  prompt goes in, tokenized as its tokenizer does (LLaDA's adds its bos).
- Left-padded batches of batch_size: every row decodes exactly as it would alone, so each answer is the
  same at any batch size and order (tests/test_harness.py checks it through lm-eval's --log_samples).
- Throughput per task, in the log, after the results table and in throughput_<date>.json next to lm-eval's
  results JSON: model calls per problem (the papers' NFE: the same at any batch size), batched calls (what
  the time is spent on), answer tokens (each answer's tokens before its first end token), tokens per call, and
  answer tokens per second (generate()'s stats["tokens_per_s"], the project's one definition of tokens/s).
- Under `torchrun` (CPUs or GPUs) or `accelerate launch` (GPUs) each process takes its share of the requests
  (rank, world_size) and lm-eval gathers the results, as its HF model does. A launcher that asked for several
  processes but started one (`accelerate launch --cpu --num_processes 2`) is refused in one line.
"""
import argparse
import dataclasses
import difflib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)     # the method's modules (fastdllm.py, model.py, ...) live at the repository's root

try:
    from lm_eval.__main__ import cli_evaluate
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import simple_parse_args_string
except ImportError as e:
    raise ImportError(f"harness.py needs lm-eval ({e}): pip install -r requirements-eval.txt") from None

from chat import Chat
from cli import CLI_DEFAULTS, check_early, pick_device_dtype
from fastdllm import Compiled, CudaGraphs, generate, pad_prompts
from guided import check_guide
from options import Settings, check_family, check_prompt, family_of, settings as settled
from model import load_model, read_config, resolve_model_dir
from quant import int8_quantizer
from uniform import OWN as GEMMA_OWN

log = logging.getLogger("lm_eval.fastdllm")   # under lm-eval's logger, so it prints with lm-eval's lines

# generate()'s settings, from fastdllm.Settings; the harness itself supplies the guide and the end ids, and a
# fork's own rule (select, propose, stop: objects) cannot come from the command line.
SUPPLIED = {"guide", "eos_ids", "select", "propose", "stop"}
SETTINGS = {f.name: f.default for f in dataclasses.fields(Settings) if f.name not in SUPPLIED}
OWN = ("model", "guide", "dtype", "device", "quantize", "batch_size", "seed")      # FastDLLM's own --model_args
# The CLI's (block_length 32 is generate()'s own); DiffusionGemma's own settings are its checkpoint's unless given.
DEFAULTS = {k: v for k, v in SETTINGS.items() if k not in GEMMA_OWN} | CLI_DEFAULTS
REFUSAL = ("the fastdllm model only generates (generate_until tasks such as gsm8k or humaneval): a masked-"
           "diffusion model's likelihood needs a Monte Carlo estimate, which this harness does not do")
RUNS = []    # every FastDLLM made in this process, for main() to report its throughput after lm-eval's table
# lm-eval's run flags that also reach the model: main() notes those not on the command line, whose values are
# lm-eval's defaults (batch_size 1, device "cuda:0"), so that a --model_args value is not refused as a clash.
LM_EVAL_FLAGS = {"batch_size": ("--batch_size", "-b"), "device": ("--device",), "max_batch_size": ("--max_batch_size",)}
DEFAULTED = set()


@register_model("fastdllm")
class FastDLLM(LM):
    def __init__(self, model: str = "GSAI-ML/LLaDA-8B-Instruct", guide: str | None = None, dtype: str | None = None,
                 device: str | None = None, quantize: str | None = None, batch_size=1, max_batch_size=None,
                 seed: int = 0, **settings):
        super().__init__()
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:      # a typo (treshold) gets the nearest name, as the server's unknown fields do
            near = difflib.get_close_matches(unknown[0], [*OWN, *SETTINGS], 1)
            hint = (" (fastdllm's is model=)" if unknown[0] == "pretrained" else
                    f" (did you mean {near[0]!r}?)" if near else "")
            raise ValueError(f"unknown --model_args key {unknown[0]!r}{hint}: fastdllm takes {', '.join(OWN)} and "
                             f"generate()'s settings: {', '.join(SETTINGS)}")
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise ValueError(f"batch_size must be a positive integer, not {batch_size!r} (no 'auto': every "
                             f"answer is the same at any batch size, only the speed changes)")
        if max_batch_size is not None:
            raise ValueError(f"max_batch_size ({max_batch_size}) only bounds lm-eval's --batch_size auto, which "
                             f"fastdllm does not take: pass a fixed --batch_size N")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
            raise ValueError(f"seed must be an integer in [0, 2**64), not {seed!r}")
        for name, value in (("dtype", dtype), ("device", device)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a name (e.g. {'bfloat16' if name == 'dtype' else 'cpu'}), "
                                 f"not {value!r}")
        # "none" as the CLI takes it. lm-eval passes the word on as a string, except where it has turned it
        # into None already (its Python API's model_args string, or `None` on its command line): a cache of
        # None is the no-cache baseline too. --factor or --guide replaces the default threshold, as in the
        # CLI; block_length 0 = one block.
        settings = {k: off(DEFAULTS.get(k), v) for k, v in settings.items()}
        self.given = set(settings)
        if "cache" in settings and settings["cache"] is None:
            settings["cache"] = "none"
        guide = None if guide is None or isinstance(guide, str) and guide.strip().lower() in ("none", "") else guide
        if "threshold" not in settings and (settings.get("factor") is not None or guide):
            settings["threshold"] = None
        self.settings = DEFAULTS | settings
        self.settings["block_length"] = self.settings["block_length"] or None
        s = self.settings     # what needs no model is checked now, not after reading gigabytes of weights
        self.guided = {"guide": guide} if guide is not None else {}
        # Without a gen_length of the user's, each request's canvas is its max_gen_toks (else 256) rounded up to
        # whole blocks (request_settings): the default is checked so too, not refused for a block_length (7)
        # that does not divide a 256 nobody chose. Each other canvas a request asks for is checked on its own.
        default = s["gen_length"] if "gen_length" in settings else self.canvas(s["gen_length"])
        self.checked_lengths = {default}
        try:
            check_early(s | self.guided | {"gen_length": default})
        except TypeError as e:      # options.py's line for a value of the wrong type (cache=3): one line here too
            raise ValueError(str(e)) from None
        self._rank, self._world_size, device = distributed(device)
        self._device, self.dtype = pick_device_dtype(device, dtype)
        self.quantize = None if quantize in (None, "none", "") else quantize
        int8_quantizer(self.quantize)     # quantize=int4, or int8 without torchao: one line before any weight
        guide_local = check_local(guide, "guide") if guide is not None else False   # the guide first, as the CLI
        model_local = check_local(model, "model")
        self.model_name, self.guide_name, self.batch_size, self.seed = model, guide, int(batch_size), seed
        # compile=True: one Compiled for every batch, so each graph is compiled (and captured) once, not per call
        self.compile = Compiled() if s["compile"] is True else s["compile"]
        # CUDA graphs (the default on CUDA): one CudaGraphs for every batch too, so each width is captured once
        self.graphs = CudaGraphs() if s["cuda_graphs"] is None and self._device.type == "cuda" else s["cuda_graphs"]
        self.chat_applied = False          # set once lm-eval asks for the chat template
        self._chat, self._net, self._guide = None, None, None
        self.said = set()                  # log lines said once
        self.throughput = {}               # task -> counts (see count())
        if model_local:      # its tokenizer too (no weights): a broken one fails now, not after lm-eval's tasks
            self.chat
        self._guide_dir = self.checked_guide() if guide_local and model_local else None   # else on first use
        RUNS.append(self)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """lm-eval's --batch_size, --device and --max_batch_size arrive beside --model_args; lm-eval's own merge,
        cls(**model_args, **flags), is a TypeError traceback when a key is in both. Here lm-eval's defaults
        (a flag not on its command line) yield to --model_args, and a key given twice must agree."""
        flags = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in DEFAULTED}
        for k in sorted(flags.keys() & arg_dict.keys()):
            if str(flags[k]) != str(arg_dict[k]):
                raise ValueError(f"{k} is given twice, as {LM_EVAL_FLAGS.get(k, (k,))[0]} {flags[k]} and as "
                                 f"--model_args {k}={arg_dict[k]}: pass one")
        return cls(**flags | arg_dict)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # --- the model and its tokenizer, loaded on first use: a refused task never reads a weight -------------
    @property
    def chat(self) -> Chat:
        """The tokenizer and chat template, from the model's small files (a repo's weights are fetched later, by
        net()); the settings' checks that need config.json are made here, before any weight."""
        if self._chat is None:
            self.model_dir = resolve_model_dir(self.model_name, weights=False)
            self.cfg = read_config(self.model_dir)
            s = self.settings
            check_family(self.cfg, s["remasking"], s["top_p"], s["top_k"], s["alg_temp"])
            if self.cfg.family == "diffusion_gemma":    # as in the CLI: its canvas, no threshold (its entropy bound)
                s |= {k: v for k, v in dict(block_length=self.cfg.gemma.canvas, threshold=None).items()
                      if k not in self.given}
                family_of(self.cfg, settled(self.cfg, s)).check(self.cfg, settled(self.cfg, s), s, 1)
            self._chat = Chat(self.model_dir, self.cfg)
            self._chat.stop_ids |= set(self.cfg.eos_ids)     # config.json may list several end ids
        return self._chat

    def checked_guide(self) -> str:
        """The guide's folder, looked up before the model's (as in the CLI), after checking on the small files
        (configs, tokenizers) that it shares the model's token ids."""
        guide_dir = resolve_model_dir(self.guide_name, role="guide", weights=False)
        chat = self.chat
        guide_cfg = read_config(guide_dir)
        try:
            guide_tok = Chat(guide_dir, guide_cfg).tok
        except FileNotFoundError:
            guide_tok = None
        check_guide(self.cfg, guide_cfg, chat.tok, guide_tok)
        return guide_dir

    def net(self):
        if self._net is None:
            if self.guide_name:
                self._guide_dir = self._guide_dir or self.checked_guide()
                self._guide = load_model(resolve_model_dir(self.guide_name, role="guide"), device=self._device,
                                         dtype=self.dtype, quantize=self.quantize)
            self.chat           # the small files' checks first
            self._net = load_model(resolve_model_dir(self.model_name), device=self._device, dtype=self.dtype,
                                   quantize=self.quantize)
        return self._net

    # --- lm-eval's interface ----------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise ValueError(REFUSAL)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise ValueError(REFUSAL)

    @property
    def tokenizer_name(self) -> str:
        return self.model_name

    def chat_template(self, chat_template=False) -> str:
        """What a user turn looks like (we have no Jinja template: chat.py writes each family's out)."""
        return self.apply_chat_template([{"role": "user", "content": "{content}"}])

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat.chat:
            raise ValueError(f"{self.model_name} has no chat template (its tokenizer lacks the chat tokens): "
                             f"run without --apply_chat_template")
        self.chat_applied = True
        if add_generation_prompt or chat_history[-1]["role"] != "assistant":
            return self.chat.render(chat_history)
        # lm-eval's gen_prefix: the answer continues a started assistant turn
        return self.chat.render(chat_history[:-1]) + chat_history[-1]["content"]

    def get_model_info(self) -> dict:
        return {"fastdllm": dict(model=self.model_name, guide=self.guide_name, batch_size=self.batch_size,
                                 dtype=str(self.dtype), quantize=self.quantize, **self.settings)}

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from tqdm import tqdm
        self.chat           # the model's own defaults are decided on its small files
        s = self.settings
        # At temperature 0 a request repeated (lm-eval's `repeats`, or its padding of a rank's share) gets
        # the same answer, so it is decoded once. Groups: one task and one request setting each.
        todo = list({id(r): r for r in requests}.values()) if not s["temperature"] else requests
        groups, rows = {}, {}
        for i, r in enumerate(todo):
            until, gen_length = self.request_settings(r.args[1])
            groups.setdefault((r.task_name, tuple(until), gen_length), []).append(i)
            rows[i] = self.encode(r.args[0])
            try:      # every prompt is checked before a weight is read (the mask token, ids, its length)
                check_prompt(self.cfg, torch.tensor([rows[i]]), gen_length, None, s["top_p"], s["top_k"], s["alg_temp"])
            except ValueError as e:
                raise ValueError(f"a request of {r.task_name}: {e}") from None
        net, answers = self.net(), [None] * len(todo)
        bar = tqdm(total=len(todo), desc="fastdllm", disable=disable_tqdm or self.rank != 0)
        for (task, until, gen_length), idx in groups.items():
            idx.sort(key=lambda i: -len(rows[i]))            # similar lengths together: less padding
            t = self.throughput.setdefault(task, counters())
            t["gen_length"] = sorted(set(t["gen_length"]) | {gen_length})
            for b in range(0, len(idx), self.batch_size):
                batch = idx[b:b + self.batch_size]
                outs, stats = self.decode(net, [rows[i] for i in batch], gen_length)
                for i, out in zip(batch, outs):
                    answers[i] = cut(self.chat.answer(out), until)
                count(t, stats, len(batch))
                bar.update(len(batch))
            log.info(f"{task}: {throughput_line(t)}")
        bar.close()
        by_id = {id(r): a for r, a in zip(todo, answers)}
        return [by_id[id(r)] for r in requests] if not s["temperature"] else answers

    # --- the parts ---------------------------------------------------------------------------------------
    def request_settings(self, gen_kwargs: dict):
        """A request's (until strings, gen_length): max_gen_toks (else the gen_length setting) rounded up to
        a multiple of block_length. Its sampling keys are not ours: decoding is set by --model_args."""
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else until
        if not isinstance(until, (list, tuple)) or not all(isinstance(u, str) for u in until):
            raise ValueError(f"a request's until must be a string or a list of strings, not {until!r} (the task's "
                             f"generation_kwargs, or --gen_kwargs)")
        want = gen_kwargs.get("max_gen_toks", self.settings["gen_length"])
        if isinstance(want, bool) or not isinstance(want, int) or want < 1:
            raise ValueError(f"max_gen_toks must be an integer >= 1, not {want!r} (the task's generation_kwargs, "
                             f"or --gen_kwargs max_gen_toks=N)")
        gen_length, block = self.canvas(want), self.settings["block_length"]
        rounded = f" rounded up to a multiple of block_length {block}" if gen_length != want else ""
        if rounded:
            self.say(f"max_gen_toks {want} -> gen_length {gen_length}, a multiple of block_length {block}")
        if gen_length not in self.checked_lengths:      # a canvas of its own: `steps` may not divide its blocks
            try:
                check_early(self.settings | self.guided | {"gen_length": gen_length})
            except ValueError as e:
                raise ValueError(f"{e} (here gen_length {gen_length} is the request's max_gen_toks {want}{rounded}: "
                                 f"set another with --gen_kwargs max_gen_toks=N, or change the --model_args)") from None
            self.checked_lengths.add(gen_length)
        ignored = {k: v for k, v in gen_kwargs.items() if k not in ("until", "max_gen_toks") and
                   not (k == "do_sample" and not v) and not (k == "temperature" and v == self.settings["temperature"])}
        if ignored:
            self.say(f"ignoring the task's gen_kwargs {ignored}: fastdllm decodes with its --model_args settings")
        return until, gen_length

    def canvas(self, want: int) -> int:
        """The gen_length that decodes `want` tokens: rounded up to a multiple of block_length (guided: one
        block, as asked)."""
        block = self.settings["block_length"] if not self.guided else None
        return -(-want // block) * block if block else want

    def encode(self, text: str) -> list[int]:
        """Rendered by our chat template: its text holds the specials already. Raw: as the tokenizer encodes
        it (as the official eval code does: LLaDA's tokenizer adds its bos)."""
        return self.chat.encode(text) if self.chat_applied else self.chat.tok.encode(text).ids

    def decode(self, net, rows: list[list[int]], gen_length: int):
        """One padded batch -> (answer ids per row, each its own length: a block-diffusion row's as alone;
        generate()'s stats)."""
        cfg = self.cfg
        ids, am = pad_prompts(rows, cfg.pad_id if cfg.pad_id is not None else cfg.eos_id)
        # DiffusionGemma's rows each draw from a generator of their own: each answer as alone, at any batch size
        generator = [torch.Generator(self._device).manual_seed(self.seed) for _ in rows]
        generator = generator if cfg.family == "diffusion_gemma" and len(rows) > 1 else generator[0]
        x, stats = generate(net, ids.to(self._device), attention_mask=am.to(self._device), generator=generator,
                            guide=self._guide, eos_ids=sorted(self.chat.stop_ids),
                            **self.settings | {"gen_length": gen_length, "compile": self.compile,
                                               "cuda_graphs": self.graphs})
        return [row[:n] for row, n in zip(x[:, ids.shape[1]:].tolist(), stats["row_length"])], stats

    def say(self, line: str):
        if line not in self.said:
            self.said.add(line)
            log.info(line)

    # --- data parallel: lm-eval shards the requests by rank and gathers through these ------------------
    def all_gather(self, tensor):
        if self.world_size == 1:
            return tensor
        tensor = tensor.reshape(1) if tensor.ndim == 0 else tensor
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(out, tensor)
        return torch.cat(out)

    def gather_object(self, obj, dst: int = 0):
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj, out, dst=dst)
        return out

    def barrier(self):
        if self.world_size > 1:
            torch.distributed.barrier()


def off(default, value):
    """A setting's "none" / "off": None (the family's default, or no rule), False for a switch (stop_at_eos)."""
    if isinstance(value, str) and value.strip().lower() in ("none", "off") and not isinstance(default, str):
        return False if isinstance(default, bool) else None
    return value


def check_local(name, role: str):
    """A local folder is checked now, config.json included (missing, a file, not a model folder: one line that
    names the model or the guide) -> True; a Hugging Face repo id (-> False) is fetched on first use, so that
    a refused task downloads nothing. (The repo-id test is resolve_model_dir's: owner/name, not a path.)"""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"the {role} must be a folder path or a Hugging Face repo id, not {name!r}")
    if os.path.exists(os.path.expanduser(name)) or name.startswith((".", "/", "~")) or name.count("/") != 1:
        read_config(resolve_model_dir(name, role=role))
        return True
    return False


def check_output_path(output_path: str | None):
    """lm-eval writes its results under --output_path (a folder, or NAME.json's folder), and where it cannot it
    only warns, after the whole run: checked before it starts."""
    if output_path is None:
        return
    path = Path(output_path).expanduser().absolute()
    folder = path.parent if path.suffix == ".json" else path
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--output_path {output_path}: {existing} is a file, not a folder: pass a folder (or a "
                         f"NAME.json in one) that can be created")
    try:      # by trying: os.access says yes to root on a read-only disk
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise ValueError(f"--output_path {output_path}: cannot write in {existing} ({e.strerror})") from None


def distributed(device: str | None):
    """(rank, world_size, device) under torchrun / accelerate launch (their WORLD_SIZE, RANK, LOCAL_RANK),
    with the process group up: NCCL on GPUs, gloo on CPUs. One process: (0, 1, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        # accelerate launch --num_processes N starts N processes only on N GPUs; with --cpu (or fewer GPUs)
        # it starts this one alone, with MASTER_PORT set for the N it was asked for and no WORLD_SIZE
        # (several on CPUs need its MPI launcher). mpirun starts N copies that have no torch rank, each of
        # which would score every request. Either way, what was asked for is not what runs: say so.
        accelerate = "ACCELERATE_DYNAMO_BACKEND" in os.environ and "MASTER_PORT" in os.environ
        mpi = max(int(os.environ.get(k, "1") or 1) for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")) > 1
        if "WORLD_SIZE" not in os.environ and (accelerate or mpi):
            what = ("accelerate launch asked for several processes but started one (it runs several on CPUs only "
                    "through MPI, on GPUs one per GPU)" if accelerate else
                    "mpirun started processes without a torch.distributed rank (each would score every request)")
            raise ValueError(f"{what}: use torchrun --nproc_per_node N apps/harness.py ... (CPUs: gloo; GPUs: one "
                             f"process per GPU), or one process without --num_processes")
        return 0, 1, device
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None or device.startswith("cuda"):    # one GPU per process, as lm-eval's HF model does
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return torch.distributed.get_rank(), world, device


def cut(text: str, until) -> str:
    """The text before the first occurrence of any stop string."""
    return text[:min([text.find(u) for u in until if u and u in text], default=len(text))]


# ----------------------------------------------------------------------------------------------------------
# Throughput. Model calls are counted two ways: per problem (generate()'s stats["row_nfe"]: the calls that
# served each row, what the papers call NFE, the same at any batch size) and batched (stats["nfe"]: forward
# passes of a whole batch, what the time is spent on, fewer as the batch grows). tokens/s is the project's one
# definition: answer tokens (before each answer's first end token) per second of generate() (its stats).

def counters() -> dict:
    return dict(requests=0, row_calls=0, batched_calls=0, guide_calls=0, answer_tokens=0, seconds=0.0, gen_length=[])


def count(t: dict, stats: dict, n: int):
    """Add one generate() call's stats (a batch of n requests) to a task's counters."""
    t["requests"] += n
    t["row_calls"] += sum(stats["row_nfe"])
    t["batched_calls"] += stats["nfe"]
    t["guide_calls"] += stats.get("guide_calls", 0)      # batched, as the guide runs on the whole batch
    t["answer_tokens"] += stats["answer_tokens"]
    t["seconds"] += stats["seconds"]


def summary(t: dict) -> dict:
    """The counters and the figures derived from them."""
    return t | dict(calls_per_problem=t["row_calls"] / max(t["requests"], 1),
                    tokens_per_call=t["answer_tokens"] / max(t["row_calls"], 1),
                    tokens_per_s=t["answer_tokens"] / max(t["seconds"], 1e-9))


def throughput_line(t: dict) -> str:
    f = summary(t)
    guided = f" | guide calls {t['guide_calls']} (batched)" if t["guide_calls"] else ""
    return (f"{t['requests']} requests | NFE {f['calls_per_problem']:.2f} per problem ({t['batched_calls']} batched "
            f"calls) | {t['answer_tokens']} answer tokens | {f['tokens_per_call']:.2f} tokens/call | "
            f"{f['tokens_per_s']:.1f} answer tokens/s{guided}")


def report(lm: FastDLLM, output_path: str | None, since: float):
    """All processes' throughput, summed (the time is the slowest process's), printed after lm-eval's table
    and written as throughput_<date>.json next to the results JSON this run wrote."""
    parts = lm.gather_object(lm.throughput)
    if lm.rank != 0:
        return
    total = {}
    for part in parts:
        for task, t in part.items():
            acc = total.setdefault(task, counters())
            for k, v in t.items():
                acc[k] = (max(acc[k], v) if k == "seconds" else sorted(set(acc[k]) | set(v)) if k == "gen_length"
                          else acc[k] + v)
    used = sorted({g for t in total.values() for g in t["gen_length"]})
    for task, t in total.items():
        print(f"fastdllm throughput, {task} ({lm.world_size} process{'es' * (lm.world_size > 1)}): "
              f"{throughput_line(t)}")
        total[task] = summary(t) | {"gen_length": single(t["gen_length"])}
    if not output_path:
        return
    out = Path(output_path)
    found = out.parent.glob(f"{out.stem}_*.json") if out.suffix == ".json" else out.rglob("results_*.json")
    new = sorted((f for f in found if f.stat().st_mtime >= since), key=lambda f: f.stat().st_mtime)
    if new:
        path = new[-1].with_name(f"throughput_{new[-1].stem.rsplit('_', 1)[-1]}.json")
        # gen_length as used: each request's max_gen_toks (rounded up to the block), else the setting
        settings = lm.get_model_info()["fastdllm"] | {"gen_length": single(used)}
        path.write_text(json.dumps({"settings": settings, "world_size": lm.world_size, "tasks": total}, indent=2))
        print(f"fastdllm throughput written to {path}")


def single(values: list):
    """[32] -> 32: a list only where a run used several values."""
    return values[0] if len(values) == 1 else values


def main() -> int:
    """lm-eval's command line (sys.argv) with "fastdllm" registered; one line on stderr for our errors."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--output_path", "-o")
    for name, flags in LM_EVAL_FLAGS.items():
        p.add_argument(*flags, dest=name)
    known = p.parse_known_args()[0]
    since, runs = time.time(), len(RUNS)
    try:
        check_output_path(known.output_path)
        DEFAULTED.update(k for k in LM_EVAL_FLAGS if getattr(known, k) is None)
        cli_evaluate()
        if len(RUNS) > runs:
            report(RUNS[-1], known.output_path, since)
    except (ValueError, OSError) as e:   # ours are one line that names the fix; so are lm-eval's task errors
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        DEFAULTED.clear()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
