"""
hub.py: where a checkpoint's files come from: a local folder, or a Hugging Face repo id downloaded once into the
Hub's cache (huggingface_hub.snapshot_download: its json, tokenizer and safetensors files only, never a pickle or
remote code). A missing, unreadable or misnamed folder or file is one line saying which, and what to do.
"""
import os


def check_readable(path: str):
    """A folder where a file should be, or a file we may not read, is said as such: os.path.isfile() is
    False for both, and "missing" would send the user to re-download what is there."""
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder, not a file: remove it and re-download the checkpoint's file")
    if os.path.exists(path) and not os.access(path, os.R_OK):
        raise ValueError(f"cannot read {path}: permission denied; fix its permissions (chmod a+r)")


# An example repo id for each role, for the messages below.
EXAMPLE_REPO = {"model": "GSAI-ML/LLaDA-8B-Instruct", "guide": "Qwen/Qwen2.5-1.5B-Instruct"}


def resolve_model_dir(name_or_path: str, role: str = "model", weights: bool = True) -> str:
    """A local folder as is; otherwise a Hugging Face repo id, fetched (json, safetensors, tokenizer only;
    weights=False: the small files alone, so that the programs check them before gigabytes of weights come).
    role ("model" or "guide") names which one the user got wrong in the error messages."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ValueError(f"the {role} must be a folder path or a Hugging Face repo id such as "
                         f"{EXAMPLE_REPO[role]}, not {name_or_path!r}")
    name_or_path = os.fspath(name_or_path)
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        # Inside a folder we may not enter every file looks missing: say what is wrong instead.
        if not os.access(path, os.R_OK | os.X_OK):
            raise ValueError(f"cannot read the {role} folder {path}: permission denied; fix its permissions "
                             f"(chmod a+rx)")
        return path
    if os.path.isfile(path):
        raise FileNotFoundError(f"{name_or_path!r} is a file: pass the {role} folder (the one with config.json "
                                f"and *.safetensors)")
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1 or os.path.exists(name_or_path)
    if looks_local:
        raise FileNotFoundError(f"{role} folder {name_or_path!r} not found: pass an existing folder with "
                                f"config.json and *.safetensors, or a Hugging Face repo id such as "
                                f"{EXAMPLE_REPO[role]}")
    from huggingface_hub import snapshot_download
    try:
        # Dream has no tokenizer.json: *.json brings its vocab.json, tokenizer_config.json, added_tokens.json and
        # special_tokens_map.json, and merges.txt completes them; DiffuCoder's chat template is chat_template.jinja.
        # Never a pickle (*.bin, *.pt) or remote code.
        small = ["*.json", "tokenizer*", "merges.txt", "chat_template.jinja"]
        return snapshot_download(name_or_path, allow_patterns=small + ["*.safetensors"] * weights)
    except Exception as e:  # network, auth or a missing repo: one line, not a stack of HTTP frames
        from huggingface_hub import constants
        if constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(f"the {role} {name_or_path!r} is not in the local Hugging Face cache and "
                                    f"offline mode is on (HF_HUB_OFFLINE is set): unset it to download, or pass a "
                                    f"local folder") from None
        raise FileNotFoundError(f"could not fetch the {role} {name_or_path!r} from the Hugging Face Hub "
                                f"({type(e).__name__}): check the repo id and your network, or pass a local folder") from None
