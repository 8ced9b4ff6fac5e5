"""examples/python/train.py runs as documented: one process, the coordinator embedded, real
AdamW steps, parity checked by the example itself every step (it exits 1 otherwise)."""
import os
import subprocess
import sys

import pytest

from conftest import free_port, need_env


KJV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "data", "models",
                   "tiny-kjv")


@pytest.mark.parametrize("model", ["inline", "checkpoint"])
def test_training_example_runs_with_parity(recipe, tmp_path, model):
    # checkpoint: the recipe names an HF checkpoint folder (the runtime starts from its
    # weights; the example reads the model's shape from its config.json).
    spec = {"inline": None, "checkpoint": "{path: %s}" % os.path.abspath(KJV)}[model]
    kw = {"model": spec, "buffer_bytes": 1 << 20} if spec else {}
    path = recipe(world=1, tp=1, embedded=True, port=free_port(), **kw)
    example = os.path.join(need_env("REFIT_EXAMPLES"), "python", "train.py")
    out = subprocess.run([sys.executable, example, "--config", path, "--steps", "3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [l for l in out.stdout.splitlines() if l.startswith("step ")]
    assert len(lines) == 4, out.stdout
    assert "version 4" in lines[-1]
