"""vLLM's prompt_logprobs shape: the prompt token first, then the top N with 1-based ranks; a
prompt token outside the top N has no rank; None for the first position."""

from __future__ import annotations

from kdaserve.server.prompt_logprobs import format_prompt_logprobs


def test_ranks_and_order():
    lps = [None,
           {7: -0.1, 3: -2.0, 9: -3.0},            # prompt token 9 is the 3rd of the top 3
           {4: -0.5, 5: -1.0, 6: -1.5, 8: -4.0}]   # prompt token 8 is outside the top 3
    got = format_prompt_logprobs([1, 9, 8], lps, 3, lambda t: f"<{t}>")
    assert got[0] is None
    assert list(got[1]) == ["9", "7", "3"]
    assert [got[1][k].rank for k in ("9", "7", "3")] == [3, 1, 2]
    assert list(got[2]) == ["8", "4", "5", "6"] and got[2]["8"].rank is None
    assert got[2]["4"].decoded_token == "<4>" and got[2]["8"].logprob == -4.0


def test_only_the_requested_alternatives():
    """echo with a larger logprobs makes the engine keep more alternatives than asked here."""
    got = format_prompt_logprobs([1, 2], [None, {2: -1.0, 3: -0.5, 4: -2.0, 5: -3.0}], 1,
                                 str)
    assert list(got[1]) == ["2", "3"] and got[1]["3"].rank == 1 and got[1]["2"].rank is None
