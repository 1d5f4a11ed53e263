"""`kdaserve plan --calibrate` (kdaserve/plan/calibrate.py): the simulator, with a step cost
fitted to the demo model's steps, predicts the throughput and median TTFT the engine reaches
on a `kdaserve bench serve` workload within ±25%.

Not a wall-clock test: the run is timed on the process's CPU clock (what a dedicated core
would show; waiting for a core on a shared machine is not counted), and the fit and the check
come from the same run, so a slower or faster machine moves both."""

from __future__ import annotations

import json

TOLERANCE = 0.25


def test_calibration_within_tolerance(capsys):
    from kdaserve.cli import main

    assert main(["plan", "--calibrate", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    m, s = out["measured"], out["simulated"]
    # the same workload on both sides: the same requests, all served, the same tokens
    assert m["completed"] == s["completed"] == out["workload"]["num_prompts"]
    assert m["total_output_tokens"] == s["total_output_tokens"]
    assert m["total_input_tokens"] == s["total_input_tokens"]
    assert out["step_cost_fit"]["steps"] >= 40
    for key in ("simulated_vs_measured_throughput", "simulated_vs_measured_ttft_p50"):
        assert abs(out[key] - 1.0) <= TOLERANCE, (key, out[key], m, s, out["step_cost_fit"])
