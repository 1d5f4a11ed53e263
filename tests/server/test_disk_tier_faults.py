"""Issue 35's disk-tier probes over real HTTP: a FIFO, a directory, an oversized and a sparse file
in place of disk-tier entries, planted while a server runs (its loads must miss at once, not
hang the engine) and before a restart (the scan must remove them, never stop the start). Each
time the greedy output equals the first server's (its tier empty: no offload read), a
concurrent request completes, and /health stays 200."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from server_harness import metrics, start_server, wait_idle

PROMPT = ("Now is the winter of our discontent made glorious summer by this sun of York; and "
          "all the clouds that lour'd upon our house in the deep bosom of the ocean buried. "
          "Now are our brows bound with victorious wreaths, our bruised arms hung up.\n")
OTHER = {"prompt": "The king and the queen", "max_tokens": 4, "ignore_eos": True,
         "temperature": 0}
FAULTS = ("fifo", "directory", "oversized", "sparse")
BASE = ("--cache-memory", "64MiB", "--torch-threads", "1", "--max-model-len", "1024")


def _complete(url: str, body: dict | None = None) -> list[int]:
    body = body or {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json={**body, "return_token_ids": True},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _plant(path: Path, fault: str) -> None:
    good = path.read_bytes()
    path.unlink()
    if fault == "fifo":
        os.mkfifo(path)
    elif fault == "directory":
        path.mkdir()
        (path / "x").write_bytes(good)
    elif fault == "oversized":
        path.write_bytes(good + b"\0" * (1 << 20))
    else:                                   # sparse: the real header, then a 1 TiB hole
        path.write_bytes(good[:256])
        os.truncate(path, 1 << 40)


def _entries(tier: Path) -> list[Path]:
    """Whatever sits where an entry belongs (files, FIFOs, directories)."""
    return sorted(p for p in tier.glob("*/*/*/*") if p.parent.parent.name in
                  ("block", "snapshot"))


def _fault_of(path: Path, largest: int) -> str | None:
    if path.is_fifo():
        return "fifo"
    if path.is_dir():
        return "directory"
    size = path.stat().st_size
    return None if size <= largest else "sparse" if size >= 1 << 40 else "oversized"


def _good(tier: Path, largest: int) -> list[Path]:
    return [p for p in _entries(tier) if _fault_of(p, largest) is None]


def _probe(url: str) -> list[int]:
    """The prompt whose entries are damaged, with a normal request beside it; both must
    finish, and /health answers 200 afterwards."""
    with ThreadPoolExecutor(2) as pool:
        probe = pool.submit(_complete, url)
        normal = pool.submit(_complete, url, OTHER)
        assert len(normal.result(timeout=120)) == 4
        out = probe.result(timeout=120)
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    return out


def test_damaged_disk_tier_entries_are_misses(tiny_model_dir, tmp_path):
    tier = tmp_path / "tier"
    args = (*BASE, "--offload", "disk", "--offload-dir", str(tier), "--offload-bytes", "256MiB")

    # the tier starts empty, so the first server computes the prompt in full: its tokens are
    # a server's without offload (one server start fewer than a separate reference server;
    # offload's own equality with no offload: tests/engine/test_offload.py)
    first = start_server(tiny_model_dir, tmp_path / "a.log", *args)
    try:
        expected = _complete(first.url)
        wait_idle(first.url)
    finally:
        assert first.stop() == 0
    files = _entries(tier)
    assert len(files) >= len(FAULTS), files
    largest = max(p.stat().st_size for p in files)

    # while a server runs: its index holds the entries, the files go bad under it
    second = start_server(tiny_model_dir, tmp_path / "b.log", *args)
    try:
        for path, fault in zip(files, FAULTS * len(files)):
            _plant(path, fault)
        assert _probe(second.url) == expected
        m = wait_idle(second.url)
    finally:
        assert second.stop() == 0
    assert m['kdaserve:offload_load_failures_total{tier="disk"}'] >= 1
    assert "treated as a miss" in second.log()

    # before a restart: the scan removes them, the start goes on
    # (what the running server did not load is still damaged: the scan removes that too)
    left = {_fault_of(p, largest) for p in _entries(tier)} - {None}
    files = _good(tier, largest)
    for path, fault in zip(files, [f for f in FAULTS if f not in left] + list(FAULTS)):
        _plant(path, fault)
    kinds = [_fault_of(p, largest) for p in _entries(tier)]
    assert set(kinds) - {None} == set(FAULTS), kinds
    damaged = len(kinds) - kinds.count(None)
    third = start_server(tiny_model_dir, tmp_path / "c.log", *args)
    try:
        m = metrics(third.url)
        assert _probe(third.url) == expected
    finally:
        assert third.stop() == 0
    assert m['kdaserve:offload_scan_dropped_total{tier="disk"}'] == damaged
    assert len(_entries(tier)) == len(_good(tier, largest))
