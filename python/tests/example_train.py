"""examples/python/train.py runs as documented: one process, the coordinator embedded, real
AdamW steps, parity checked by the example itself every step (it exits 1 otherwise)."""
import os
import subprocess
import sys

from conftest import free_port, need_env


def test_training_example_runs_with_parity(recipe, tmp_path):
    path = recipe(world=1, tp=1, embedded=True, port=free_port())
    example = os.path.join(need_env("REFIT_EXAMPLES"), "python", "train.py")
    out = subprocess.run([sys.executable, example, "--config", path, "--steps", "3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [l for l in out.stdout.splitlines() if l.startswith("step ")]
    assert len(lines) == 4, out.stdout
    assert "version 4" in lines[-1]
