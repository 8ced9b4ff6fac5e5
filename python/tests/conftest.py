"""Fixtures of refit's Python tests (run from ctest, label `python`, with Debian's
python3-torch): recipes for the tiny model, `refit-coordinator serve` as a child process, and
trainer processes running python/tests/trainer_proc.py."""
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TOKEN = "refit-python-test-secret-%d" % random.randrange(10 ** 12)
os.environ["REFIT_PY_TOKEN"] = TOKEN

MODEL = ("{model_type: qwen3_moe, num_hidden_layers: 2, hidden_size: 64, num_attention_heads: 4, "
         "num_key_value_heads: 2, head_dim: 16, num_experts: 4, num_experts_per_tok: 2, "
         "moe_intermediate_size: 32, vocab_size: 256, tie_word_embeddings: false, "
         "rms_norm_eps: 1.0e-6, rope_theta: 1000000.0, norm_topk_prob: true, torch_dtype: bfloat16}")


def need_env(name):
    value = os.environ.get(name)
    if not value:
        pytest.fail("%s is not set (ctest sets it; see python/README.md)" % name)
    return value


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def recipe(tmp_path):
    """recipe(world, tp=world, embedded=False, port=0, trainer_faults="") -> path."""
    runtime = need_env("REFIT_RUNTIME")
    count = [0]

    def make(world, tp=None, embedded=False, port=0, trainer_faults="", gate_deadline_ms=30000,
             join_timeout_ms=20000, model=MODEL, buffer_bytes=65536):
        tp = tp or world
        count[0] += 1
        path = tmp_path / ("recipe-%d.yaml" % count[0])
        devices = ", ".join("cpu:%d" % r for r in range(tp))
        faults = ", faults: %s" % trainer_faults if trainer_faults else ""
        path.write_text(
            "model: %s\n" % model
            + "runtime: {executable: %s, tp_size: %d, devices: [%s], kill_grace_ms: 300}\n"
            % (runtime, tp, devices)
            + "supervisor: {max_restarts: 3, backoff_initial_ms: 20, backoff_max_ms: 100}\n"
            + "trainer: {lr: 0.001, init_scale: 0.02%s}\n" % faults
            + "publication: {buffer_bytes: %d, buffer_count: 2, verify: true, "
              "gate_deadline_ms: %d, memory_headroom_bytes: 1048576, republish_attempts: 1}\n"
            % (buffer_bytes, gate_deadline_ms)
            + "job: {seed: 1234}\n"
            + "serve: {host: 127.0.0.1, port: %d, token_env: REFIT_PY_TOKEN, world_size: %d, "
              "embedded: %s, publish_barrier_ms: 60000, join_timeout_ms: %d}\n"
            % (port, world, "true" if embedded else "false", join_timeout_ms))
        return str(path)

    return make


class Coordinator:
    def __init__(self, recipe_path, log_path):
        exe = need_env("REFIT_COORDINATOR")
        self.log = open(log_path, "w+")
        self.proc = subprocess.Popen([exe, "serve", "-c", recipe_path, "--port", "0"],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        deadline = time.time() + 60
        self.port = None
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            m = re.search(r"serving .* on [^ ]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        if not self.port:
            self.stop()
            raise RuntimeError("refit-coordinator serve did not print its port")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def coordinator(tmp_path):
    started = []

    def start(recipe_path):
        c = Coordinator(recipe_path, str(tmp_path / ("coordinator-%d.log" % len(started))))
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


class Trainer:
    """One trainer process (trainer_proc.py); JSON lines out."""

    def __init__(self, args, log_path):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE)] + sys.path)
        self.log = open(log_path, "w+")
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "trainer_proc.py")] + args,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)

    def read(self, timeout=180):
        """The next JSON event (or {"event": "<eof>"})."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                return {"event": "<eof>", "stderr": self.stderr()}
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)
        return {"event": "<timeout>"}

    def stderr(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def wait(self, timeout=120):
        return self.proc.wait(timeout)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def trainers(tmp_path):
    started = []

    def start(*args):
        t = Trainer([str(a) for a in args], str(tmp_path / ("trainer-%d.log" % len(started))))
        started.append(t)
        return t

    yield start
    for t in started:
        t.kill()
        t.log.close()
