"""transformers_k3.chat: splitting K3 answers into reasoning / content / tool calls (spec 8), the transformers
response template, and the thinking-budget logits processor."""

from __future__ import annotations

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
    KimiK3ToolCall,
    ThinkingBudgetLogitsProcessor,
    format_kimi_k3_tool_calls,
    parse_kimi_k3_response,
)


# The tiny model's ops are microseconds long: see the `one_thread` fixture in conftest.py.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_test_tokenizer()
    tok.response_template = KIMI_K3_RESPONSE_TEMPLATE
    return tok


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


# ---------------------------------------------------------------- parsing (spec 8 grammar)
def test_full_answer_reasoning_content_and_typed_tool_calls():
    text = ("Let me check the weather.\n" + THINK_CLOSE + RESPONSE_OPEN + "Checking now." + RESPONSE_CLOSE
            + "<|open|>tools<|sep|>" + WEATHER_CALL + SEARCH_CALL + "<|close|>tools<|sep|>" + MESSAGE_CLOSE
            + "<|end_of_msg|>[EOS][PAD][PAD]")
    answer = parse_kimi_k3_response(text)  # generation prompt pre-filled the think channel (the default)
    assert answer.reasoning == "Let me check the weather.\n"
    assert answer.content == "Checking now."
    assert answer.finished
    assert [c.name for c in answer.tool_calls] == ["get_weather", 'a&b "search"']  # attributes unescaped
    assert [c.index for c in answer.tool_calls] == [1, 2]
    assert answer.tool_calls[0].arguments == WEATHER_ARGS  # string raw (even "75001"), every other type JSON
    assert answer.tool_calls[1].arguments == {"q": "line 1\nline 2"}
    message = answer.to_message()
    assert message["role"] == "assistant" and message["reasoning_content"] == answer.reasoning
    assert message["tool_calls"][0] == {"id": "get_weather:1", "type": "function",
                                        "function": {"name": "get_weather", "arguments": WEATHER_ARGS}}


def test_tool_calls_round_trip_through_the_formatter():
    calls = [KimiK3ToolCall("get_weather", WEATHER_ARGS, 1), KimiK3ToolCall('a&b "search"', {"q": "x"}, 2)]
    text = format_kimi_k3_tool_calls(calls)
    assert text.startswith("<|open|>tools<|sep|>" + '<|open|>call tool="get_weather" index="1"<|sep|>')
    assert 'tool="a&amp;b &quot;search&quot;"' in text and 'key="days" type="number"<|sep|>3<' in text
    assert parse_kimi_k3_response(RESPONSE_OPEN + RESPONSE_CLOSE + text + MESSAGE_CLOSE).tool_calls == calls
    # OpenAI-style dicts (arguments as a JSON string) are accepted too
    as_dicts = [c.to_openai() for c in calls]
    as_dicts[0]["function"]["arguments"] = '{"days": 3}'
    assert format_kimi_k3_tool_calls(as_dicts).count("<|open|>call ") == 2


def test_skipped_thinking_is_content():
    """Spec 8: the model may skip the pre-filled think channel and close with a bare response close."""
    answer = parse_kimi_k3_response("The answer is 4." + RESPONSE_CLOSE + MESSAGE_CLOSE)
    assert answer.reasoning is None and answer.content == "The answer is 4." and answer.finished


def test_thinking_jumps_straight_to_tools():
    answer = parse_kimi_k3_response("I need the weather." + "<|open|>tools<|sep|>" + WEATHER_CALL
                                    + "<|close|>tools<|sep|>" + MESSAGE_CLOSE)
    assert answer.reasoning == "I need the weather." and answer.content == ""
    assert answer.tool_calls[0].arguments == WEATHER_ARGS


def test_prompt_decides_the_starting_channel(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    off = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, thinking=False)
    on = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    generated = "Hello!" + RESPONSE_CLOSE + MESSAGE_CLOSE
    assert parse_kimi_k3_response(generated, prompt=off).content == "Hello!"
    assert parse_kimi_k3_response("hmm" + THINK_CLOSE + RESPONSE_OPEN + "Hi", prompt=on).reasoning == "hmm"
    # a whole transcript: only the last assistant message counts
    transcript = on + "hmm" + THINK_CLOSE + RESPONSE_OPEN + "Hi" + RESPONSE_CLOSE + MESSAGE_CLOSE
    answer = parse_kimi_k3_response(transcript)
    assert (answer.reasoning, answer.content, answer.finished) == ("hmm", "Hi", True)


@pytest.mark.parametrize("cut", ["<|close|>thi", "<|clo", "<|", "<|open|>response"])
def test_truncated_output_drops_the_cut_marker(cut):
    answer = parse_kimi_k3_response("step one" + cut)
    assert answer.reasoning == "step one" and answer.content == "" and not answer.finished
    unfinished_call = RESPONSE_OPEN + "ok" + RESPONSE_CLOSE + "<|open|>tools<|sep|>" + WEATHER_CALL[:120]
    answer = parse_kimi_k3_response(unfinished_call)
    assert answer.content == "ok" and answer.tool_calls == [] and not answer.finished


def test_parsed_message_renders_back_through_the_chat_template(tokenizer):
    answer = parse_kimi_k3_response("R" + THINK_CLOSE + RESPONSE_OPEN + "C" + RESPONSE_CLOSE + MESSAGE_CLOSE)
    history = [{"role": "user", "content": "q"}, answer.to_message()]
    rendered = tokenizer.apply_chat_template(history, tokenize=False)
    assert rendered.endswith('<|open|>message role="assistant"<|sep|>' + THINK_OPEN + "R" + THINK_CLOSE
                             + RESPONSE_OPEN + "C" + RESPONSE_CLOSE + MESSAGE_CLOSE + "<|end_of_msg|>")


def test_response_template_agrees_with_the_parser(tokenizer):
    """`tokenizer.parse_response` with KIMI_K3_RESPONSE_TEMPLATE gives the same split; with `tools=` schemas
    transformers types the arguments (the flat template cannot read K3's own `type` attribute)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "weather?"}], tokenize=False,
                                           add_generation_prompt=True)
    text = ("Think." + THINK_CLOSE + RESPONSE_OPEN + "Sure." + RESPONSE_CLOSE + "<|open|>tools<|sep|>"
            + WEATHER_CALL + "<|close|>tools<|sep|>" + MESSAGE_CLOSE)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "scale": {"type": "number"},
        "metric": {"type": "boolean"}, "hours": {"type": "array"}, "extra": {"type": "object"},
        "unit": {"type": "null"}, "zip": {"type": "string"}}}}}
    parsed = tokenizer.parse_response(text, prefix=prompt, tools=[tool])
    ours = parse_kimi_k3_response(text, prompt=prompt)
    assert parsed["role"] == "assistant"
    assert parsed["reasoning_content"] == ours.reasoning and parsed["content"] == ours.content
    assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "get_weather",
                                                                     "arguments": WEATHER_ARGS}}]
    untyped = tokenizer.parse_response(text, prefix=prompt)["tool_calls"][0]["function"]["arguments"]
    assert untyped["days"] == "3"  # without schemas the values stay text


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
