"""A tiny random model directory, and the real server run as a subprocess on a free port."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from kdaserve.model.loader import save_model
from kdaserve.train.bpe import save_tokenizer, train_bpe_tokenizer
from tiny_models import random_model, tiny_config

REPO = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 2048
BODY_LIMIT = 64 << 10
MAIN_SERVER_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--cache-memory", "64MiB",
                    "--max-body-size", "64KiB", "--log-level", "info")
WORDS = ("the and of to a in that is was he for it with as his on be at by had not are but "
         "from or have an they which one you were her all she there would their we him been "
         "has when who will more no if out so said what up its about into than them can only "
         "other new some could time these two may then do first any my now such like our over "
         "man me even most made after also did many before must through back years where much "
         "your way well down should because each just those people how too little state good "
         "very make world still own see men work long get here between both life being under "
         "never day same another know while last might us great old year off come since against "
         "go came right used take three king queen crown love night light sun moon star").split()


def corpus(num_lines: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ";"]))
    return lines


def build_tiny_model(out: Path, vocab_target: int = 300, seed: int = 0, **over) -> Path:
    """A BPE tokenizer (~300 ids) and a random 4-layer KDA+MLA MoE model of the same vocab;
    `over`: config fields to change (tiny_config)."""
    tok = train_bpe_tokenizer(corpus(), vocab_size=vocab_target)
    save_tokenizer(tok, out, model_max_length=4096)
    cfg = tiny_config(vocab_size=tok.get_vocab_size(with_added_tokens=True), eos_token_id=0,
                      **over)
    model = random_model(cfg, seed=seed, chunk=16)
    save_model(model.eval(), out)
    return out


@contextlib.contextmanager
def torch_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM to the server's process group (engine included), as a service manager does."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def engine_pid(self) -> int:
        """The engine child of this server (the spawn child, not multiprocessing's tracker)."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmdline = (stat.parent / "cmdline").read_bytes()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid and b"spawn_main" in cmdline:
                return int(stat.parent.name)
        raise LookupError(f"no engine child of {self.proc.pid}")


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def start_server(model_dir: Path, log_path: Path, *args: str, env: dict | None = None,
                 timeout: float = 180.0) -> Server:
    port = free_port()
    # `kdaserve serve`, as installed: its engine process (spawn) then re-imports only the light
    # kdaserve.cli as its main module, not the server's stack (fastapi, ~1 s of CPU a process)
    cmd = [sys.executable, "-m", "kdaserve.cli", "serve", "--model", str(model_dir),
           "--port", str(port), *args]
    # One torch thread: the tiny model gains nothing from more, and OpenMP threads that spin
    # against other jobs on a small machine make every step tens of times slower.
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)
    server = Server(proc, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server not healthy after {timeout} s:\n{server.log()}")


def metrics(url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text)


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def health_after(url: str, timeout: float = 60.0) -> int:
    """Poll /health until it stops answering 200 (0: the server went down) or `timeout`
    passes; returns the last status."""
    deadline = time.monotonic() + timeout
    status = 200
    while status == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
        try:
            status = httpx.get(url + "/health", timeout=10).status_code
        except httpx.TransportError:
            status = 0                           # the server went down: also noticed
    return status


def wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and the cache is all free; returns them."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m["kdaserve:num_requests_running"] == 0 and m["kdaserve:num_requests_waiting"] == 0
                and m["kdaserve:cache_all_free"] == 1.0):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout} s: {m}")
        time.sleep(0.05)


def assert_openai_error(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if code is not None:
        assert err["code"] == code
    return err
