"""`kdaserve bench blocks`: a decode step's time per fused block, from the engine itself."""

from __future__ import annotations

import json

from compiled_kernels import needs_kernels

pytestmark = needs_kernels


def test_blocks_are_timed_per_step(capsys):
    from kdaserve.cli import main

    assert main(["bench", "blocks", "--batch", "1,3", "--input", "6", "--output", "4",
                 "--repeats", "1", "--threads", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["cpu_isa"] and set(out["batches"]) == {"1", "3"}
    for row in out["batches"].values():
        assert "error" not in row, row
        # the bundled demo: 6 KDA and 2 MLA mixers, a dense MLP and 7 MoE blocks, the head
        assert all(row[f"{k}_us"] > 0 for k in ("kda", "mla", "mlp", "moe", "head")), row
        parts = sum(row[f"{k}_us"] for k in ("kda", "mla", "mlp", "moe", "head"))
        assert abs(row["blocks_us"] - parts) <= 3          # each rounded on its own
        assert row["tok_s"] > 0 and row["step_us"] > 0
        if row["calling_threads"] == 1:
            assert row["outside_blocks_us"] == row["step_us"] - row["blocks_us"]


def test_two_builds_alternate_step_by_step():
    """bench blocks --against-*: the other build's table takes every other step, each side's
    block calls timed apart."""
    from kdaserve.bench.blocks_ab import Alternating

    calls: list = []

    class Table:
        def __init__(self, tag):
            self.tag, self.parallel = tag, True

        def __getattr__(self, name):
            return lambda *a: calls.append((self.tag, name))

    alt = Alternating([Table("a"), Table("b")])
    for _ in range(3):
        alt.kda(1)
        alt.moe(2)
        alt.head(3)
    alt.embed(0)                                  # not a block: the default build's, untimed
    assert calls == [(t, n) for t in "aba" for n in ("kda", "moe", "head")] + [("a", "embed")]
    assert alt.parallel is True and alt.steps == [2, 1]
    out = alt.report()
    assert out["steps"] == [2, 1] and set(out) == {"steps", "kda", "moe", "head", "blocks"}
    assert all(out[k]["a_us"] >= 0 and out[k]["b_us"] >= 0 for k in ("kda", "moe", "head"))


def test_blocks_against_another_build(capsys):
    from kdaserve.cli import main

    assert main(["bench", "blocks", "--batch", "1", "--input", "6", "--output", "4",
                 "--repeats", "1", "--threads", "1", "--json",
                 "--against-cflags=-DMLA_MIN_SPAN=64"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["b"] == {"csrc": None, "cflags": "-DMLA_MIN_SPAN=64"}
    row = out["batches"]["1"]
    assert row["steps"] == [2, 2]                 # 4 decode steps, every other one each
    for k in ("kda", "mla", "mlp", "moe", "head", "blocks"):
        assert row[k]["a_us"] > 0 and row[k]["b_us"] > 0, (k, row)
    assert len(out["read_bytes_per_s"]) == 2 and min(out["read_bytes_per_s"]) > 0
