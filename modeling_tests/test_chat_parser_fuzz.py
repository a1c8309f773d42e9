"""Property tests for transformers_k3.chat: `parse_kimi_k3_response` survives any output (a `KimiK3Response`, or
`KimiK3ParseError` and nothing else), and `format_kimi_k3_tool_calls` -> `parse_kimi_k3_response` is lossless."""

from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transformers_k3 import build_test_tokenizer
from transformers_k3.chat import (
    KimiK3ParseError,
    KimiK3Response,
    KimiK3ToolCall,
    format_kimi_k3_tool_calls,
    parse_kimi_k3_response,
)
from transformers_k3.encoding_kimi_k3 import KimiK3Prompt, Segment

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_IDS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TOKENIZER = build_test_tokenizer()

# Fragments of the format: markers, tag names, attribute starts, quotes, JSON brackets, end tokens, letters.
FRAGMENTS = [
    "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]", "[EOT]", "<|", "|>", "<|media_pad|>",
    "think", "response", "tools", "message", "call", "argument", "json", "weird",
    ' role="assistant"', ' tool="', ' index="', ' key="', ' type="', 'call tool="', 'argument key="', 'index="',
    'type="', "string", "number", "boolean", "array", "object", "null", "1", "-2.5", "true", "x",
    '"', "&amp;", "&quot;", "&", "=", " ", "\n", "[", "]", "{", "}", ":", ",", "a", "é", "\U0001f600",
]
fragment_text = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=3), max_size=80).map("".join)


def tag_segments(kind: str, name: str, attributes: list[str], control: bool) -> list[Segment]:
    return [Segment(f"<|{kind}|>", control), Segment(name, False), *(Segment(a, False) for a in attributes),
            Segment("<|sep|>", control)]


ATTRIBUTES = st.lists(st.sampled_from([' tool="f"', ' index="1"', ' index="x"', ' key="k"', ' type="string"',
                                       ' type="number"', ' type="array"', ' role="assistant"', ' garbage', ""]),
                      max_size=3)
TAG_NAMES = st.sampled_from(["think", "response", "tools", "call", "argument", "json", "message", "weird", ""])


@st.composite
def nested(draw, depth: int = 0) -> list[Segment]:
    """Randomly nested (and randomly unbalanced) blocks; markers sometimes real (control) and sometimes spelled."""
    out: list[Segment] = []
    for _ in range(draw(st.integers(0, 4))):
        choice = draw(st.integers(0, 5 if depth < 4 else 1))
        if choice <= 1:
            out.append(Segment(draw(fragment_text), draw(st.booleans())))
        elif choice == 2:
            out.append(Segment(draw(st.sampled_from(["<|end_of_msg|>", "[EOS]", "<|sep|>", "<|open|>", "<|close|>"])),
                               draw(st.booleans())))
        else:
            name, control = draw(TAG_NAMES), draw(st.booleans())
            out += tag_segments("open", name, draw(ATTRIBUTES), control)
            out += draw(nested(depth + 1))
            if draw(st.integers(0, 3)):  # usually closed, with the same name or another one
                out += tag_segments("close", draw(st.sampled_from([name, name, name, "call", "think"])), [],
                                    draw(st.booleans()))
    return out


def check(answer) -> None:
    assert isinstance(answer, KimiK3Response)
    assert answer.reasoning is None or (isinstance(answer.reasoning, str) and answer.reasoning)
    assert isinstance(answer.content, str) and isinstance(answer.finished, bool)
    assert all(isinstance(e, str) for e in answer.errors)
    for call in answer.tool_calls:
        assert isinstance(call, KimiK3ToolCall) and isinstance(call.name, str) and isinstance(call.index, int)
        assert isinstance(call.arguments, (dict, str))
    json.dumps(answer.to_message())


def parse_or_named_error(*args, **kwargs) -> None:
    try:
        answer = parse_kimi_k3_response(*args, **kwargs)
    except KimiK3ParseError:
        return
    check(answer)


@FUZZ
@given(output=fragment_text, prompt=st.none() | fragment_text)
def test_any_text_gives_a_response(output, prompt):
    parse_or_named_error(output, prompt)
    parse_or_named_error(output, prompt, tokenizer=TOKENIZER)


@FUZZ
@given(segments=nested(), prompt=st.none() | nested())
def test_any_nesting_gives_a_response(segments, prompt):
    output = KimiK3Prompt(segments)
    prompt = None if prompt is None else KimiK3Prompt(prompt)
    parse_or_named_error(output, prompt)  # real markers: the control segments only
    parse_or_named_error(str(output), None if prompt is None else str(prompt))  # every spelled marker


@FUZZ_IDS
@given(ids=st.lists(st.integers(0, len(TOKENIZER) - 1), max_size=200),
       prompt=st.none() | st.lists(st.integers(0, len(TOKENIZER) - 1), max_size=50))
def test_any_token_ids_give_a_response(ids, prompt):
    parse_or_named_error(ids, prompt, tokenizer=TOKENIZER)


@FUZZ_IDS
@given(segments=nested())
def test_nesting_as_token_ids(segments):
    ids: list[int] = []
    for segment in segments:
        ids += TOKENIZER(segment.text, add_special_tokens=False, split_special_tokens=not segment.control)["input_ids"]
    parse_or_named_error(ids, tokenizer=TOKENIZER)


# ---------------------------------------------------------------- lossless format -> parse
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4),
    max_leaves=12,
)
arguments = st.dictionaries(st.text(), json_values, max_size=5)
calls = st.lists(st.builds(KimiK3ToolCall, name=st.text(), arguments=arguments | st.text(),
                           index=st.integers(1, 10 ** 6)), max_size=4)


def same(a, b) -> bool:
    """Equal and of the same JSON type all the way down (Python's == has True == 1 == 1.0)."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return type(a) is type(b) and (a == b or (math.isinf(a) and a == b))
    if isinstance(a, str) or isinstance(b, str):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return False


def expected_arguments(arguments):
    """What a call's arguments read back as: a JSON-object string is that object, a blank one none, any other
    string that string (json block)."""
    if not isinstance(arguments, str):
        return arguments
    if not arguments.strip():
        return {}
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def check_lossless(original: list[KimiK3ToolCall], answer: KimiK3Response) -> None:
    assert [c.name for c in answer.tool_calls] == [c.name for c in original]
    assert [c.index for c in answer.tool_calls] == [c.index for c in original]
    for got, want in zip(answer.tool_calls, original):
        assert same(got.arguments, expected_arguments(want.arguments)), (got.arguments, want.arguments)


@FUZZ
@given(calls=calls)
def test_format_then_parse_is_lossless(calls):
    formatted = format_kimi_k3_tool_calls(calls)
    assert isinstance(formatted, KimiK3Prompt)
    check_lossless(calls, parse_kimi_k3_response(formatted))
    # OpenAI-style dicts with JSON-string arguments: indices become the positions
    as_dicts = [{"id": f"{c.name}:{i}", "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments if isinstance(c.arguments, str) else
                              json.dumps(c.arguments, ensure_ascii=False)}}
                for i, c in enumerate(calls, start=1)]
    renumbered = [KimiK3ToolCall(c.name, c.arguments, i) for i, c in enumerate(calls, start=1)]
    check_lossless(renumbered, parse_kimi_k3_response(format_kimi_k3_tool_calls(as_dicts)))


@FUZZ_IDS
@given(calls=calls)
def test_format_then_parse_is_lossless_as_token_ids(calls):
    ids: list[int] = []
    for segment in format_kimi_k3_tool_calls(calls).segments:
        ids += TOKENIZER(segment.text, add_special_tokens=False, split_special_tokens=not segment.control)["input_ids"]
    check_lossless(calls, parse_kimi_k3_response(ids, tokenizer=TOKENIZER))


LONG_OUTPUTS = {
    "open markers": "<|open|>" * 20000,
    "think opens": "<|open|>think<|sep|>" * 20000,
    "unclosed arguments": '<|open|>argument key="k" type="array"<|sep|>' * 5000,
    "unclosed calls": "<|open|>tools<|sep|>" + '<|open|>call tool="f" index="1"<|sep|>' * 20000,
    "unclosed argument values": "<|open|>tools<|sep|>" + ('<|open|>call tool="f" index="1"<|sep|><|open|>argument '
                                                          'key="k" type="string"<|sep|>v') * 5000,
    # cut-off tag headers that a backtracking pattern would take exponential time to reject
    "spaces in a cut tag": "<|open|>a" + " " * 5000 + "!",
    "words in a cut attribute": '<|open|>call k="a b c d e f g h' * 500 + "!",
    "many attributes": "<|open|>a" + ' x=""' * 5000 + " !",
}


@pytest.mark.parametrize("output", list(LONG_OUTPUTS.values()), ids=list(LONG_OUTPUTS))
def test_long_adversarial_outputs_stay_fast(output):
    start = time.perf_counter()
    check(parse_kimi_k3_response(output))
    assert time.perf_counter() - start < 5.0
