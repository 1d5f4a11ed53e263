"""`kdaserve serve --speculative-method ngram|dspark` on the bundled demo model (its greedy
continuations repeat, so prompt lookup does propose drafts; the DSpark draft ships with it):
concurrent greedy completions over HTTP are token-identical to `LLM.generate` without
speculation, drafts are proposed and accepted (/metrics), and the cache is fully free after."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from server_harness import start_server, wait_idle

from kdaserve import LLM, SamplingParams
from kdaserve.assets import kimi_linear_demo_path

PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo!", "HAMLET:\nTo be, or not to be", "KING:\n"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(str(kimi_linear_demo_path()), enable_prefix_caching=False)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def _complete_all(base_url: str) -> list[list[int]]:
    def one(prompt: str) -> list[int]:
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as c:
            r = c.completions.create(
                model="kdaserve-demo", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"repetition_penalty": 1.0, "ignore_eos": True,
                            "return_token_ids": True})
            return r.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


# Adaptive speculation decides from wall-clock step costs, so whether it keeps drafting after its
# first probes depends on the machine's load: with it on, only the bookkeeping is asserted; with it
# off (a fixed k), drafts must be accepted.
@pytest.mark.parametrize(("method", "adaptive"),
                         [("ngram", False), ("dspark", False), ("dspark", True)])
def test_speculative_server_is_identical(method, adaptive, reference, tmp_path):
    srv = start_server(kimi_linear_demo_path(), tmp_path / "spec.log", "--cache-memory", "64MiB",
                       "--served-model-name", "kdaserve-demo",
                       "--speculative-method", method, "--speculative-tokens", "4",
                       "--speculative-adaptive" if adaptive else "--no-speculative-adaptive")
    try:
        assert _complete_all(srv.base_url) == reference
        after = wait_idle(srv.url)
    finally:
        srv.stop()
    assert after["kdaserve:cache_all_free"] == 1
    drafted = after["kdaserve:spec_decode_num_draft_tokens_total"]
    accepted = after["kdaserve:spec_decode_num_accepted_tokens_total"]
    assert after["kdaserve:spec_decode_num_verifications_total"] > 0
    assert drafted > 0 and 0 <= accepted <= drafted
    # time in the drafter and in verifying steps (counters of seconds; their size is not asserted)
    assert after["kdaserve:spec_decode_draft_seconds_total"] > 0
    assert after["kdaserve:spec_decode_verify_seconds_total"] > 0
    # each completion that verified drafts: its mean tokens per verified block
    h = "kdaserve:spec_decode_request_acceptance_length"
    assert 1 <= after[f"{h}_count"] <= len(PROMPTS)
    assert after[f"{h}_count"] <= after[f"{h}_sum"] <= 5 * after[f"{h}_count"]
    if not adaptive:
        assert accepted > 0
        return
    # what adaptive speculation decided
    assert after["kdaserve:spec_decode_acceptance_rate"] == pytest.approx(accepted / drafted)
    steps = after["kdaserve:spec_decode_adaptive_steps_total"]
    assert 0 < after["kdaserve:spec_decode_steps_speculating_total"] <= steps
    assert after["kdaserve:spec_decode_drafts_planned_total"] > 0
    assert after["kdaserve:spec_decode_enabled"] in (0.0, 1.0)
    assert 0.0 <= after["kdaserve:spec_decode_acceptance_estimate"] <= 1.0
