"""The reading path, counted by running it (tools/reading.py): the definitions one LLaDA and one Dream DualCache +
threshold step run, and their set-up, stay within what the README states (a change that adds a hop to the step
fails here and says which definitions it runs now)."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import reading  # noqa: E402
from model import load_model  # noqa: E402

# path -> (the step's most definitions, files; the set-up's): README "How it works" states these.
BUDGET = {"llada": ((25, 5), (34, 7)), "dream": ((26, 5), (36, 8))}


@pytest.mark.parametrize("path", list(BUDGET))
def test_a_step_and_its_set_up_run_no_more_definitions_than_the_readme_says(path):
    folder, settings = reading.PATHS[path]
    model = load_model(folder, device="cpu", dtype=torch.float32)
    seen = reading.trace(model, torch.arange(11, 21)[None], settings)
    for part, (most, files) in zip(("step", "set-up"), BUDGET[path]):
        names = sorted(seen[part])
        assert len(names) <= most and len({f for f, _ in names}) <= files, (part, len(names), names)
    assert ("cache.py", "DualCache.span") in seen["step"] and ("cache.py", "KVCache.update") in seen["step"]
    assert not any(f == "checks.py" and n != "step_rules" for f, n in seen["step"])   # built-in hooks: unwrapped
