"""Tool-call and reasoning parsers on fixed K3- and K2-format strings: whole messages, every
split into two stream chunks, several calls, malformed calls (text, never an exception)."""

from __future__ import annotations

import json

import pytest

from kdaserve.server.chat_output import ChatOutput
from kdaserve.server.reasoning import REASONING_FORMATS, ReasoningParser
from kdaserve.server.tool_parsers import (
    JsonCallsParser,
    KimiK2ToolParser,
    KimiK3ToolParser,
    collect,
)

K3 = ('Let me check.<|open|>tools<|sep|>\n'
      '<|open|>call tool="get_weather" index="1"<|sep|>'
      '<|open|>argument key="city" type="string"<|sep|>To"kyo\n<|close|>argument<|sep|>'
      '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
      '<|open|>argument key="opts" type="object"<|sep|>{"a": [1]}<|close|>argument<|sep|>'
      '<|close|>call<|sep|>\n'
      '<|open|>call tool="search" index="2"<|sep|><|open|>json type="object"<|sep|>'
      '{"q": "caf\u00e9", "n": [1, 2]}<|close|>json<|sep|><|close|>call<|sep|>'
      '<|close|>tools<|sep|>')
K2 = ('Sure.<|tool_calls_section_begin|>'
      '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
      '{"city": "Beijing"}<|tool_call_end|>'
      '<|tool_call_begin|>functions.search:1<|tool_call_argument_begin|>{"q": 1}'
      '<|tool_call_end|><|tool_calls_section_end|>')
JSON_CALLS = ('[{"name": "get_weather", "arguments": {"city": "a}b\\"", "n": [1, {"x": 2}]}}, '
              '{"name": "f", "arguments": {}}]')


def calls_of(msg):
    return [(c.name, json.loads(c.arguments)) for c in msg.tool_calls]


def test_k3_whole_message():
    msg = KimiK3ToolParser.parse(K3)
    assert msg.content == "Let me check."
    assert calls_of(msg) == [
        ("get_weather", {"city": 'To"kyo\n', "days": 3, "opts": {"a": [1]}}),
        ("search", {"q": "caf\u00e9", "n": [1, 2]})]
    assert all(c.id.startswith("call_") for c in msg.tool_calls)


def test_k2_whole_message():
    msg = KimiK2ToolParser.parse(K2)
    assert msg.content == "Sure."
    assert calls_of(msg) == [("get_weather", {"city": "Beijing"}), ("search", {"q": 1})]
    assert [c.id for c in msg.tool_calls] == ["functions.get_weather:0", "functions.search:1"]


@pytest.mark.parametrize("parser,text", [(KimiK3ToolParser, K3), (KimiK2ToolParser, K2),
                                         (JsonCallsParser, JSON_CALLS)])
@pytest.mark.parametrize("eager", [True, False])
def test_every_split_point_gives_the_whole_result(parser, text, eager):
    whole = parser.parse(text)
    for cut in range(len(text) + 1):
        p = parser(eager=eager)
        got = collect(p.feed(text[:cut]) + p.feed(text[cut:]) + p.finish())
        assert got.content == whole.content, cut
        assert calls_of(got) == calls_of(whole), cut


def test_eager_streams_arguments_in_pieces():
    p = KimiK3ToolParser(eager=True)
    deltas = [e for ch in K3 for e in p.feed(ch)] + p.finish()
    firsts = [e for e in deltas if not isinstance(e, str) and e.name]
    assert [e.name for e in firsts] == ["get_weather", "search"]
    assert sum(1 for e in deltas if not isinstance(e, str) and e.arguments) > 10


@pytest.mark.parametrize("parser,text", [
    (KimiK3ToolParser, '<|open|>tools<|sep|><|open|>call index="1"<|sep|>x<|close|>call<|sep|>'
                       '<|close|>tools<|sep|>'),                                  # no name
    (KimiK3ToolParser, '<|open|>tools<|sep|><|open|>call tool="a"<|sep|><|open|>json<|sep|>'
                       '{bad<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'),
    (KimiK3ToolParser, '<|open|>tools<|sep|><|open|>call tool="a"<|sep|><|open|>argument '
                       'key="k"<|sep|>unfinished'),                                # cut off
    (KimiK3ToolParser, '<|open|>tools<|sep|><|open|>call tool="a"<|sep|><|close|>json<|sep|>'
                       '<|close|>call<|sep|>'),                                   # stray close
    (KimiK2ToolParser, '<|tool_calls_section_begin|><|tool_call_begin|>functions.a:0'
                       '<|tool_call_argument_begin|>{bad<|tool_call_end|>'),
    (KimiK2ToolParser, '<|tool_calls_section_begin|><|tool_call_begin|>no id here'
                       '<|tool_call_argument_begin|>{}<|tool_call_end|>'),
    (KimiK2ToolParser, '<|tool_calls_section_begin|><|tool_call_begin|>functions.a:0'
                       '<|tool_call_argument_begin|>{"a": 1'),
    (JsonCallsParser, "not json at all"),
])
def test_malformed_calls_come_back_as_text(parser, text):
    msg = parser.parse(text)
    assert msg.tool_calls == []
    assert msg.content                          # the text is not lost
    for cut in range(len(text) + 1):            # streaming never raises either
        p = parser(eager=True)
        p.feed(text[:cut])
        p.feed(text[cut:])
        p.finish()


@pytest.mark.parametrize("eager", [True, False])
def test_forced_calls_cut_by_max_tokens_are_dropped_never_half_sent(eager):
    """A grammar-forced list cut anywhere: the complete calls, and nothing of the cut one
    (neither a header whose arguments do not parse, nor its text as content)."""
    second = JSON_CALLS.index('{"name": "f"')
    for cut in range(len(JSON_CALLS)):
        p = JsonCallsParser(eager=eager)
        events = []
        for i in range(0, cut, 3):                  # streamed in small pieces
            events += p.feed(JSON_CALLS[i:min(i + 3, cut)])
            sent = collect(events).tool_calls
            assert all(json.loads(c.arguments) is not None for c in sent), cut
        msg = collect(events + p.finish())
        args_closed = JSON_CALLS.index("}}, ") + 1
        want = ([] if cut < args_closed else ["get_weather"]) + \
            (["f"] if cut >= second + len('{"name": "f", "arguments": {}') else [])
        assert [c.name for c in msg.tool_calls] == want, cut
        assert msg.content == "", cut
        for c in msg.tool_calls:
            json.loads(c.arguments)


def test_one_good_call_among_bad_ones():
    text = ('<|open|>tools<|sep|><|open|>call<|sep|><|close|>call<|sep|>'
            '<|open|>call tool="ok"<|sep|><|open|>json<|sep|>{"x": 1}<|close|>json<|sep|>'
            '<|close|>call<|sep|><|close|>tools<|sep|>')
    msg = KimiK3ToolParser.parse(text)
    assert calls_of(msg) == [("ok", {"x": 1})]
    assert "<|open|>call<|sep|>" in msg.content


@pytest.mark.parametrize("name,start,end", [
    ("kimi_k3", "<|open|>think<|sep|>", "<|close|>think<|sep|>"),
    ("kimi_k2", "<think>", "</think>")])
def test_reasoning_split_streamed(name, start, end):
    fmt = REASONING_FORMATS[name]
    text = f"{start}Hmm, the user wants rain.{end}It rains."
    assert ReasoningParser.split(fmt, text) == ("Hmm, the user wants rain.", "It rains.")
    # the template opened the thinking block: output starts in reasoning
    assert ReasoningParser.split(fmt, text[len(start):], prompt_text="x" + start) == (
        "Hmm, the user wants rain.", "It rains.")
    for cut in range(len(text) + 1):
        p = ReasoningParser(fmt)
        pieces = p.feed(text[:cut]) + p.feed(text[cut:]) + p.finish()
        assert "".join(t for r, t in pieces if r) == "Hmm, the user wants rain."
        assert "".join(t for r, t in pieces if not r) == "It rains."


def test_chat_output_reasoning_then_calls_and_specials_dropped():
    fmt = REASONING_FORMATS["kimi_k3"]
    text = "<|open|>think<|sep|>plan<|close|>think<|sep|>" + K3 + "<|im_end|>"
    specials = ["<|im_end|>", "<|open|>", "<|close|>", "<|sep|>"]
    for eager in (True, False):
        for cut in (0, 7, 30, len(text) // 2, len(text) - 3):
            out = ChatOutput(ReasoningParser(fmt), KimiK3ToolParser(eager=eager), specials)
            a, b = out.feed(text[:cut]), out.feed(text[cut:])
            c = out.finish()
            assert a.reasoning + b.reasoning + c.reasoning == "plan"
            assert a.content + b.content + c.content == "Let me check."
            assert len(collect(a.calls + b.calls + c.calls).tool_calls) == 2
