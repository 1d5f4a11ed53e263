"""Schemathesis against the live server, the schema's value ranges widened by a hook to
extreme integers (beyond 64 bits included) and arbitrary unicode (lone surrogates included):
no generated request may get a 5xx. Bounded: 50 examples per operation."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from server_harness import start_server

schemathesis = pytest.importorskip("schemathesis")

EXTREME_INTS = st.one_of(st.integers(), st.sampled_from(
    [2**31, 2**63, 2**64 - 1, 2**64, 2**64 + 1, -(2**63) - 1, 10**30, -1, 0, 1]))
ANY_TEXT = st.text(alphabet=st.characters(codec=None), max_size=40)   # surrogates included


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "fuzz.log"
    srv = start_server(tiny_model_dir, log, "--max-model-len", "256", "--torch-threads", "1",
                       "--max-seqs-per-request", "16", "--request-timeout", "120")
    yield srv
    assert srv.stop() == 0
    assert 'HTTP/1.1" 5' not in srv.log()        # no 5xx, whatever the test saw


def _widen(model: str):
    """flatmap_body hook: each field may be replaced by an extreme integer or any text; the
    model name is mostly the served one, so requests get past it to the engine."""

    def flatmap_body(ctx, body):
        if not isinstance(body, dict):
            return st.just(body)
        keys = sorted(body)

        def patch(picks):
            choice, model_pick = picks
            out = dict(body)
            for k, (kind, v) in zip(keys, choice):
                if kind == "int" and isinstance(out[k], int) and not isinstance(out[k], bool):
                    out[k] = v
                elif kind == "text" and isinstance(out[k], str):
                    out[k] = v
            if model_pick:
                out["model"] = model
            return out

        field = st.tuples(st.sampled_from(["keep", "keep", "int", "text"]),
                          st.one_of(EXTREME_INTS, ANY_TEXT))
        return st.tuples(st.lists(field, min_size=len(keys), max_size=len(keys)),
                         st.booleans() | st.just(True)).map(patch)

    return flatmap_body


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    raw = httpx.get(fuzz_server.url + "/openapi.json", timeout=30).json()
    model = httpx.get(fuzz_server.base_url + "/models", timeout=30).json()["data"][0]["id"]
    schema = schemathesis.openapi.from_dict(raw)
    schema.config.base_url = fuzz_server.url
    schema.hook(_widen(model))
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    resp = case.call(timeout=120)
    assert resp.status_code < 500, (case.method, case.path, case.body, resp.text[:300])
