"""Working with K3 chat answers: splitting them into reasoning, visible content and tool calls, writing tool calls
back, and bounding how long the model thinks.

K3 writes its answer in XTML channels (K3_SPEC.md section 8)::

    [<|open|>think<|sep|> ...reasoning... <|close|>think<|sep|>]
    <|open|>response<|sep|> ...visible text... <|close|>response<|sep|>
    [<|open|>tools<|sep|> CALL+ <|close|>tools<|sep|>]
    <|close|>message<|sep|>            (then <|end_of_msg|>)

    CALL := <|open|>call tool="NAME" index="N"<|sep|> (ARG* | JSONBLOCK) <|close|>call<|sep|>
    ARG  := <|open|>argument key="KEY" type="TYPE"<|sep|>VALUE<|close|>argument<|sep|>
    JSONBLOCK := <|open|>json type="object"<|sep|>RAW<|close|>json<|sep|>

``string`` argument values are raw text, every other type is JSON; attribute values escape ``&`` and ``"``. A
json block carries arguments that were not a JSON object (kept as that string).

What is read from where
-----------------------

* **Tool calls come only from the tools channel.** A call block written inside the think or response channel
  (reasoning that *talks about* ``<|open|>call tool="rm" ...``) stays text of that channel; so does a call
  outside any channel (then with a note in ``errors``).
* A think / response / argument / json block extends to its own close marker when there is one: every marker
  before it is text of that block. Only an *unclosed* block ends early: an unclosed think channel at
  ``<|open|>response<|sep|>`` or ``<|open|>tools<|sep|>`` (the model jumped from thinking to its answer or to its
  calls) or at a bare ``<|close|>response<|sep|>`` (the model skipped thinking: the text so far was the response),
  an unclosed response at ``<|open|>tools<|sep|>``, an unclosed argument at the next call / argument boundary.
* ``<|close|>message<|sep|>`` and the end tokens ``<|end_of_msg|>``, ``[EOS]``, ``[EOT]`` end the message;
  whatever follows is ignored. A full transcript is read from its last ``<|open|>message role="assistant"<|sep|>``.
* The generation prompt pre-fills ``<|open|>think<|sep|>`` (thinking, the default) or ``<|open|>response<|sep|>``
  (``thinking=False``), so the model's own text starts inside a channel: ``prompt=`` says which; without it the
  thinking pre-fill is assumed.
* A generation cut by ``max_new_tokens`` may end inside a marker; the partial marker is dropped, and so is a tool
  call that was not closed (``finished`` is False, ``errors`` says what was dropped).
* Malformed structure never raises: it is repaired or dropped and described in `KimiK3Response.errors` (unknown
  tags stay visible as text; a call with no ``tool`` attribute is dropped; a non-numeric ``index`` is replaced
  by the call's position; JSON that does not parse, or is nested too deeply for Python's parser, is kept as its
  raw text). Only wrong input *types* raise (``TypeError``); `KimiK3ParseError` is what this module raises for
  values it cannot read or write.

Markers: why a plain string is ambiguous
----------------------------------------

The markers are special tokens; the text between them (tag names, attributes, values, everything the model
wrote) is ordinary text, and ordinary text may *spell* a marker (``<|close|>argument<|sep|>`` inside a string
argument, reasoning that quotes the format). Once ids are decoded to a ``str`` the two look the same, so a plain
string is read textually: every spelled marker counts as one. To parse without that ambiguity pass what still
knows the difference:

* the generated **token ids** with ``tokenizer=``: the ids of special tokens (``tokenizer.all_special_ids`` and
  the added tokens marked ``special=True``) are the markers; runs of other ids are decoded together (with
  ``skip_special_tokens=False``) as text;
* a `KimiK3Prompt` (what `format_kimi_k3_tool_calls` and the chat renderer return): only its control segments
  are markers.

Public API:

* `parse_kimi_k3_response` -> `KimiK3Response` (``reasoning``, ``content``, ``tool_calls``, ``finished``,
  ``errors``; ``.to_message()`` gives the OpenAI-style assistant message that the chat template renders back);
* `format_kimi_k3_tool_calls`: the inverse for tool calls: the ``tools`` channel as a `KimiK3Prompt`, segment for
  segment what the chat renderer writes for an assistant message's ``tool_calls``;
* `ThinkingBudgetLogitsProcessor`: a `transformers.LogitsProcessor` that closes the think channel after a
  budget of thinking tokens by forcing ``<|close|>think<|sep|><|open|>response<|sep|>`` one token per step;
* `KIMI_K3_RESPONSE_TEMPLATE`: a transformers ``response_template`` for ``tokenizer.parse_response`` and the
  ``text-generation`` pipeline (see its comment for what it cannot express).
"""

from __future__ import annotations

import json
import operator
import re
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from transformers import LogitsProcessor

from .encoding_kimi_k3 import CLOSE, OPEN, SEP, KimiK3Prompt, Segment, argument_type

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

# The marker strings the parser reads; other special tokens (media, padding, reserved) are text to it.
_MARKERS = (OPEN, CLOSE, SEP, *END_TOKENS)
_MARKER_SPLIT_RE = re.compile("(" + "|".join(re.escape(m) for m in _MARKERS) + ")")
# Prefixes of a marker that a plain string may end with when it was cut mid-marker (at least "<|").
_MARKER_PREFIXES = frozenset(m[:n] for m in _MARKERS if m.startswith("<|") for n in range(2, len(m)))
_MARKER_PREFIX_MAX = max(len(m) for m in _MARKERS)
# What a tag header cut off at the end of the output can look like: a name, then attributes, maybe unfinished.
# (Written so that no text can be matched in two ways: no backtracking blow-up on long headers.)
_PARTIAL_HEADER_RE = re.compile(r'\s*(?:[A-Za-z_][\w-]*(?:\s+[\w.-]+="[^"]*")*(?:\s+[\w.-]+(?:="[^"]*|=)?)?\s*)?')
_ATTR_RE = re.compile(r'\s+([^\s="]+)="([^"]*)"')
_ENTITY_RE = re.compile(r"&(amp|quot);")
_CHANNELS = ("think", "response", "tools")
_STRUCTURAL_TAGS = frozenset(("message", "think", "response", "tools", "call", "argument", "json"))
_ARGUMENT_TYPES = {"string": (str,), "number": (int, float), "boolean": (bool,), "array": (list,),
                   "object": (dict,), "null": (type(None),)}
_MAX_ERRORS = 64


class KimiK3ParseError(ValueError):
    """A K3 answer or tool call that this module cannot read or write (the message says what and where). Malformed
    answers do not raise it: `parse_kimi_k3_response` repairs them and lists what it did in
    `KimiK3Response.errors`."""


# ---------------------------------------------------------------------------------------------------------------
# Parsed answers
@dataclass
class KimiK3ToolCall:
    """One ``<|open|>call ...`` block: the tool name, its decoded arguments and the model's ``index`` attribute.
    ``arguments`` is a dict, or the raw string of a json block whose text is not a JSON object."""

    name: str
    arguments: dict[str, Any] | str
    index: int

    def to_openai(self, global_index: int | None = None) -> dict:
        """The OpenAI / transformers chat shape. The id is ``"{name}:{global_index}"`` as K3 serving returns it
        (spec 8); ``global_index`` defaults to this call's ``index`` attribute."""
        number = self.index if global_index is None else global_index
        arguments = self.arguments if isinstance(self.arguments, str) else dict(self.arguments)
        return {"id": f"{self.name}:{number}", "type": "function",
                "function": {"name": self.name, "arguments": arguments}}


@dataclass
class KimiK3Response:
    """A K3 answer split into its channels. ``reasoning`` is None when there was no thinking text; ``finished``
    says whether ``<|close|>message<|sep|>`` (or an end token) was reached; ``errors`` describes what was malformed
    and how it was read (empty for a well-formed answer)."""

    reasoning: str | None = None
    content: str = ""
    tool_calls: list[KimiK3ToolCall] = field(default_factory=list)
    finished: bool = False
    errors: list[str] = field(default_factory=list)

    def to_message(self) -> dict:
        """``{"role": "assistant", "content", ["reasoning_content"], ["tool_calls"]}``: the keys that the chat
        template reads when the message goes back into the history."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message


# ---------------------------------------------------------------------------------------------------------------
# Input -> pieces (marker or text) -> events (tags, text, ends)
class _Piece(NamedTuple):
    text: str
    marker: bool


class _Event(NamedTuple):
    kind: str  # "text", "open", "close", "end", "stray" (a marker that is not part of a tag)
    raw: str  # the exact text it came from
    name: str = ""
    attrs: dict | None = None
    garbled: str = ""  # header text that is not name="value" attributes


def _unescape(value: str) -> str:
    return _ENTITY_RE.sub(lambda m: "&" if m.group(1) == "amp" else '"', value)


def _escape(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _split_markers(text: str) -> list[_Piece]:
    """Textual recognition: every spelled marker counts."""
    return [_Piece(part, i % 2 == 1) for i, part in enumerate(_MARKER_SPLIT_RE.split(text)) if part]


def _drop_partial_marker(text: str) -> str:
    """A plain string cut inside a marker ("...<|clo"): drop the marker's beginning."""
    for n in range(min(len(text), _MARKER_PREFIX_MAX), 1, -1):
        if text[-n:] in _MARKER_PREFIXES:
            return text[:-n]
    return text


def _token_list(value: Any, what: str) -> list[int]:
    if isinstance(value, torch.Tensor) or (hasattr(value, "ndim") and hasattr(value, "tolist")):
        if value.ndim != 1:
            raise TypeError(f"{what}: token ids must be one row (a 1-D sequence), got shape {tuple(value.shape)}; "
                            "pass output[0] for a batch of one")
        value = value.tolist()
    try:
        return [operator.index(i) for i in value]
    except TypeError:
        raise TypeError(f"{what}: token ids must be integers") from None


def _pieces(value: Any, tokenizer: Any, what: str, errors: list[str]) -> list[_Piece]:
    if isinstance(value, KimiK3Prompt):
        out: list[_Piece] = []
        for segment in value.segments:
            out += _split_markers(segment.text) if segment.control else [_Piece(segment.text, False)]
        return out
    if isinstance(value, str):
        return _split_markers(_drop_partial_marker(value))
    if isinstance(value, (bytes, bytearray, Mapping)) or not (
            isinstance(value, (Sequence, torch.Tensor)) or hasattr(value, "tolist")):
        raise TypeError(f"{what} must be a str, a KimiK3Prompt or a 1-D sequence of token ids, "
                        f"got {type(value).__name__}")
    ids = _token_list(value, what)
    if tokenizer is None:
        raise TypeError(f"{what}: token ids need tokenizer= to tell markers (special tokens) from text")
    special = set(tokenizer.all_special_ids)
    special.update(i for i, token in tokenizer.added_tokens_decoder.items() if getattr(token, "special", False))
    vocab = len(tokenizer)
    out, run = [], []

    def flush() -> None:
        if run:
            out.append(_Piece(tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False),
                              False))
            run.clear()

    for i in ids:
        if not 0 <= i < vocab:
            if len(errors) < _MAX_ERRORS:
                errors.append(f"{what}: token id {i} is outside the tokenizer's {vocab} ids: skipped")
            continue
        if i in special:
            flush()
            token = tokenizer.convert_ids_to_tokens(i)
            out.append(_Piece(token, token in _MARKERS) if isinstance(token, str) else
                       _Piece(tokenizer.decode([i], skip_special_tokens=False), False))
        else:
            run.append(i)
    flush()
    return out


def _header(text: str) -> tuple[str, dict[str, str], str]:
    """``name key="value" ...`` -> (name, attributes unescaped, garbled rest)."""
    text = text.strip()
    name_end = len(text)
    for position, char in enumerate(text):
        if char.isspace():
            name_end = position
            break
    name, rest = text[:name_end], text[name_end:]
    attrs: dict[str, str] = {}
    position, garbled = 0, []
    while position < len(rest):
        match = _ATTR_RE.match(rest, position)
        if match is None:
            garbled.append(rest[position:].strip())
            break
        key, value = match.group(1), _unescape(match.group(2))
        if key in attrs:
            garbled.append(f"repeated {key}=")
        else:
            attrs[key] = value
        position = match.end()
    return name, attrs, "; ".join(g for g in garbled if g)


def _events(pieces: list[_Piece]) -> tuple[list[_Event], bool]:
    """Tags from markers; returns (events, whether the input ended inside a tag)."""
    merged: list[_Piece] = []
    for piece in pieces:
        if merged and not piece.marker and not merged[-1].marker:
            merged[-1] = _Piece(merged[-1].text + piece.text, False)
        elif piece.text:
            merged.append(piece)
    events: list[_Event] = []
    i, n = 0, len(merged)
    while i < n:
        text, marker = merged[i]
        if not marker:
            events.append(_Event("text", text))
            i += 1
        elif text in END_TOKENS:
            events.append(_Event("end", text))
            i += 1
        elif text in (OPEN, CLOSE):
            j, header = i + 1, ""
            if j < n and not merged[j].marker:
                header, j = merged[j].text, j + 1
            if j < n and merged[j].text == SEP:
                name, attrs, garbled = _header(header)
                events.append(_Event("open" if text == OPEN else "close", text + header + SEP, name, attrs, garbled))
                i = j + 1
            elif j >= n and _PARTIAL_HEADER_RE.fullmatch(header):
                return events, True  # cut off inside the tag: drop it
            else:
                events.append(_Event("stray", text))
                i += 1
        else:
            events.append(_Event("stray", text))
            i += 1
    return events, False


def _is_assistant_header(event: _Event) -> bool:
    return event.kind == "open" and event.name == "message" and event.attrs.get("role") == "assistant"


def _last_header(events: list[_Event]) -> int | None:
    for i in range(len(events) - 1, -1, -1):
        if _is_assistant_header(events[i]):
            return i
    return None


def _message_end(events: list[_Event]) -> int | None:
    for i, event in enumerate(events):
        if event.kind == "end" or (event.kind == "close" and event.name == "message"):
            return i
    return None


# ---------------------------------------------------------------------------------------------------------------
# Events -> channels
def _type_matches(value: Any, kind: str) -> bool:
    if kind != "boolean" and isinstance(value, bool):
        return False
    return isinstance(value, _ARGUMENT_TYPES[kind])


def _snippet(text: str, width: int = 40) -> str:
    return repr(text if len(text) <= width else text[:width] + "...")


class _Reader:
    def __init__(self, events: list[_Event], result: KimiK3Response):
        self.events = events
        self.result = result
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.seen: set[str] = set()
        self.positions: dict[tuple[str, str], list[int]] = {}  # (kind, tag name) -> event indices
        for i, event in enumerate(events):
            if event.kind in ("open", "close"):
                self.positions.setdefault((event.kind, event.name), []).append(i)

    # ------------------------------------------------------------------ helpers
    def error(self, message: str) -> None:
        errors = self.result.errors
        if message in errors:
            return
        if len(errors) < _MAX_ERRORS:
            errors.append(message)
        elif len(errors) == _MAX_ERRORS:
            errors.append("... more errors left out")

    def next_tag(self, kind: str, name: str, start: int) -> int | None:
        positions = self.positions.get((kind, name), ())
        k = bisect_left(positions, start)
        return positions[k] if k < len(positions) else None

    def next_close(self, name: str, start: int) -> int | None:
        return self.next_tag("close", name, start)

    def is_tag(self, event: _Event, kind: str, *names: str) -> bool:
        return event.kind == kind and event.name in names

    def as_text(self, event: _Event, where: str) -> str:
        """An event read as text of ``where``; tags and markers that look structural get a note."""
        if event.kind in ("open", "close") and event.name in _STRUCTURAL_TAGS:
            self.error(f"{where}: {event.kind} {event.name} markers inside it were read as text")
        elif event.kind == "stray":
            self.error(f"{where}: a {event.raw} marker that starts no tag was read as text")
        return event.raw

    def enter(self, channel: str) -> str:
        if channel in self.seen:
            kept = "calls were kept" if channel == "tools" else "text was added to the first one's"
            self.error(f"a second {channel} channel (the format has one): its {kept}")
        self.seen.add(channel)
        return channel

    # ------------------------------------------------------------------ states
    def run(self, channel: str | None) -> None:
        i, n = 0, len(self.events)
        if channel is not None:
            self.seen.add(channel)
        while True:
            if channel in ("think", "response"):
                i, channel = self.text_channel(i, channel)
            elif i >= n:
                break
            elif channel == "tools":
                i, channel = self.tools(i)
            else:
                i, channel = self.between(i)
        self.result.reasoning = "".join(self.reasoning) or None
        self.result.content = "".join(self.content)

    def text_channel(self, i: int, channel: str) -> tuple[int, str | None]:
        target = self.reasoning if channel == "think" else self.content
        mark = len(target)
        where = f"the {channel} channel"
        end = self.next_close(channel, i)
        if end is not None:  # the channel extends to its own close: everything before it is its text
            for event in self.events[i:end]:
                target.append(self.as_text(event, where))
            return end + 1, None
        for k in range(i, len(self.events)):
            event = self.events[k]
            if event.kind == "text":
                target.append(event.raw)
            elif channel == "think" and self.is_tag(event, "close", "response"):
                # the model skipped thinking: what was taken for reasoning was the response
                self.content.extend(self.reasoning[mark:])
                del self.reasoning[mark:]
                return k + 1, None
            elif channel == "think" and self.is_tag(event, "open", "response"):
                return k + 1, self.enter("response")
            elif self.is_tag(event, "open", "tools"):
                return k + 1, self.enter("tools")
            else:
                target.append(self.as_text(event, where))
        return len(self.events), None

    def between(self, i: int) -> tuple[int, str | None]:
        event = self.events[i]
        if event.kind == "text":
            if event.raw.strip() or not self.seen:  # whitespace between channels carries nothing
                self.content.append(event.raw)
        elif event.kind == "open" and event.name in _CHANNELS:
            if event.attrs or event.garbled:
                self.error(f"{_snippet(event.raw)}: a channel marker takes no attributes; they were ignored")
            return i + 1, self.enter(event.name)
        elif event.kind == "close" and event.name in _CHANNELS:
            self.error(f"{_snippet(event.raw)} closes a channel that is not open: dropped")
        elif event.kind == "open" and event.name in ("call", "argument", "json"):
            self.error(f"an {event.name} block outside the tools channel is not a tool call: kept as text"
                       if event.name == "argument" else
                       f"a {event.name} block outside the tools channel is not a tool call: kept as text")
            self.content.append(event.raw)
        elif event.kind in ("open", "close"):
            self.error(f"unknown or misplaced tag {_snippet(event.raw)}: kept as text")
            self.content.append(event.raw)
        else:
            self.error(f"a {event.raw} marker that starts no tag: kept as text")
            self.content.append(event.raw)
        return i + 1, None

    def tools(self, i: int) -> tuple[int, str | None]:
        k, n = i, len(self.events)
        while k < n:
            event = self.events[k]
            if event.kind == "text":
                if event.raw.strip():
                    self.error(f"text {_snippet(event.raw)} between tool calls: dropped")
                k += 1
            elif self.is_tag(event, "open", "call"):
                k = self.call(k)
            elif self.is_tag(event, "close", "tools"):
                return k + 1, None
            elif self.is_tag(event, "open", "think", "response"):
                self.error(f"the tools channel was not closed before {_snippet(event.raw)}")
                return k + 1, self.enter(event.name)
            elif self.is_tag(event, "open", "argument", "json"):
                end = self.next_close(event.name, k + 1)
                self.error(f"{'an' if event.name == 'argument' else 'a'} {event.name} block outside a call: dropped")
                k = k + 1 if end is None else end + 1
            else:
                self.error(f"{_snippet(event.raw)} in the tools channel outside a call: dropped")
                k += 1
        if self.result.finished:
            self.error("the tools channel was not closed")
        return n, None

    def call(self, k: int) -> int:
        header = self.events[k]
        name = header.attrs.get("tool")
        position = len(self.result.tool_calls) + 1
        label = f"call {position}" if name is None else f"call {name!r}"
        if header.garbled:
            self.error(f"{label}: garbled attributes {_snippet(header.garbled)} ignored")
        if name is None:
            self.error(f"{label} has no tool= attribute: the call was dropped")
        elif name == "":
            self.error(f"{label} has an empty tool name")
        index_text = header.attrs.get("index")
        if index_text is not None and index_text.isascii() and index_text.isdigit():
            index = int(index_text)
        else:
            self.error(f"{label}: index={index_text!r} is not a number; its position {position} was used")
            index = position
        arguments: dict[str, Any] = {}
        raw_json: str | None = None
        has_block = False
        j, n = k + 1, len(self.events)
        while j < n:
            event = self.events[j]
            if event.kind == "text":
                if event.raw.strip():
                    self.error(f"{label}: text {_snippet(event.raw)} between arguments: dropped")
                j += 1
            elif self.is_tag(event, "open", "argument", "json"):
                j, value = self.value_block(j, label)
                if event.name == "argument":
                    if value is not None:
                        key, decoded = value
                        if raw_json is not None:
                            self.error(f"{label} has both a json block and arguments: the arguments were kept")
                            raw_json = None
                        if key in arguments:
                            self.error(f"{label}: argument {key!r} given twice: the last one was kept")
                        arguments[key] = decoded
                        has_block = True
                elif value is not None:
                    if has_block:
                        self.error(f"{label} has a second arguments block: it was ignored")
                    else:
                        raw_json, has_block = value, True
            elif self.is_tag(event, "close", "call"):
                if name is not None:
                    self.result.tool_calls.append(KimiK3ToolCall(name, arguments if raw_json is None else raw_json,
                                                                 index))
                return j + 1
            elif self.is_tag(event, "open", "call") or self.is_tag(event, "close", "tools") or \
                    self.is_tag(event, "open", "think", "response", "tools"):
                self.error(f"{label} was not closed before {_snippet(event.raw)}: the call was dropped")
                return j
            else:
                self.error(f"{label}: {_snippet(event.raw)} between arguments: dropped")
                j += 1
        self.error(f"the output ended inside {label}: the call was dropped")
        return n

    def value_block(self, j: int, label: str) -> tuple[int, Any]:
        """An argument or json block -> (next index, (key, value) / raw arguments, or None if unusable)."""
        header = self.events[j]
        tag = header.name
        end = self.next_close(tag, j + 1)
        if end is None:
            boundaries = [self.next_tag(kind, name, j + 1) for kind, name in (
                ("close", "call"), ("close", "tools"), ("open", "call"), ("open", "argument"), ("open", "json"))]
            stop = min((b for b in boundaries if b is not None), default=len(self.events))
            if stop < len(self.events):
                self.error(f"{label}: {'an' if tag == 'argument' else 'a'} {tag} block was not closed before "
                           f"{_snippet(self.events[stop].raw)}")
            body, after = self.events[j + 1:stop], stop
        else:
            body, after = self.events[j + 1:end], end + 1
        where = f"{label}, {tag} block"
        raw = "".join(event.raw if event.kind == "text" else self.as_text(event, where) for event in body)
        if header.garbled:
            self.error(f"{where}: garbled attributes {_snippet(header.garbled)} ignored")
        if tag == "json":
            if header.attrs.get("type", "object") != "object":
                self.error(f"{where}: type={header.attrs['type']!r} (expected 'object')")
            if not raw.strip():
                return after, {}
            try:
                parsed = json.loads(raw)
            except (ValueError, RecursionError):
                return after, raw
            return after, parsed if isinstance(parsed, dict) else raw
        key = header.attrs.get("key")
        if key is None:
            self.error(f"{label}: an argument without key=: dropped")
            return after, None
        kind = header.attrs.get("type")
        where = f"{label}, argument {key!r}"
        if kind is None:
            self.error(f"{where} has no type=: read as a string")
            kind = "string"
        if kind == "string":
            return after, (key, raw)
        if kind not in _ARGUMENT_TYPES:
            self.error(f"{where}: unknown type={kind!r}: kept as text")
            return after, (key, raw)
        try:
            value = json.loads(raw)
        except RecursionError:
            self.error(f"{where}: the JSON is nested too deeply to read: kept as text")
            return after, (key, raw)
        except ValueError:
            self.error(f"{where}: not valid JSON for type={kind!r}: kept as text")
            return after, (key, raw)
        if not _type_matches(value, kind):
            self.error(f"{where}: the value is a JSON {type(value).__name__}, not {kind}")
        return after, (key, value)


def parse_kimi_k3_response(output: str | KimiK3Prompt | Sequence[int] | torch.Tensor,
                           prompt: str | KimiK3Prompt | Sequence[int] | torch.Tensor | None = None, *,
                           tokenizer: Any = None) -> KimiK3Response:
    """Split a K3 answer into reasoning, content and tool calls.

    ``output``: what the model generated (a full transcript also works: only what follows its last
    ``<|open|>message role="assistant"<|sep|>`` is read), as

    * the token ids (a list, tuple or 1-D tensor / array) with ``tokenizer=``: special-token ids are the markers,
      the ids between them are decoded as text. The unambiguous form;
    * a `KimiK3Prompt`: only its control segments are markers;
    * a ``str`` decoded with ``skip_special_tokens=False``: markers are recognised by their spelling, so text that
      merely spells a marker counts as one (a string cannot tell them apart).

    ``prompt`` (same forms): the prompt the output continues; it says which channel the generation prompt left open
    (``<|open|>think<|sep|>`` or ``<|open|>response<|sep|>``; text it pre-filled after that counts as generated).
    Without it the thinking pre-fill is assumed, unless ``output`` holds the assistant header itself.

    Tool calls are read only from the tools channel. Malformed answers give a result whose ``errors`` say what was
    wrong; only an input of the wrong type raises (``TypeError``)."""
    result = KimiK3Response()
    events, truncated = _events(_pieces(output, tokenizer, "output", result.errors))
    header = _last_header(events)
    channel: str | None
    if header is not None:
        events, channel = events[header + 1:], None
    elif prompt is not None:
        prompt_events, _ = _events(_pieces(prompt, tokenizer, "prompt", result.errors))
        prompt_header = _last_header(prompt_events)
        tail = [] if prompt_header is None else prompt_events[prompt_header + 1:]
        if _message_end(tail) is not None:
            tail = []  # the prompt's last assistant message is closed: the output starts outside it
        events, channel = tail + events, None
    else:
        channel = "think"
    end = _message_end(events)
    if end is not None:
        events, result.finished = events[:end], True
    elif truncated:
        result.errors.append("the output ends inside a marker: the partial marker was dropped")
    _Reader(events, result).run(channel)
    return result


# ---------------------------------------------------------------------------------------------------------------
# Tool calls -> the tools channel
def _dumps(value: Any, where: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except RecursionError:
        raise KimiK3ParseError(f"{where}: the value is nested too deeply to write as JSON") from None
    except TypeError as error:
        raise TypeError(f"{where}: {error}") from None
    except ValueError as error:
        raise KimiK3ParseError(f"{where}: {error}") from None


def _call_parts(call: Any, position: int) -> tuple[str, dict | str, int]:
    """(name, arguments dict or raw json-block text, index) of a `KimiK3ToolCall` or an OpenAI-style dict."""
    where = f"tool call {position}"
    if isinstance(call, KimiK3ToolCall):
        name, arguments, index = call.name, call.arguments, call.index
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"{where}: index must be an int, got {type(index).__name__}")
    elif isinstance(call, Mapping):
        function = call.get("function", call)
        if not isinstance(function, Mapping):
            raise TypeError(f"{where}: 'function' must be a dict, got {type(function).__name__}")
        name, arguments, index = function.get("name"), function.get("arguments"), position
    else:
        raise TypeError(f"{where} must be a KimiK3ToolCall or an OpenAI-style dict, got {type(call).__name__}")
    if name is None:
        raise KimiK3ParseError(f"{where} has no function name")
    if arguments is None:
        return str(name), {}, index
    if isinstance(arguments, Mapping):
        return str(name), dict(arguments), index
    if not isinstance(arguments, str):
        raise TypeError(f"{where}: arguments must be a dict or a string, got {type(arguments).__name__}")
    if not arguments.strip():
        return str(name), {}, index
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        parsed = None
    return str(name), (parsed if isinstance(parsed, dict) else arguments), index


def format_kimi_k3_tool_calls(calls: Iterable[KimiK3ToolCall | Mapping]) -> KimiK3Prompt:
    """The ``tools`` channel for ``calls``, as a `KimiK3Prompt` laid out segment for segment as the chat renderer
    writes an assistant message's ``tool_calls`` (markers as control segments; tag names, each `` key="value"``
    attribute and each value as text segments; empty values get no segment). The inverse of the tool-call part of
    `parse_kimi_k3_response`: parsing it gives back every name and argument exactly (as a `KimiK3Prompt` or as
    token ids; its plain ``str`` is read textually, see the module docstring).

    ``calls``: `KimiK3ToolCall` objects or OpenAI-style dicts (``{"function": {"name", "arguments"}}`` or the flat
    ``{"name", "arguments"}``; arguments a dict or a JSON string). String arguments that are not a JSON object go
    into a json block and parse back as that string; blank ones mean no arguments. Indices run 1, 2, ... for dicts;
    a `KimiK3ToolCall` keeps its own. A Python ``int``/``float`` argument gets ``type="number"``, strings are written
    raw, every other value as JSON. No calls give an empty prompt (the format has no empty tools channel)."""
    if isinstance(calls, (str, bytes, Mapping, KimiK3ToolCall)):
        raise TypeError(f"calls must be a list of tool calls, got {type(calls).__name__}")
    segments: list[Segment] = []

    def text(value: str) -> None:
        if value:
            segments.append(Segment(value, False))

    def open_tag(tag: str, attributes: Sequence[tuple[str, Any]] = ()) -> None:
        segments.append(Segment(OPEN, True))
        text(tag)
        for key, value in attributes:
            text(f' {key}="{_escape(value)}"')
        segments.append(Segment(SEP, True))

    def close_tag(tag: str) -> None:
        segments.extend((Segment(CLOSE, True), Segment(tag, False), Segment(SEP, True)))

    for position, call in enumerate(calls, start=1):
        name, arguments, index = _call_parts(call, position)
        if not segments:
            open_tag("tools")
        open_tag("call", [("tool", name), ("index", index)])
        if isinstance(arguments, str):
            open_tag("json", [("type", "object")])
            text(arguments)
            close_tag("json")
        else:
            for key, value in arguments.items():
                kind = argument_type(value)
                open_tag("argument", [("key", key), ("type", kind)])
                text(value if kind == "string" else _dumps(value, f"tool call {position}, argument {key!r}"))
                close_tag("argument")
        close_tag("call")
    if segments:
        close_tag("tools")
    return KimiK3Prompt(segments)


# ---------------------------------------------------------------------------------------------------------------
# transformers' response_template (tokenizer.parse_response, the text-generation pipeline)
# `KIMI_K3_RESPONSE_TEMPLATE` lets ``tokenizer.parse_response(text, prefix=prompt)`` and
# ``pipeline("text-generation")`` return ``{"role": "assistant", "reasoning_content", "content", "tool_calls"}``
# (set ``tokenizer.response_template = KIMI_K3_RESPONSE_TEMPLATE`` before saving). transformers' template language
# is flat, untyped and reads text, so it cannot express what `parse_kimi_k3_response` handles: argument values stay
# text unless ``tools=`` schemas are passed (then transformers casts them; K3's own ``type`` attribute is not read);
# a skipped think channel (an answer closed by a bare ``<|close|>response<|sep|>``) is reported as reasoning; a json
# block's raw arguments are lost (the call gets ``{}``); attribute entities are not unescaped; and, working on decoded
# text, it cannot tell real markers from spelled ones (pass token ids to `parse_kimi_k3_response` for that).
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

    def _ids_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The marker, stop and forced ids on `device`, copied there once (not at every step)."""
        cached = self.__dict__.setdefault("_device_ids", {})
        if device not in cached:
            cached[device] = tuple(t.to(device) for t in (self.think_open_ids, self.stop_ids, self.end_sequence_ids))
        return cached[device]

    def forced_tokens(self, input_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forced_token` of every row at once, without reading a value on the host (no sync on a GPU):
        ``(forced [B] bool, token [B] long)``, the token meaningful where forced."""
        marker, stop_ids, forced_ids = self._ids_on(input_ids.device)
        rows, length = input_ids.shape
        width, budget = marker.numel(), self.max_thinking_tokens
        positions = torch.arange(length, device=input_ids.device)
        no = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
        if length < width:
            return no, no.long()
        opens = (input_ids.unfold(1, width, 1) == marker).all(dim=-1)  # [B, L - width + 1]
        last_open = torch.where(opens, positions[: opens.shape[1]], -1).amax(dim=1)
        begin = last_open + width  # the thinking span's first position
        stopped = torch.isin(input_ids, stop_ids) & (positions >= begin[:, None])
        first_stop = torch.where(stopped, positions, length).amin(dim=1)
        has_stop = first_stop < length
        unclosed = ~has_stop & (length - begin >= budget)
        # closed at or after the budget: the forced sequence is being written; its next token, if any is left
        done = length - first_stop
        follows = torch.ones_like(has_stop)
        for j in range(forced_ids.numel()):
            at = (first_stop + j).clamp(max=length - 1)
            follows &= (j >= done) | (input_ids.gather(1, at[:, None])[:, 0] == forced_ids[j])
        closing = has_stop & (first_stop - begin >= budget) & (done < forced_ids.numel()) & follows
        token = torch.where(unclosed, forced_ids[0], forced_ids[done.clamp(max=forced_ids.numel() - 1)])
        return (unclosed | closing) & (last_open >= 0), token

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        forced, token = self.forced_tokens(input_ids)
        only = torch.full_like(scores, float("-inf")).scatter_(1, token[:, None], 0.0)
        return torch.where(forced[:, None], only, scores)


__all__ = [
    "KIMI_K3_RESPONSE_TEMPLATE",
    "KimiK3ParseError",
    "KimiK3Response",
    "KimiK3ToolCall",
    "ThinkingBudgetLogitsProcessor",
    "format_kimi_k3_tool_calls",
    "parse_kimi_k3_response",
]
