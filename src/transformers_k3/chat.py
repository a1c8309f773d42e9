"""Working with K3 chat answers: splitting them into reasoning, visible content and tool calls, and bounding how
long the model thinks.

K3 writes its answer in XTML channels (K3_SPEC.md section 8)::

    [<|open|>think<|sep|> ...reasoning... <|close|>think<|sep|>]
    <|open|>response<|sep|> ...visible text... <|close|>response<|sep|>
    [<|open|>tools<|sep|> CALL+ <|close|>tools<|sep|>]
    <|close|>message<|sep|>

    CALL := <|open|>call tool="NAME" index="N"<|sep|> ARG* <|close|>call<|sep|>
    ARG  := <|open|>argument key="KEY" type="TYPE"<|sep|>VALUE<|close|>argument<|sep|>

``string`` argument values are raw text, every other type is JSON; attribute values escape ``&`` and ``"``.
Decode generated ids with ``skip_special_tokens=False`` so that the markers survive.

What the spec says about real outputs, and how this module follows it:

* the generation prompt pre-fills ``<|open|>think<|sep|>`` (thinking, the default) or ``<|open|>response<|sep|>``
  (``thinking=False``), so the model's own text starts inside a channel. `parse_kimi_k3_response` takes the
  prompt (or assumes the thinking pre-fill) to know which one;
* the model may skip thinking and end with ``<|close|>response<|sep|><|close|>message<|sep|>`` without ever
  closing the think channel: a bare ``<|close|>response<|sep|>`` proves the preceding text was the response;
* the model may jump from thinking straight to the ``tools`` channel;
* a generation cut by ``max_new_tokens`` may end inside a marker; the partial marker is dropped.

Public API:

* `parse_kimi_k3_response` -> `KimiK3Response` (``reasoning``, ``content``, ``tool_calls``, ``finished``;
  ``.to_message()`` gives the OpenAI-style assistant message that `KIMI_K3_CHAT_TEMPLATE` renders back);
* `format_kimi_k3_tool_calls`: the inverse for tool calls (the exact ``tools`` channel text);
* `ThinkingBudgetLogitsProcessor`: a `transformers.LogitsProcessor` that closes the think channel after a
  budget of thinking tokens by forcing ``<|close|>think<|sep|><|open|>response<|sep|>`` one token per step;
* `KIMI_K3_RESPONSE_TEMPLATE`: a transformers ``response_template`` for ``tokenizer.parse_response`` and the
  ``text-generation`` pipeline (see its docstring for what it cannot express).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessor

THINK_OPEN = "<|open|>think<|sep|>"
THINK_CLOSE = "<|close|>think<|sep|>"
RESPONSE_OPEN = "<|open|>response<|sep|>"
RESPONSE_CLOSE = "<|close|>response<|sep|>"
TOOLS_OPEN = "<|open|>tools<|sep|>"
TOOLS_CLOSE = "<|close|>tools<|sep|>"
MESSAGE_CLOSE = "<|close|>message<|sep|>"
ASSISTANT_OPEN = '<|open|>message role="assistant"<|sep|>'
END_TOKENS = ("<|end_of_msg|>", "[EOS]", "[EOT]")
# What the thinking budget forces: close the think channel, open the response channel.
THINKING_END_SEQUENCE = THINK_CLOSE + RESPONSE_OPEN

_MARKER_RE = re.compile(r"<\|(open|close)\|>((?:(?!<\|).)*?)<\|sep\|>", re.DOTALL)
_ATTR_RE = re.compile(r'(\w+)="([^"]*)"')
_END_RE = re.compile("|".join(re.escape(t) for t in END_TOKENS))
# A marker cut off at the end of the text (generation stopped mid-marker).
_PARTIAL_MARKER_RE = re.compile(r"<\|(?:open|close)\|>(?:(?!<\|).)*\Z|<\|(?:o|op|ope|open|c|cl|clo|clos|close)?\|?\Z",
                                re.DOTALL)
_JSON_TYPES = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", tuple: "array",
               dict: "object", type(None): "null"}


# ---------------------------------------------------------------------------------------------------------------
# Parsed answers
@dataclass
class KimiK3ToolCall:
    """One ``<|open|>call ...`` block: the tool name, its decoded arguments and the model's ``index`` attribute."""

    name: str
    arguments: dict[str, Any]
    index: int

    def to_openai(self, global_index: int | None = None) -> dict:
        """The OpenAI / transformers chat shape. The id is ``"{name}:{global_index}"`` as K3 serving returns it
        (spec 8); ``global_index`` defaults to this call's ``index`` attribute."""
        number = self.index if global_index is None else global_index
        return {"id": f"{self.name}:{number}", "type": "function",
                "function": {"name": self.name, "arguments": dict(self.arguments)}}


@dataclass
class KimiK3Response:
    """A K3 answer split into its channels. ``reasoning`` is None when there was no thinking text; ``finished``
    says whether ``<|close|>message<|sep|>`` (or an end token) was reached."""

    reasoning: str | None = None
    content: str = ""
    tool_calls: list[KimiK3ToolCall] = field(default_factory=list)
    finished: bool = False

    def to_message(self) -> dict:
        """``{"role": "assistant", "content", ["reasoning_content"], ["tool_calls"]}``: the keys that
        `KIMI_K3_CHAT_TEMPLATE` reads when the message goes back into the history."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _escape(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _decode_argument(raw: str, kind: str) -> Any:
    if kind == "string":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw  # malformed JSON from the model: keep the text rather than lose the argument


def _attributes(header: str) -> tuple[str, dict[str, str]]:
    name, _, rest = header.partition(" ")
    return name, {key: _unescape(value) for key, value in _ATTR_RE.findall(rest)}


def parse_kimi_k3_response(text: str, prompt: str | None = None) -> KimiK3Response:
    """Split a decoded K3 answer into reasoning, content and tool calls.

    ``text``: the generated text decoded with ``skip_special_tokens=False`` (a full transcript also works: only
    what follows its last ``<|open|>message role="assistant"<|sep|>`` is read). ``prompt``: the prompt the text
    continues, used to know which channel the generation prompt left open; without it the thinking pre-fill
    (``<|open|>think<|sep|>``, the spec's default) is assumed unless ``text`` itself holds the assistant header.
    Text after the message close or an end token (``<|end_of_msg|>``, ``[EOS]``, ``[EOT]``) is ignored.
    """
    if ASSISTANT_OPEN in text:
        text, channel = text.rsplit(ASSISTANT_OPEN, 1)[1], None
    elif prompt is not None:
        tail = prompt.rsplit(ASSISTANT_OPEN, 1)[1] if ASSISTANT_OPEN in prompt else ""
        text, channel = tail + text, None
    else:
        channel = "think"
    result = KimiK3Response()
    end = _END_RE.search(text)
    if end is not None:
        text, result.finished = text[: end.start()], True
    text = _PARTIAL_MARKER_RE.sub("", text)

    reasoning: list[str] = []
    content: list[str] = []
    call: KimiK3ToolCall | None = None
    argument: tuple[str, str] | None = None  # (key, type)
    argument_text: list[str] = []

    def add_text(piece: str) -> None:
        if not piece:
            return
        if channel == "think":
            reasoning.append(piece)
        elif channel == "argument":
            argument_text.append(piece)
        elif channel in ("response", None):
            content.append(piece)
        # whitespace between calls / arguments in the tools channel carries nothing

    position = 0
    for match in _MARKER_RE.finditer(text):
        add_text(text[position: match.start()])
        position = match.end()
        kind, (name, attrs) = match.group(1), _attributes(match.group(2).strip())
        if kind == "open":
            if name in ("think", "response", "tools"):
                channel = name
            elif name == "call":
                index = attrs.get("index", "")
                call = KimiK3ToolCall(attrs.get("tool", ""), {},
                                      int(index) if index.isdigit() else len(result.tool_calls) + 1)
                channel = "call"
            elif name == "argument":
                argument, argument_text = (attrs.get("key", ""), attrs.get("type", "string")), []
                channel = "argument"
            else:
                add_text(match.group(0))  # not a channel we know: keep it visible
        else:
            if name == "message":
                result.finished = True
                break
            if name == "response" and channel == "think":
                # the model skipped thinking: what was taken for reasoning was the response
                content.extend(reasoning)
                reasoning.clear()
                channel = None
            elif name == "argument" and argument is not None and call is not None:
                call.arguments[argument[0]] = _decode_argument("".join(argument_text), argument[1])
                argument, channel = None, "call"
            elif name == "call" and call is not None:
                if call.name:
                    result.tool_calls.append(call)
                call, channel = None, "tools"
            elif name in ("think", "response", "tools"):
                channel = None
            else:
                add_text(match.group(0))
    else:
        add_text(text[position:])

    joined = "".join(reasoning)
    result.reasoning = joined or None
    result.content = "".join(content)
    return result


def format_kimi_k3_tool_calls(calls: Iterable[KimiK3ToolCall | dict]) -> str:
    """The ``tools`` channel for ``calls`` (`KimiK3ToolCall` or OpenAI-style dicts), as K3 writes it: the inverse
    of the tool-call part of `parse_kimi_k3_response`. Indices run 1, 2, ... unless a `KimiK3ToolCall` has its
    own. A Python ``int``/``float`` argument gets ``type="number"`` (JSON Schema's integer is K3's number)."""
    parts = [TOOLS_OPEN]
    for position, call in enumerate(calls, start=1):
        if isinstance(call, dict):
            function = call.get("function", call)
            arguments = function.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            call = KimiK3ToolCall(function["name"], arguments, position)
        parts.append(f'<|open|>call tool="{_escape(call.name)}" index="{call.index}"<|sep|>')
        for key, value in call.arguments.items():
            kind = _JSON_TYPES.get(type(value), "object")
            raw = value if kind == "string" else json.dumps(value, ensure_ascii=False)
            parts.append(f'<|open|>argument key="{_escape(key)}" type="{kind}"<|sep|>{raw}<|close|>argument<|sep|>')
        parts.append("<|close|>call<|sep|>")
    parts.append(TOOLS_CLOSE)
    return "".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# transformers' response_template (tokenizer.parse_response, the text-generation pipeline)
# `KIMI_K3_RESPONSE_TEMPLATE` lets ``tokenizer.parse_response(text, prefix=prompt)`` and
# ``pipeline("text-generation")`` return ``{"role": "assistant", "reasoning_content", "content", "tool_calls"}``
# (set ``tokenizer.response_template = KIMI_K3_RESPONSE_TEMPLATE`` before saving). transformers' template language
# is flat and untyped, so it cannot express two things that `parse_kimi_k3_response` handles: argument values stay
# text unless ``tools=`` schemas are passed (then transformers casts them; K3's own ``type`` attribute is not read),
# and a skipped think channel (an answer closed by a bare ``<|close|>response<|sep|>``) is reported as reasoning.
KIMI_K3_RESPONSE_TEMPLATE: dict = {
    "start_anchor": ASSISTANT_OPEN,
    "defaults": {"role": "assistant"},
    "fields": {
        "reasoning_content": {"open": THINK_OPEN, "close": THINK_CLOSE, "content": "text",
                              "content_args": {"strip": False}},
        "content": {"open": RESPONSE_OPEN, "close": RESPONSE_CLOSE, "content": "text",
                    "content_args": {"strip": False}},
        "tool_calls": {
            "open_pattern": r'<\|open\|>call tool="(?P<name>[^"]*)" index="[0-9]+"<\|sep\|>',
            "close": "<|close|>call<|sep|>",
            "content": "xml-inline",
            "content_args": {
                "tag_pattern": r'<\|open\|>argument key="(?P<key>[^"]*)" type="[a-z]+"<\|sep\|>(?P<value>.*?)'
                               r"<\|close\|>argument<\|sep\|>",
            },
            "repeats": True,
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
    },
}


# ---------------------------------------------------------------------------------------------------------------
# Thinking budget
def _token_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


class ThinkingBudgetLogitsProcessor(LogitsProcessor):
    """Ends K3's thinking after ``max_thinking_tokens`` tokens.

    For each row, the thinking span starts after the last ``<|open|>think<|sep|>`` in the ids (the generation
    prompt's pre-fill, or one the model wrote) and ends at its first channel-control token (``<|open|>``,
    ``<|close|>``) or end token. Once ``max_thinking_tokens`` tokens of it are written without such a token, the
    processor forces ``<|close|>think<|sep|><|open|>response<|sep|>`` one token per step (each marker is several
    tokens) and then lets the model write its response. Rows that closed their thinking earlier, or that never
    opened it (``thinking=False``), are left alone. Stateless: it reads only ``input_ids``, so it works with
    batches, beam search and continued generation.

    ``tokenizer`` provides the ids of the markers; or pass ``think_open_ids``, ``end_sequence_ids`` and
    ``stop_ids`` (the control and end tokens that end thinking) directly. ``end_sequence`` replaces the forced
    text (e.g. ``THINK_CLOSE + TOOLS_OPEN``, or a closing sentence followed by the markers).
    """

    def __init__(self, max_thinking_tokens: int, tokenizer=None, *, end_sequence: str = THINKING_END_SEQUENCE,
                 think_open_ids: Sequence[int] | None = None, end_sequence_ids: Sequence[int] | None = None,
                 stop_ids: Sequence[int] | None = None):
        if max_thinking_tokens < 0:
            raise ValueError(f"max_thinking_tokens must be >= 0, got {max_thinking_tokens}")
        if tokenizer is None and None in (think_open_ids, end_sequence_ids, stop_ids):
            raise ValueError("pass a tokenizer, or all of think_open_ids, end_sequence_ids and stop_ids")
        if think_open_ids is None:
            think_open_ids = _token_ids(tokenizer, THINK_OPEN)
        if end_sequence_ids is None:
            end_sequence_ids = _token_ids(tokenizer, end_sequence)
        if stop_ids is None:
            stop_tokens = ("<|open|>", "<|close|>", *END_TOKENS)
            stop_ids = [tokenizer.convert_tokens_to_ids(t) for t in stop_tokens]
            if tokenizer.eos_token_id is not None:
                stop_ids.append(tokenizer.eos_token_id)
            stop_ids = [i for i in stop_ids if i is not None and i != tokenizer.unk_token_id]
        self.max_thinking_tokens = int(max_thinking_tokens)
        self.think_open_ids = torch.tensor(list(think_open_ids), dtype=torch.long)
        self.end_sequence_ids = torch.tensor(list(end_sequence_ids), dtype=torch.long)
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)
        if self.think_open_ids.numel() == 0 or self.end_sequence_ids.numel() == 0:
            raise ValueError("the think-open marker and the forced end sequence must not be empty")
        if int(self.end_sequence_ids[0]) not in set(self.stop_ids.tolist()):
            raise ValueError("the forced end sequence must start with a control token (it is how a closed "
                             "thinking span is recognised)")

    def forced_token(self, row: torch.LongTensor) -> int | None:
        """The token this row must produce next, or None."""
        marker = self.think_open_ids.to(row.device)
        width = marker.numel()
        if row.numel() < width:
            return None
        starts = (row.unfold(0, width, 1) == marker).all(dim=-1).nonzero()
        if starts.numel() == 0:
            return None
        thinking = row[int(starts[-1]) + width:]
        stops = torch.isin(thinking, self.stop_ids.to(row.device)).nonzero()
        forced = self.end_sequence_ids.to(row.device)
        budget = self.max_thinking_tokens
        if stops.numel() == 0:
            return int(forced[0]) if thinking.numel() >= budget else None
        first_stop = int(stops[0])
        if first_stop < budget:
            return None  # the model ended its thinking within the budget
        done = thinking[first_stop:]
        if done.numel() < forced.numel() and torch.equal(done, forced[: done.numel()]):
            return int(forced[done.numel()])
        return None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        processed = scores
        for row in range(input_ids.shape[0]):
            token = self.forced_token(input_ids[row])
            if token is not None:
                if processed is scores:
                    processed = scores.clone()
                processed[row] = float("-inf")
                processed[row, token] = 0.0
        return processed


__all__ = [
    "KIMI_K3_RESPONSE_TEMPLATE",
    "KimiK3Response",
    "KimiK3ToolCall",
    "ThinkingBudgetLogitsProcessor",
    "format_kimi_k3_tool_calls",
    "parse_kimi_k3_response",
]
