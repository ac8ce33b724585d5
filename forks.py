"""
forks.py: a fork's program on the command line (examples/: `python examples/klass.py --prompt ...`, cli.run(fork,
**own)): its own flags, parsed beside fastdllm.py's and listed last by --help; its parts (hooks) made from them; and
the CLI's flags that a part replaces, refused in one line when given beside it, never ignored.
"""
import inspect

from chat import load_tokenizer
from flags import new_parser
from hub import resolve_model_dir
from model import read_config

# The flags a fork's part replaces: given beside it, refused in the CLI's words.
REPLACED = {"cache": (("cache",), "cache policy decides what each call feeds"),
            "select": (("threshold", "factor"), "selection rule decides how many tokens a step commits"),
            "propose": (("steps", "remasking", "temperature", "top_p", "top_k", "alg_temp"), "step rule makes the "
                        "proposals (and draws its own noise)"),
            "stop": (("no_early_stop",), "stop rule decides when an answer has ended")}


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def add_own(p, own: dict):
    """A fork's own flags onto p: name=(default, help), typed as the default."""
    for key, (default, text) in own.items():
        p.add_argument(flag_name(key), type=type(default), default=default, help=f"{text} (default: %(default)r)")


def own_flags(argv: list, **own) -> tuple[dict, list]:
    """A fork's own flags alone, name=(default, help) -> ({name: value}, the rest of argv, the CLI's)."""
    p = new_parser(add_help=False, allow_abbrev=False)
    add_own(p, own)
    values, rest = p.parse_known_args(argv)
    return vars(values), rest


def fork_parts(fork, values: dict, model: str) -> dict:
    """fork(**its flags) -> its hooks; a fork that asks for the checkpoint's `config` or `tokenizer` gets them
    (its small files: nothing is loaded)."""
    needs = inspect.signature(fork).parameters
    if "config" in needs or "tokenizer" in needs:
        folder = resolve_model_dir(model, weights=False)
        values |= {k: v() for k, v in dict(config=lambda: read_config(folder),
                                           tokenizer=lambda: load_tokenizer(folder)).items() if k in needs}
    return fork(**values)


def refuse_replaced(p, args, hooks: dict):
    """A CLI flag given beside the part that replaces it (given: in the namespace, argparse.SUPPRESS, and not its
    default) is one line."""
    for kind, (flags, what) in REPLACED.items():
        flag = next((f for f in flags if kind in hooks and vars(args).get(f, p.get_default(f)) != p.get_default(f)),
                    None)
        if flag:
            raise ValueError(f"{flag_name(flag)} does not apply: this program's own {what}; drop {flag_name(flag)}")
