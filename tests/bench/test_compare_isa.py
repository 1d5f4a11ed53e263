"""`kdaserve bench compare --isa all`: one run per variant this CPU executes, each reporting
the variant its kernels were built for."""

from __future__ import annotations

import json

from kdaserve.ops.cpu_isa import native_isa, runnable_variants


def test_compare_runs_each_variant(capsys):
    from kdaserve.cli import main

    assert main(["bench", "compare", "--isa", "all", "--json", "--repeats", "1",
                 "--workloads", "single", "--single-input", "4", "--single-output", "2",
                 "--threads", "1", "--peers-dir", "/nonexistent"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["cpu_isa"] == "all" and out["native"] == native_isa()
    want = runnable_variants() or ["native"]
    assert sorted(out["variants"]) == sorted(want)
    for variant, report in out["variants"].items():
        assert "error" not in report, report
        assert report["cpu_isa"] == (native_isa() if variant == "native" else variant)
        assert report["repeats"] == 1 and "kdaserve_single_tok_s" in report
