"""`kdaserve serve --offload disk`: a server stopped the way a service manager stops it (SIGTERM)
flushes its device cache to the disk tier, and the next server on the same directory serves the
first request's prefix from disk, with the same greedy tokens."""

from __future__ import annotations

import openai
from server_harness import start_server, wait_idle

from kdaserve.assets import kimi_linear_demo_path

PROMPT = ("KING RICHARD:\nNow is the winter of our discontent made glorious summer by this sun "
          "of York; and all the clouds that lour'd upon our house in the deep bosom of the "
          "ocean buried. Now are our brows bound with victorious wreaths, our bruised arms hung "
          "up for monuments, our stern alarums changed to merry meetings.\n")


def _complete(base_url: str) -> list[int]:
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as c:
        r = c.completions.create(model="kdaserve-demo", prompt=PROMPT, max_tokens=8,
                                 temperature=0, extra_body={"return_token_ids": True,
                                                            "ignore_eos": True})
    return r.choices[0].model_extra["token_ids"]


def test_restarted_server_hits_the_disk_tier(tmp_path):
    args = ("--cache-memory", "64MiB", "--offload", "disk", "--offload-dir",
            str(tmp_path / "tier"), "--offload-bytes", "256MiB", "--torch-threads", "1")
    first = start_server(kimi_linear_demo_path(), tmp_path / "a.log", *args,
                         "--served-model-name", "kdaserve-demo")
    try:
        before = _complete(first.base_url)
        wait_idle(first.url)
    finally:
        assert first.stop() == 0
    assert any((tmp_path / "tier").rglob("*")), "nothing was written to the disk tier"
    second = start_server(kimi_linear_demo_path(), tmp_path / "b.log", *args,
                          "--served-model-name", "kdaserve-demo")
    try:
        after = _complete(second.base_url)
        m = wait_idle(second.url)
    finally:
        assert second.stop() == 0
    assert after == before
    assert m['kdaserve:offload_hits_total{tier="disk"}'] >= 1
    assert m['kdaserve:offload_hit_tokens_total{tier="disk"}'] >= 64
