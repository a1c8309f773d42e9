"""transformers_k3.chat: splitting K3 answers into reasoning / content / tool calls (spec 8), writing tool calls
back, the transformers response template, and the thinking-budget logits processor.

Expected values are written from the format rules (K3_SPEC.md section 8), not taken from the parser's output."""

from __future__ import annotations

import json

import pytest
import torch

from transformers_k3 import KimiK3ForCausalLM, KimiK3TextConfig, build_test_tokenizer
from transformers_k3.chat import (
    KIMI_K3_RESPONSE_TEMPLATE,
    MESSAGE_CLOSE,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    THINKING_END_SEQUENCE,
    TOOLS_CLOSE,
    TOOLS_OPEN,
    KimiK3ParseError,
    KimiK3Response,
    KimiK3ToolCall,
    ThinkingBudgetLogitsProcessor,
    format_kimi_k3_tool_calls,
    parse_kimi_k3_response,
)
from transformers_k3.encoding_kimi_k3 import KimiK3Prompt, Segment, render_kimi_k3_chat


# The tiny model's ops are microseconds long: see the `one_thread` fixture in conftest.py.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_test_tokenizer()
    tok.response_template = KIMI_K3_RESPONSE_TEMPLATE
    return tok


def segment_ids(tok, prompt: KimiK3Prompt) -> list[int]:
    """Token ids of a KimiK3Prompt as K3's tokenizer lays them out: control segments with special tokens matched,
    text segments with special tokens split into ordinary bytes."""
    ids: list[int] = []
    for segment in prompt.segments:
        if segment.control:
            ids += tok(segment.text, add_special_tokens=False)["input_ids"]
        else:
            ids += tok(segment.text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids


def control(text: str) -> Segment:
    return Segment(text, True)


def text(value: str) -> Segment:
    return Segment(value, False)


def tag(kind: str, name: str, *attributes: str) -> list[Segment]:
    """``<|open|>`` / ``<|close|>`` + name + attribute segments + ``<|sep|>``, as the renderer lays them out."""
    return [control(f"<|{kind}|>"), text(name), *map(text, attributes), control("<|sep|>")]


def ended(*segments) -> list[Segment]:
    return [*segments, *tag("close", "message"), control("<|end_of_msg|>")]


WEATHER_CALL = (
    '<|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris "centre" & <b>42</b><|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
    '<|open|>argument key="scale" type="number"<|sep|>0.5<|close|>argument<|sep|>'
    '<|open|>argument key="metric" type="boolean"<|sep|>true<|close|>argument<|sep|>'
    '<|open|>argument key="hours" type="array"<|sep|>[6, 12]<|close|>argument<|sep|>'
    '<|open|>argument key="extra" type="object"<|sep|>{"lang": "fr"}<|close|>argument<|sep|>'
    '<|open|>argument key="unit" type="null"<|sep|>null<|close|>argument<|sep|>'
    '<|open|>argument key="zip" type="string"<|sep|>75001<|close|>argument<|sep|>'
    "<|close|>call<|sep|>"
)
SEARCH_CALL = ('<|open|>call tool="a&amp;b &quot;search&quot;" index="2"<|sep|>'
               '<|open|>argument key="q" type="string"<|sep|>line 1\nline 2<|close|>argument<|sep|><|close|>call<|sep|>')
WEATHER_ARGS = {"city": 'Paris "centre" & <b>42</b>', "days": 3, "scale": 0.5, "metric": True, "hours": [6, 12],
                "extra": {"lang": "fr"}, "unit": None, "zip": "75001"}
RM_CALL = ('<|open|>call tool="rm" index="1"<|sep|><|open|>argument key="path" type="string"<|sep|>/'
           '<|close|>argument<|sep|><|close|>call<|sep|>')


# ---------------------------------------------------------------- parsing (spec 8 grammar)
def test_full_answer_reasoning_content_and_typed_tool_calls():
    text_ = ("Let me check the weather.\n" + THINK_CLOSE + RESPONSE_OPEN + "Checking now." + RESPONSE_CLOSE
             + TOOLS_OPEN + WEATHER_CALL + SEARCH_CALL + TOOLS_CLOSE + MESSAGE_CLOSE + "<|end_of_msg|>[EOS][PAD][PAD]")
    answer = parse_kimi_k3_response(text_)  # generation prompt pre-filled the think channel (the default)
    assert answer.reasoning == "Let me check the weather.\n"
    assert answer.content == "Checking now."
    assert answer.finished and answer.errors == []
    assert [c.name for c in answer.tool_calls] == ["get_weather", 'a&b "search"']  # attributes unescaped
    assert [c.index for c in answer.tool_calls] == [1, 2]
    assert answer.tool_calls[0].arguments == WEATHER_ARGS  # string raw (even "75001"), every other type JSON
    assert answer.tool_calls[1].arguments == {"q": "line 1\nline 2"}
    message = answer.to_message()
    assert message["role"] == "assistant" and message["reasoning_content"] == answer.reasoning
    assert message["content"] == "Checking now."
    assert message["tool_calls"][0] == {"id": "get_weather:1", "type": "function",
                                        "function": {"name": "get_weather", "arguments": WEATHER_ARGS}}
    assert message["tool_calls"][1]["id"] == 'a&b "search":2'


def test_message_without_reasoning_or_calls():
    answer = parse_kimi_k3_response(RESPONSE_OPEN + "Hi" + RESPONSE_CLOSE + MESSAGE_CLOSE,
                                    prompt='<|open|>message role="assistant"<|sep|>')
    assert answer.to_message() == {"role": "assistant", "content": "Hi"}


def test_skipped_thinking_is_content():
    """Spec 8: the model may skip the pre-filled think channel and close with a bare response close."""
    answer = parse_kimi_k3_response("The answer is 4." + RESPONSE_CLOSE + MESSAGE_CLOSE)
    assert answer.reasoning is None and answer.content == "The answer is 4." and answer.finished


def test_thinking_jumps_straight_to_tools():
    answer = parse_kimi_k3_response("I need the weather." + TOOLS_OPEN + WEATHER_CALL + TOOLS_CLOSE + MESSAGE_CLOSE)
    assert answer.reasoning == "I need the weather." and answer.content == ""
    assert answer.tool_calls[0].arguments == WEATHER_ARGS


def test_unclosed_think_then_response_open():
    answer = parse_kimi_k3_response("R" + RESPONSE_OPEN + "C" + RESPONSE_CLOSE + MESSAGE_CLOSE)
    assert (answer.reasoning, answer.content) == ("R", "C")


def test_end_tokens_end_the_message():
    for end in ("<|end_of_msg|>", "[EOS]", "[EOT]"):
        answer = parse_kimi_k3_response("R" + THINK_CLOSE + RESPONSE_OPEN + "C" + end + "ignored" + RESPONSE_CLOSE)
        assert (answer.reasoning, answer.content, answer.finished) == ("R", "C", True)


def test_prompt_decides_the_starting_channel(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    off = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, thinking=False)
    on = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    generated = "Hello!" + RESPONSE_CLOSE + MESSAGE_CLOSE
    for prompt in (off, str(off)):  # KimiK3Prompt and its plain text
        assert parse_kimi_k3_response(generated, prompt=prompt).content == "Hello!"
    assert parse_kimi_k3_response("hmm" + THINK_CLOSE + RESPONSE_OPEN + "Hi", prompt=on).reasoning == "hmm"
    # without a prompt, the thinking pre-fill is assumed: text that is closed as the response is still content
    assert parse_kimi_k3_response(generated).content == "Hello!"
    # a whole transcript: only the last assistant message counts
    transcript = str(on) + "hmm" + THINK_CLOSE + RESPONSE_OPEN + "Hi" + RESPONSE_CLOSE + MESSAGE_CLOSE
    answer = parse_kimi_k3_response(transcript)
    assert (answer.reasoning, answer.content, answer.finished) == ("hmm", "Hi", True)


def test_prompt_as_token_ids(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    off = tokenizer.apply_chat_template(messages, add_generation_prompt=True, thinking=False,
                                        return_dict=True)["input_ids"]
    generated = tokenizer.encode("Hello!" + RESPONSE_CLOSE + MESSAGE_CLOSE, add_special_tokens=False)
    answer = parse_kimi_k3_response(torch.tensor(generated), prompt=off, tokenizer=tokenizer)
    assert (answer.reasoning, answer.content, answer.finished) == (None, "Hello!", True)
    # the prompt's ids plus the generated ids (what generate() returns) read the same
    answer = parse_kimi_k3_response(list(off) + generated, tokenizer=tokenizer)
    assert (answer.reasoning, answer.content, answer.finished) == (None, "Hello!", True)


def test_a_closed_assistant_message_in_the_prompt_opens_nothing():
    history = render_kimi_k3_chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "old"}])
    answer = parse_kimi_k3_response("plain", prompt=history)
    assert answer.content == "plain" and answer.reasoning is None


@pytest.mark.parametrize("cut", ["<|close|>thi", "<|clo", "<|", "<|open|>response", "<|open|>response<|se",
                                 '<|open|>call tool="get_w'])
def test_truncated_output_drops_the_cut_marker(cut):
    answer = parse_kimi_k3_response("step one" + cut)
    assert answer.reasoning == "step one" and answer.content == "" and not answer.finished
    unfinished_call = RESPONSE_OPEN + "ok" + RESPONSE_CLOSE + TOOLS_OPEN + WEATHER_CALL[:120]
    answer = parse_kimi_k3_response(unfinished_call, prompt='<|open|>message role="assistant"<|sep|>')
    assert answer.content == "ok" and answer.tool_calls == [] and not answer.finished
    assert any("get_weather" in e and "dropped" in e for e in answer.errors)


def test_truncated_token_ids_drop_the_cut_tag(tokenizer):
    ids = tokenizer.encode("step one" + THINK_CLOSE + "<|open|>respo", add_special_tokens=False)
    answer = parse_kimi_k3_response(ids, tokenizer=tokenizer)
    assert (answer.reasoning, answer.content, answer.finished) == ("step one", "", False)


def test_parsed_message_renders_back_through_the_chat_template(tokenizer):
    answer = parse_kimi_k3_response("R" + THINK_CLOSE + RESPONSE_OPEN + "C" + RESPONSE_CLOSE + MESSAGE_CLOSE)
    history = [{"role": "user", "content": "q"}, answer.to_message()]
    rendered = tokenizer.apply_chat_template(history, tokenize=False)
    assert rendered.endswith('<|open|>message role="assistant"<|sep|>' + THINK_OPEN + "R" + THINK_CLOSE
                             + RESPONSE_OPEN + "C" + RESPONSE_CLOSE + MESSAGE_CLOSE + "<|end_of_msg|>")


def test_response_template_agrees_with_the_parser(tokenizer):
    """transformers' ``response_template`` parser with KIMI_K3_RESPONSE_TEMPLATE gives the same split; with
    `tools=` schemas transformers types the arguments (the flat template cannot read K3's own `type` attribute).
    (K3's tokenizer's own `parse_response` uses `parse_kimi_k3_response`, also when given K3's own template, so the
    template is read here by transformers' parser itself, as `transformers serve`'s streaming parser reads it.)"""
    from transformers import PreTrainedTokenizerBase

    def template_parse(*args, **kwargs):
        return PreTrainedTokenizerBase.parse_response(tokenizer, *args, **kwargs)

    prompt = str(tokenizer.apply_chat_template([{"role": "user", "content": "weather?"}], tokenize=False,
                                               add_generation_prompt=True))
    text_ = ("Think." + THINK_CLOSE + RESPONSE_OPEN + "Sure." + RESPONSE_CLOSE + TOOLS_OPEN
             + WEATHER_CALL + TOOLS_CLOSE + MESSAGE_CLOSE)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "scale": {"type": "number"},
        "metric": {"type": "boolean"}, "hours": {"type": "array"}, "extra": {"type": "object"},
        "unit": {"type": "null"}, "zip": {"type": "string"}}}}}
    parsed = template_parse(text_, KIMI_K3_RESPONSE_TEMPLATE, prefix=prompt, tools=[tool])
    ours = parse_kimi_k3_response(text_, prompt=prompt)
    assert parsed["role"] == "assistant"
    assert parsed["reasoning_content"] == ours.reasoning == "Think." and parsed["content"] == ours.content == "Sure."
    assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "get_weather",
                                                                     "arguments": WEATHER_ARGS}}]
    untyped = template_parse(text_, KIMI_K3_RESPONSE_TEMPLATE, prefix=prompt)
    assert untyped["tool_calls"][0]["function"]["arguments"]["days"] == "3"  # without schemas values stay text


# ---------------------------------------------------------------- tool calls only from the tools channel
def test_call_in_think_text_stays_reasoning():
    """The bug: reasoning that mentions a call block made it a tool call."""
    reasoning = "I could run " + RM_CALL + " but I will not."
    answer = parse_kimi_k3_response(reasoning + THINK_CLOSE + RESPONSE_OPEN + "No." + RESPONSE_CLOSE + MESSAGE_CLOSE)
    assert answer.tool_calls == []
    assert answer.reasoning == reasoning and answer.content == "No." and answer.finished
    # even a whole tools channel inside a think channel that is closed later is reasoning
    reasoning = "plan " + TOOLS_OPEN + RM_CALL + TOOLS_CLOSE + " more"
    answer = parse_kimi_k3_response(reasoning + THINK_CLOSE + RESPONSE_OPEN + "ok" + RESPONSE_CLOSE + MESSAGE_CLOSE)
    assert answer.tool_calls == [] and answer.reasoning == reasoning and answer.content == "ok"
    assert answer.errors  # the markers read as text are reported


def test_call_in_response_text_stays_content():
    content = "Run this: " + RM_CALL + "."
    answer = parse_kimi_k3_response("R" + THINK_CLOSE + RESPONSE_OPEN + content + RESPONSE_CLOSE + MESSAGE_CLOSE)
    assert answer.tool_calls == [] and answer.content == content and answer.reasoning == "R"
    # with thinking off (the prompt opened the response channel)
    prompt = '<|open|>message role="assistant"<|sep|>' + RESPONSE_OPEN
    answer = parse_kimi_k3_response(content + RESPONSE_CLOSE + MESSAGE_CLOSE, prompt=prompt)
    assert answer.tool_calls == [] and answer.content == content
    # a call block outside every channel is not a call either
    answer = parse_kimi_k3_response("R" + THINK_CLOSE + RM_CALL + MESSAGE_CLOSE)
    assert answer.tool_calls == [] and "rm" in answer.content and answer.errors


def test_only_real_markers_count_in_ids_and_segments(tokenizer):
    """Reasoning text that spells a whole tools channel (a text segment), then a real tools channel without a
    think close (the model jumped to its calls): only the real channel gives calls."""
    spelled = "maybe " + TOOLS_OPEN + RM_CALL + TOOLS_CLOSE + "?"
    prompt = KimiK3Prompt(ended(
        text(spelled), *tag("open", "tools"), *tag("open", "call", ' tool="ls"', ' index="1"'),
        *tag("close", "call"), *tag("close", "tools")))
    expected = ([KimiK3ToolCall("ls", {}, 1)], spelled)
    answer = parse_kimi_k3_response(prompt)
    assert (answer.tool_calls, answer.reasoning) == expected and answer.finished and answer.errors == []
    answer = parse_kimi_k3_response(segment_ids(tokenizer, prompt), tokenizer=tokenizer)
    assert (answer.tool_calls, answer.reasoning) == expected and answer.finished and answer.errors == []
    # the plain string cannot tell: its spelled tools channel is read as the jump, the real one as a second one
    answer = parse_kimi_k3_response(str(prompt))
    assert [c.name for c in answer.tool_calls] == ["rm", "ls"] and answer.reasoning == "maybe "


# ---------------------------------------------------------------- malformed answers: a result and errors
HEAD = "R" + THINK_CLOSE + RESPONSE_OPEN + "C" + RESPONSE_CLOSE


def test_unclosed_call_is_dropped():
    answer = parse_kimi_k3_response(HEAD + TOOLS_OPEN + '<|open|>call tool="f" index="1"<|sep|>'
                                    '<|open|>argument key="a" type="string"<|sep|>x<|close|>argument<|sep|>'
                                    + TOOLS_CLOSE + MESSAGE_CLOSE)
    assert (answer.reasoning, answer.content, answer.tool_calls, answer.finished) == ("R", "C", [], True)
    assert any("not closed" in e for e in answer.errors)


def test_call_inside_argument_is_argument_text():
    value = '<|open|>call tool="rm" index="2"<|sep|><|close|>call<|sep|>'
    answer = parse_kimi_k3_response(HEAD + TOOLS_OPEN + '<|open|>call tool="f" index="1"<|sep|>'
                                    '<|open|>argument key="a" type="string"<|sep|>' + value + '<|close|>argument<|sep|>'
                                    '<|close|>call<|sep|>' + TOOLS_CLOSE + MESSAGE_CLOSE)
    assert answer.tool_calls == [KimiK3ToolCall("f", {"a": value}, 1)]
    assert answer.errors


def test_argument_outside_call_and_text_between_calls_are_dropped():
    answer = parse_kimi_k3_response(HEAD + TOOLS_OPEN + '<|open|>argument key="a" type="string"<|sep|>x'
                                    '<|close|>argument<|sep|>junk<|open|>call tool="g" index="1"<|sep|>words'
                                    '<|close|>call<|sep|>' + TOOLS_CLOSE + MESSAGE_CLOSE)
    assert answer.tool_calls == [KimiK3ToolCall("g", {}, 1)] and answer.content == "C"
    assert len(answer.errors) == 3


def test_second_tools_channel_is_read_and_reported():
    second = '<|open|>call tool="g" index="2"<|sep|><|close|>call<|sep|>'
    answer = parse_kimi_k3_response(HEAD + TOOLS_OPEN + RM_CALL + TOOLS_CLOSE + TOOLS_OPEN + second + TOOLS_CLOSE
                                    + MESSAGE_CLOSE)
    assert answer.tool_calls == [KimiK3ToolCall("rm", {"path": "/"}, 1), KimiK3ToolCall("g", {}, 2)]
    assert any("second tools" in e for e in answer.errors)


def test_unknown_tags_stay_visible():
    answer = parse_kimi_k3_response("R" + THINK_CLOSE + '<|open|>weird x="1"<|sep|>' + RESPONSE_OPEN + "C"
                                    + RESPONSE_CLOSE + "<|sep|>" + MESSAGE_CLOSE)
    assert answer.content == '<|open|>weird x="1"<|sep|>C<|sep|>' and len(answer.errors) == 2


def test_missing_and_garbled_attributes():
    calls = ('<|open|>call index="1"<|sep|><|close|>call<|sep|>'  # no tool name: dropped
             '<|open|>call tool="a" index="one"<|sep|><|close|>call<|sep|>'  # index not a number: its position
             '<|open|>call tool="b" index="3" garbage<|sep|>'
             '<|open|>argument type="string"<|sep|>no key<|close|>argument<|sep|>'  # no key: dropped
             '<|open|>argument key="t"<|sep|>no type<|close|>argument<|sep|>'  # no type: a string
             '<|open|>argument key="u" type="decimal"<|sep|>1.5<|close|>argument<|sep|>'  # unknown type: text
             '<|open|>argument key="n" type="number"<|sep|>1,5<|close|>argument<|sep|>'  # bad JSON: text
             '<|open|>argument key="m" type="number"<|sep|>"7"<|close|>argument<|sep|>'  # wrong JSON type: kept
             '<|open|>argument key="t" type="boolean"<|sep|>false<|close|>argument<|sep|>'  # repeated: the last
             '<|close|>call<|sep|>'
             '<|open|>call tool="" index="4"<|sep|><|close|>call<|sep|>')  # empty name: kept, reported
    answer = parse_kimi_k3_response(HEAD + TOOLS_OPEN + calls + TOOLS_CLOSE + MESSAGE_CLOSE)
    assert answer.tool_calls == [
        KimiK3ToolCall("a", {}, 1),
        KimiK3ToolCall("b", {"t": False, "u": "1.5", "n": "1,5", "m": "7"}, 3),
        KimiK3ToolCall("", {}, 4),
    ]
    assert len(answer.errors) == 10


def test_json_block_arguments():
    block = '<|open|>json type="object"<|sep|>{not json<|close|>json<|sep|>'
    answer = parse_kimi_k3_response(HEAD + TOOLS_OPEN + '<|open|>call tool="f" index="1"<|sep|>' + block
                                    + '<|close|>call<|sep|>' + TOOLS_CLOSE + MESSAGE_CLOSE)
    assert answer.tool_calls == [KimiK3ToolCall("f", "{not json", 1)] and answer.errors == []
    assert answer.to_message()["tool_calls"] == [{"id": "f:1", "type": "function",
                                                  "function": {"name": "f", "arguments": "{not json"}}]
    # a json block that holds a JSON object gives that object
    answer = parse_kimi_k3_response(HEAD + TOOLS_OPEN + '<|open|>call tool="f" index="1"<|sep|><|open|>json '
                                    'type="object"<|sep|>{"a": [1]}<|close|>json<|sep|><|close|>call<|sep|>'
                                    + TOOLS_CLOSE)
    assert answer.tool_calls == [KimiK3ToolCall("f", {"a": [1]}, 1)]


@pytest.mark.parametrize("value", ["[" * 100000, "[" * 50000 + "]" * 50000, '{"a":' * 30000, "1" * 100000],
                         ids=["unclosed", "deep", "deep-object", "huge-int"])
def test_huge_or_deep_json_is_kept_as_text(value):
    arguments = ('<|open|>call tool="f" index="1"<|sep|><|open|>argument key="v" type="array"<|sep|>' + value
                 + '<|close|>argument<|sep|><|close|>call<|sep|>')
    answer = parse_kimi_k3_response(HEAD + TOOLS_OPEN + arguments + TOOLS_CLOSE + MESSAGE_CLOSE)
    assert answer.tool_calls == [KimiK3ToolCall("f", {"v": value}, 1)] and len(answer.errors) == 1
    block = '<|open|>call tool="f" index="1"<|sep|><|open|>json type="object"<|sep|>' + value
    answer = parse_kimi_k3_response(HEAD + TOOLS_OPEN + block + '<|close|>json<|sep|><|close|>call<|sep|>'
                                    + TOOLS_CLOSE + MESSAGE_CLOSE)
    assert answer.tool_calls == [KimiK3ToolCall("f", value, 1)]


def test_wrong_input_types():
    for bad in (None, 42, b"<|open|>", {"input_ids": [1]}, 1.5):
        with pytest.raises(TypeError):
            parse_kimi_k3_response(bad)
    with pytest.raises(TypeError, match="tokenizer"):
        parse_kimi_k3_response([1, 2, 3])
    tok = build_test_tokenizer()
    with pytest.raises(TypeError, match="1-D"):
        parse_kimi_k3_response(torch.zeros(2, 3, dtype=torch.long), tokenizer=tok)
    with pytest.raises(TypeError, match="integers"):
        parse_kimi_k3_response(["a", "b"], tokenizer=tok)
    with pytest.raises(TypeError):
        parse_kimi_k3_response("text", prompt=3.0)
    assert issubclass(KimiK3ParseError, ValueError)
    # ids outside the vocabulary: skipped and reported, not an exception
    answer = parse_kimi_k3_response([-1, 10 ** 6] + tok.encode("ok", add_special_tokens=False), tokenizer=tok)
    assert answer.reasoning == "ok" and len(answer.errors) == 2


# ---------------------------------------------------------------- format_kimi_k3_tool_calls
def test_format_segment_layout_by_hand():
    calls = [{"id": "x", "type": "function", "function": {"name": "f", "arguments": {"q": "a", "n": 2, "e": ""}}},
             {"name": "g&\"", "arguments": "not json"}]
    expected = (
        tag("open", "tools")
        + tag("open", "call", ' tool="f"', ' index="1"')
        + tag("open", "argument", ' key="q"', ' type="string"') + [text("a")] + tag("close", "argument")
        + tag("open", "argument", ' key="n"', ' type="number"') + [text("2")] + tag("close", "argument")
        + tag("open", "argument", ' key="e"', ' type="string"') + tag("close", "argument")  # no empty segment
        + tag("close", "call")
        + tag("open", "call", ' tool="g&amp;&quot;"', ' index="2"')
        + tag("open", "json", ' type="object"') + [text("not json")] + tag("close", "json")
        + tag("close", "call")
        + tag("close", "tools")
    )
    formatted = format_kimi_k3_tool_calls(calls)
    assert isinstance(formatted, KimiK3Prompt)
    assert formatted.segments == tuple(expected)
    assert formatted == "".join(s.text for s in expected)
    assert format_kimi_k3_tool_calls([]).segments == ()


def test_format_matches_the_renderer():
    """The formatter's segments are exactly the renderer's tools channel for an assistant message's tool_calls."""
    calls = [{"id": "a:1", "type": "function", "function": {"name": "get_weather", "arguments": WEATHER_ARGS}},
             {"id": "b:2", "type": "function", "function": {"name": 'a&b "s"', "arguments": '{"q": "x &amp; y"}'}},
             {"id": "c:3", "type": "function", "function": {"name": "raw", "arguments": "{broken"}},
             {"id": "d:4", "type": "function", "function": {"name": "none", "arguments": None}}]
    rendered = render_kimi_k3_chat([{"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "c", "tool_calls": calls}]).segments
    formatted = format_kimi_k3_tool_calls(calls).segments
    starts = [i for i in range(len(rendered)) if rendered[i:i + len(formatted)] == formatted]
    assert len(starts) == 1


def test_format_accepts_every_call_shape():
    expected = [KimiK3ToolCall("f", {"days": 3}, 1)]
    shapes = [
        [{"id": "f:1", "type": "function", "function": {"name": "f", "arguments": {"days": 3}}}],
        [{"id": "f:1", "type": "function", "function": {"name": "f", "arguments": '{"days": 3}'}}],
        [{"name": "f", "arguments": {"days": 3}}],
        [{"name": "f", "arguments": '{"days": 3}'}],
        [KimiK3ToolCall("f", {"days": 3}, 1)],
        (c for c in [KimiK3ToolCall("f", {"days": 3}, 1)]),
    ]
    for calls in shapes:
        assert parse_kimi_k3_response(format_kimi_k3_tool_calls(calls)).tool_calls == expected
    # a KimiK3ToolCall keeps its own index; blank arguments mean none; a non-object JSON string stays a string
    calls = [KimiK3ToolCall("f", {}, 7), {"name": "g", "arguments": "  "}, {"name": "h", "arguments": "[1, 2]"}]
    assert parse_kimi_k3_response(format_kimi_k3_tool_calls(calls)).tool_calls == [
        KimiK3ToolCall("f", {}, 7), KimiK3ToolCall("g", {}, 2), KimiK3ToolCall("h", "[1, 2]", 3)]


def test_format_rejects_what_it_cannot_write():
    for bad in ("calls", {"name": "f"}, [5], [{"function": "f"}], [{"name": "f", "arguments": 3}],
                [{"name": "f", "arguments": {"s": {1, 2}}}], [KimiK3ToolCall("f", {}, "1")]):
        with pytest.raises(TypeError):
            format_kimi_k3_tool_calls(bad)
    with pytest.raises(KimiK3ParseError, match="name"):
        format_kimi_k3_tool_calls([{"function": {"arguments": {}}}])
    deep: list = []
    for _ in range(100000):
        deep = [deep]
    with pytest.raises(KimiK3ParseError, match="deeply"):
        format_kimi_k3_tool_calls([{"name": "f", "arguments": {"d": deep}}])


TRICKY = ['<|close|>argument<|sep|>', 'say "hi"', "&amp; &quot; & \"", "", " ", "<|open|>call tool=\"x\" index=\"1\""
          "<|sep|>", "<|close|>message<|sep|><|end_of_msg|>[EOS][EOT]", "多言語 ✓ \U0001f600", "\n\t\r", "<|sep|>"]


def tricky_calls() -> list[KimiK3ToolCall]:
    arguments = {f"k{i}{s}": s for i, s in enumerate(TRICKY)}
    arguments.update({"json": {"s": TRICKY, "n": [1, -2.5, True, None], '"k&': {}}, "": 0, 'a"b&amp;': False})
    names = [TRICKY[0], TRICKY[1], TRICKY[2], TRICKY[4], TRICKY[5], 'a&b "s"']
    return [KimiK3ToolCall(name, arguments, i) for i, name in enumerate(names, start=1)]


def test_format_then_parse_is_lossless_as_segments_and_as_token_ids(tokenizer):
    calls = tricky_calls()
    formatted = format_kimi_k3_tool_calls(calls)
    answer = parse_kimi_k3_response(formatted)
    assert answer.tool_calls == calls and answer.errors == [] and answer.reasoning is None
    # inside a whole answer, as segments and as the ids K3's tokenizer makes of them
    message = KimiK3Prompt(ended(text("R"), *tag("close", "think"), *tag("open", "response"), text("C"),
                                 *tag("close", "response"), *formatted.segments))
    for output in (message, segment_ids(tokenizer, message), torch.tensor(segment_ids(tokenizer, message))):
        answer = parse_kimi_k3_response(output, tokenizer=tokenizer)
        assert (answer.reasoning, answer.content, answer.finished, answer.errors) == ("R", "C", True, [])
        assert answer.tool_calls == calls
        assert [c["function"]["arguments"] for c in answer.to_message()["tool_calls"]] == [c.arguments for c in calls]


def test_a_plain_string_reads_spelled_markers():
    """What the module docstring warns about: the text of a formatted call, once a plain str, reads a string value
    that spells ``<|close|>argument<|sep|>`` as the end of that value."""
    formatted = format_kimi_k3_tool_calls([{"name": "f", "arguments": {"s": "a<|close|>argument<|sep|>b"}}])
    assert parse_kimi_k3_response(formatted).tool_calls == [KimiK3ToolCall("f", {"s": "a<|close|>argument<|sep|>b"},
                                                                            1)]
    answer = parse_kimi_k3_response(str(formatted))
    assert answer.tool_calls == [KimiK3ToolCall("f", {"s": "a"}, 1)] and answer.errors


def test_tool_calls_round_trip_through_the_formatter_as_text():
    calls = [KimiK3ToolCall("get_weather", WEATHER_ARGS, 1), KimiK3ToolCall('a&b "search"', {"q": "x"}, 2)]
    formatted = str(format_kimi_k3_tool_calls(calls))
    assert formatted.startswith(TOOLS_OPEN + '<|open|>call tool="get_weather" index="1"<|sep|>')
    assert 'tool="a&amp;b &quot;search&quot;"' in formatted and 'key="days" type="number"<|sep|>3<' in formatted
    assert parse_kimi_k3_response(RESPONSE_OPEN + RESPONSE_CLOSE + formatted + MESSAGE_CLOSE).tool_calls == calls
    # the parsed message goes back through the renderer to the same tools channel
    answer = parse_kimi_k3_response(RESPONSE_OPEN + RESPONSE_CLOSE + formatted + MESSAGE_CLOSE)
    rendered = render_kimi_k3_chat([{"role": "user", "content": "q"}, answer.to_message()])
    assert formatted in rendered


def test_response_type():
    assert isinstance(parse_kimi_k3_response(""), KimiK3Response)
    assert parse_kimi_k3_response("") == KimiK3Response()
    assert json.dumps(parse_kimi_k3_response(HEAD).to_message())  # plain JSON-able data


# ---------------------------------------------------------------- thinking budget
def greedy_script(processor, prompt_ids: list[int], wants, steps: int) -> list[int]:
    """Run `processor` in a generation loop whose "model" always prefers ``wants(step)``; return the new ids."""
    ids = torch.tensor([prompt_ids])
    for step in range(steps):
        scores = torch.zeros(1, 512)
        scores[0, wants(step)] = 5.0
        scores = processor(ids, scores)
        ids = torch.cat([ids, scores.argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def think_prompt(tokenizer):
    return tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_budget_forces_the_closing_sequence_token_by_token(tokenizer, think_prompt, budget):
    end_ids = tokenizer.encode(THINKING_END_SEQUENCE, add_special_tokens=False)
    assert len(end_ids) == 17  # <|close|> t h i n k <|sep|> <|open|> r e s p o n s e <|sep|>
    letter = tokenizer.convert_tokens_to_ids("a")
    processor = ThinkingBudgetLogitsProcessor(budget, tokenizer)
    new = greedy_script(processor, think_prompt, lambda step: letter, budget + len(end_ids) + 4)
    assert new == [letter] * budget + end_ids + [letter] * 4  # then the model writes its response freely
    text = tokenizer.decode(new)
    answer = parse_kimi_k3_response(text, prompt=tokenizer.decode(think_prompt))
    assert answer.reasoning == ("a" * budget or None) and answer.content == "aaaa"
    answer = parse_kimi_k3_response(new, prompt=think_prompt, tokenizer=tokenizer)  # the ids themselves
    assert answer.reasoning == ("a" * budget or None) and answer.content == "aaaa" and answer.errors == []


def test_budget_leaves_finished_or_absent_thinking_alone(tokenizer, think_prompt):
    letter = tokenizer.convert_tokens_to_ids("a")
    close = tokenizer.encode(THINK_CLOSE + RESPONSE_OPEN, add_special_tokens=False)
    processor = ThinkingBudgetLogitsProcessor(4, tokenizer)
    # the model closes its thinking after 2 tokens: nothing is forced afterwards, however long the answer
    script = [letter, letter, *close] + [letter] * 10
    assert greedy_script(processor, think_prompt, lambda step: script[step], len(script)) == script
    # thinking off: the prompt opens the response channel, no think channel to close
    off = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True,
                                        thinking=False, return_dict=True)["input_ids"]
    assert greedy_script(processor, off, lambda step: letter, 12) == [letter] * 12
    # an earlier assistant turn's closed reasoning in the history does not count
    history = [{"role": "user", "content": "q"},
               {"role": "assistant", "content": "c", "reasoning_content": "r" * 20},
               {"role": "user", "content": "again"}]
    prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True, thinking=False,
                                           return_dict=True)["input_ids"]
    assert greedy_script(processor, prompt, lambda step: letter, 12) == [letter] * 12


def test_budget_is_per_row_and_stateless(tokenizer, think_prompt):
    """Rows in different states in one batch; reordering rows (beam search) needs no bookkeeping."""
    letter = tokenizer.convert_tokens_to_ids("a")
    end_ids = tokenizer.encode(THINKING_END_SEQUENCE, add_special_tokens=False)
    processor = ThinkingBudgetLogitsProcessor(3, tokenizer)
    rows = [think_prompt + [letter] * 3 + end_ids[:5], think_prompt + [letter] * 2, think_prompt + [letter] * 3]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # left padding
    scores = processor(ids, torch.zeros(3, 512))
    assert scores[0].argmax() == end_ids[5] and torch.isinf(scores[0]).sum() == 511
    assert torch.equal(scores[1], torch.zeros(512))  # still within its budget
    assert scores[2].argmax() == end_ids[0]
    flipped = processor(ids.flip(0), torch.zeros(3, 512))
    assert torch.equal(flipped, scores.flip(0))


def test_budget_with_sampling_in_generate(tokenizer, think_prompt):
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(KimiK3TextConfig.tiny()).eval()
    end_ids = tokenizer.encode(THINKING_END_SEQUENCE, add_special_tokens=False)
    # keep the random model from writing control tokens itself, so the budget is what ends the thinking
    banned = [[tokenizer.convert_tokens_to_ids(t)] for t in ("<|open|>", "<|close|>", "<|end_of_msg|>", "[EOT]")]
    out = model.generate(torch.tensor([think_prompt] * 3), max_new_tokens=6 + len(end_ids), do_sample=True,
                         top_k=50, logits_processor=[ThinkingBudgetLogitsProcessor(6, tokenizer)],
                         bad_words_ids=banned, eos_token_id=None, pad_token_id=0)
    for row in out[:, len(think_prompt):].tolist():
        assert row[6:] == end_ids


def test_budget_arguments():
    with pytest.raises(ValueError, match="max_thinking_tokens"):
        ThinkingBudgetLogitsProcessor(-1, think_open_ids=[1], end_sequence_ids=[2], stop_ids=[2])
    with pytest.raises(ValueError, match="tokenizer"):
        ThinkingBudgetLogitsProcessor(3)
    with pytest.raises(ValueError, match="control token"):
        ThinkingBudgetLogitsProcessor(3, think_open_ids=[1], end_sequence_ids=[5, 2], stop_ids=[2])
    # explicit ids work without a tokenizer
    processor = ThinkingBudgetLogitsProcessor(1, think_open_ids=[7, 8], end_sequence_ids=[2, 9], stop_ids=[2])
    assert processor.forced_token(torch.tensor([7, 8, 4])) == 2
    assert processor.forced_token(torch.tensor([7, 8, 4, 2])) == 9
    assert processor.forced_token(torch.tensor([7, 8, 4, 2, 9])) is None


# ---------------------------------------------------------------- the command line's streamer
@pytest.mark.parametrize("thinking", [True, False])
def test_channel_streamer_shows_reasoning_apart_and_no_markers(tokenizer, thinking):
    """What ``generate --chat`` prints, fed one token at a time: reasoning on stderr after ``[thinking]``, the answer
    alone on stdout, no template marker; text the model wrote that merely spells a marker (text ids) is shown as
    the text it is."""
    import io

    from transformers_k3.generate_cli import ChannelStreamer

    def text(value):
        return tokenizer(value, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def marker(value):
        return tokenizer(value, add_special_tokens=False)["input_ids"]

    prompt = render_kimi_k3_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True, thinking=thinking)
    ids = (text("I ponder <|open|>.") + marker("<|close|>") + text("think") + marker("<|sep|><|open|>") +
           text("response") + marker("<|sep|>") if thinking else [])
    ids += (text("Hi <|close|>response<|sep|> there") + marker("<|close|>") + text("response") +
            marker("<|sep|><|close|>") + text("message") + marker("<|sep|><|end_of_msg|>"))
    out, err = io.StringIO(), io.StringIO()
    streamer = ChannelStreamer(tokenizer, prompt, out=out, err=err)
    streamer.put(torch.tensor([[7, 7, 7]]))  # generate() sends the prompt first
    for i in ids:
        streamer.put(torch.tensor([i]))
    streamer.end()
    assert out.getvalue() == "Hi <|close|>response<|sep|> there\n"
    assert err.getvalue() == ("[thinking] I ponder <|open|>.\n" if thinking else "")
    assert streamer.parsed.finished and streamer.parsed.tool_calls == []


@pytest.mark.parametrize("answer", ["hello<|close|>", "hello<|close|>message<|sep|>", "<|close|>",
                                    "hello<|end_of_msg|>", "hello"])
def test_parse_response_given_k3s_own_template_uses_k3s_parser(answer):
    """`transformers serve` passes the tokenizer's response_template to parse_response explicitly: K3's own template
    must give what K3's parser gives (transformers' template parser left the closing markers of a truncated or
    ended answer in `content`)."""
    from transformers_k3 import KIMI_K3_RESPONSE_TEMPLATE

    tokenizer = build_test_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           thinking=False, return_dict=True)["input_ids"]
    ids = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(answer))
    served = tokenizer.parse_response(ids, KIMI_K3_RESPONSE_TEMPLATE, prefix=prompt)
    assert served == tokenizer.parse_response(ids, prefix=prompt)
    assert served["content"] == answer.split("<|")[0]
