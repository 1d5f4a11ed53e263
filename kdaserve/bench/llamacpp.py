"""The llama.cpp peer as `kdaserve bench compare` drives it: its process (peers/llamacpp_peer.py,
in the peer's own virtualenv), the converted checkpoints it finds under the peers directory, and
their setup (peers/setup_llamacpp.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PEER_DIR = Path(__file__).parent / "peers"
DEFAULT_PEERS = Path(os.environ.get("KDASERVE_PEERS_DIR")
                     or Path.home() / ".cache" / "kdaserve" / "peers")


class LlamaCppPeer:
    """llama.cpp's side: a process in the peer's virtualenv, one JSON line per command."""

    def __init__(self, python: Path, gguf: Path, threads: int, max_seqs: int,
                 ctx: int) -> None:
        self.proc = subprocess.Popen(
            [str(python), str(PEER_DIR / "llamacpp_peer.py"), str(gguf), str(threads),
             str(max_seqs), str(ctx)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the llama.cpp peer exited (run it by hand to see why: "
                               f"{PEER_DIR / 'llamacpp_peer.py'})")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def find_peer(peers: Path, model: str, kind: str) -> tuple[Path, Path] | str:
    """(the venv's python, the GGUF of `kind`: f32, bf16, q8_0, ...) or why not."""
    python = peers / "llamacpp-venv" / "bin" / "python"
    gguf = peers / "models" / f"{Path(model).name}-{kind}.gguf"
    if not python.is_file() or subprocess.run([str(python), "-c", "import llama_cpp"],
                                              check=False, capture_output=True).returncode != 0:
        return f"no llama.cpp peer at {python} (build it with --setup-peers)"
    if not gguf.is_file():
        return f"no converted model at {gguf} (build it with --setup-peers)"
    return python, gguf


def _gguf_type(dtype: str) -> str:
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype]


def gguf_kind(quantization: str | None, dtype: str) -> str:
    """llama.cpp's form of a run's weights: Q8_0 / Q4_0 against kdaserve's INT8 / INT4, else
    the dtype's."""
    return {"int8": "q8_0", "int4": "q4_0"}.get(quantization) or _gguf_type(dtype)


def setup_peers(peers: Path, model: str, dtype: str) -> None:
    subprocess.run(["bash", str(PEER_DIR / "setup_llamacpp.sh"), str(peers), model,
                    _gguf_type(dtype), sys.executable], check=True)
