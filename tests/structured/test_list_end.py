"""The engine ends a forced list of tool calls while max_tokens can still close it
(kdaserve/structured/list_end.py): the bundled demo model, which never saw tools, keeps adding
calls until the budget cuts one in half without the rule, and closes the list with it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.assets import KIMI_LINEAR_DEMO_DIR
from kdaserve.server.tool_parsers import call_grammar
from kdaserve.structured.strict import tool_parameters

FUNCTIONS = [("summon", tool_parameters({"properties": {"who": {"enum": ["Hamlet", "Ophelia"]}},
                                         "required": ["who"]}, True)),
             ("get_time", tool_parameters(None, True))]
SEEDS = range(4)


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return LLM(str(KIMI_LINEAR_DEMO_DIR), max_model_len=512, cache_memory=64 << 20)


def run(llm: LLM, guided, max_tokens: int) -> list:
    params = [SamplingParams(temperature=0.8, max_tokens=max_tokens, guided=guided, seed=s)
              for s in SEEDS]
    return [o.outputs[0] for o in llm.generate(["Call the tools."] * len(params), params,
                                               use_tqdm=False)]


@pytest.mark.parametrize("max_tokens", [60, 160])
def test_the_list_closes_within_max_tokens(llm, max_tokens):
    g = call_grammar(FUNCTIONS, parallel=True)
    assert g.list_separator
    outs = run(llm, g, max_tokens)
    for c in outs:
        assert c.finish_reason == "stop", c.text
        calls = json.loads(c.text)
        assert calls and all(set(call) == {"name", "arguments"} for call in calls)
    if max_tokens > 100:      # the rule ends the list, it does not stop it at one call
        assert max(len(json.loads(c.text)) for c in outs) > 1
    # without the rule the same seeds run into the limit: the rule is what closes the list
    cut = run(llm, replace(g, list_separator=""), max_tokens)
    assert sum(c.finish_reason == "length" for c in cut) >= len(SEEDS) // 2


def test_one_call_lists_have_no_rule():
    assert call_grammar(FUNCTIONS, parallel=False).list_separator == ""
