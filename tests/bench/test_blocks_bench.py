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
