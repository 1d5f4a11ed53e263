"""The real server with --tensor-parallel-size 2, with --data-parallel-size 2
--expert-parallel-size 2, and with --pipeline-parallel-size 2 (the bundled demo model, 2 gloo
workers under the engine process):
greedy completions through the `openai` client, one at a time, concurrent
and streamed, equal one process's offline output token for token, and a SIGTERM leaves no
process behind."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from kdaserve import LLM, SamplingParams
from kdaserve.assets import KIMI_LINEAR_DEMO_DIR
from server_harness import start_server

PROMPTS = ["The king and the queen", "Once upon a time", "Speak, for I"]
MAX_TOKENS = 12
# Explicit penalties on both sides: the server would otherwise apply the demo's
# generation_config.json defaults (repetition_penalty 1.1), which LLM(...) does not.
SAMPLING = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "repetition_penalty": 1.1}


def _proc_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _pids(field: int, value: int) -> list[int]:
    """Live (non-zombie) pids whose /proc stat field `field` (after the name) equals value."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _proc_fields(int(stat.parent.name))
        if fields and fields[0] != "Z" and int(fields[field]) == value:
            out.append(int(stat.parent.name))
    return out


def _children(pid: int) -> list[int]:
    return _pids(1, pid)          # field 1: parent pid


def _session(sid: int) -> list[int]:
    return _pids(3, sid)          # field 3: session id (the server runs in its own session)


@pytest.fixture(scope="module")
def offline() -> list[tuple[str, list[int]]]:
    """One process's greedy outputs, the reference of every layout."""
    llm = LLM(str(KIMI_LINEAR_DEMO_DIR), num_threads=1, cache_memory=64 << 20, max_model_len=512)
    outs = llm.generate(PROMPTS, SamplingParams(**SAMPLING), use_tqdm=False)
    return [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outs]


@pytest.mark.parametrize("layout", [
    ("--tensor-parallel-size", "2"),
    ("--data-parallel-size", "2", "--expert-parallel-size", "2"),
    ("--pipeline-parallel-size", "2"),
], ids=["tp2", "dp2-ep2", "pp2"])
def test_parallel_server_matches_offline(tmp_path, layout, offline):
    srv = start_server(KIMI_LINEAR_DEMO_DIR, tmp_path / "server.log", "--torch-threads", "1",
                       *layout, "--cache-memory", "64MiB", "--max-model-len", "512",
                       "--log-level", "info")
    try:
        workers = _children(srv.engine_pid())
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0,
                               timeout=120)
        model = client.models.list().data[0].id
        extra = {"ignore_eos": True, "repetition_penalty": SAMPLING["repetition_penalty"],
                 "return_tokens_as_token_ids": True}

        def complete(prompt: str) -> tuple[str, list[str]]:
            comp = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0, logprobs=0, extra_body=extra)
            return comp.choices[0].text, comp.choices[0].logprobs.tokens

        one_by_one = [complete(p) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:     # batched steps across the ranks
            concurrent = list(pool.map(complete, PROMPTS))
        stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True, extra_body=extra)
        streamed = "".join(c.choices[0].text for c in stream if c.choices)
        log = srv.log()
    finally:
        code = srv.stop()
    assert code == 0, srv.log()
    assert "2 worker processes ready" in log, log
    assert len(workers) >= 2, workers
    for got in (one_by_one, concurrent):
        for (text, tokens), (want_text, want_ids) in zip(got, offline):
            assert text == want_text
            assert tokens == [f"token_id:{i}" for i in want_ids]
    assert streamed == offline[0][0]
    # A clean shutdown: the workers, the engine and anything else the server started are gone.
    deadline = time.monotonic() + 15
    while _session(srv.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _session(srv.proc.pid)
    assert not [w for w in workers if _proc_fields(w) and _proc_fields(w)[0] != "Z"]
