"""K3's conversation format (XTML), rendered in Python as the release's own encoder does.

A K3 prompt is a list of *segments*: control segments (the channel markers ``<|open|>``, ``<|close|>``, ``<|sep|>``,
``<|end_of_msg|>`` and the media spans the template places) are tokenized with special tokens allowed; text segments
(tag names, attributes, and everything a user, a tool or the model wrote) are tokenized with special tokens
disallowed, each on its own. So user text that spells ``<|close|>message<|sep|>`` or ``<|media_pad|>`` stays text:
it can never forge a turn or a media slot.

The layout follows the release's ``encoding_k3.py`` as vendored by vLLM (``vllm/tokenizers/encoding_k3.py``,
"derived from moonshotai/Kimi-K3 encoding_k3.py at commit c5d1dd4"); this module is written from its rules, not
copied. Every message is ``<|open|>message role="..."<|sep|>BODY<|close|>message<|sep|><|end_of_msg|>``:

* a static tool declaration (``tools=``) comes first, then the ``thinking_effort`` system message (thinking on and
  an effort given), then the conversation, then the ``tool_choice`` and ``response_format`` system messages, then
  the generation prompt ``<|open|>message role="assistant"<|sep|><|open|>think<|sep|>`` (``<|open|>response<|sep|>``
  with ``thinking=False``);
* assistant history: ``<|open|>think<|sep|>R<|close|>think<|sep|>`` when thinking is on (empty when there is no
  reasoning), ``<|open|>response<|sep|>C<|close|>response<|sep|>``, then a ``tools`` channel with one ``call`` per
  tool call; no ``name`` attribute;
* tool results are re-ordered into the preceding assistant's ``tool_calls`` order by ``tool_call_id``.

Where this module differs from that encoder, on purpose:

* ``developer`` messages are rendered as ``system`` (the serving layer's rewrite, K3_SPEC.md section 8); the encoder
  itself skips them. Unknown roles, unknown content parts and non-dict messages raise `KimiK3ChatError` where the
  encoder skips or fails with ``KeyError``; so do values the encoder would coerce: a non-string text part, name,
  tool name or reasoning (it writes ``str(value)``), a non-bool ``thinking`` (it reads ``"no"`` as on), a
  ``response_format`` of unknown type (it ignores it) or ``json_schema`` without a ``json_schema`` (it writes
  ``null``);
* a ``<|kimi_image_placeholder|>`` typed in text stays text, also when ``image_prompts`` are given (the encoder would
  put the next image there);
* video parts render as one ``<|kimi_video_placeholder|>`` control segment each (the encoder has no video);
* ``continue_final_message`` (transformers' assistant prefill) leaves the last assistant message open.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
VIDEO_PLACEHOLDER = "<|kimi_video_placeholder|>"
THINKING_EFFORTS = ("low", "high", "max")

_THINKING_EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
    "supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with "
    "`thinking_effort={effort}`."
)
_TOOL_CHOICE_BODY = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_JSON_ONLY = ("Your response must be raw JSON data without markdown code blocks (```json) or any additional "
              "formatting.")


class KimiK3ChatError(ValueError):
    """A conversation the K3 format cannot render as given; the message says which field and what to pass."""


class Segment(NamedTuple):
    """One piece of a K3 prompt. ``control``: tokenized with special tokens allowed (template markers only)."""

    text: str
    control: bool = False


class KimiK3Prompt(str):
    """A rendered K3 prompt: the prompt text, which also remembers its segments.

    It is a ``str`` (print it, compare it, save it), and K3's tokenizer and processor tokenize it segment by segment,
    so the control tokens in it are exactly the ones the template wrote. Slicing and ``+`` keep the segments (a plain
    ``str`` added to it joins as prompt text of your own, where special-token strings are special tokens); other
    string operations (``.format``, ``.strip``, f-strings) return a plain ``str``, tokenized as ordinary prompt text.
    ``generated`` holds the indices of the segments an assistant wrote (for ``return_assistant_tokens_mask``);
    ``media`` the image / video content parts in the order of their slots."""

    segments: tuple[Segment, ...]
    generated: frozenset[int]
    media: tuple

    def __new__(cls, segments: Iterable[Segment | tuple[str, bool]], generated: Iterable[int] = (),
                media: Iterable = ()):
        segments = tuple(Segment(str(text), bool(control)) for text, control in segments)
        self = super().__new__(cls, "".join(segment.text for segment in segments))
        self.segments = segments
        self.generated = frozenset(generated)
        self.media = tuple(media)
        return self

    def __reduce__(self):
        return (KimiK3Prompt, (self.segments, self.generated, self.media))

    def count_control(self, text: str) -> int:
        """How many control segments are exactly ``text`` (e.g. the image placeholder: the image slots)."""
        return sum(1 for segment in self.segments if segment.control and segment.text == text)

    def _joined(self, other, other_first: bool):
        if isinstance(other, KimiK3Prompt):
            left, right = (other, self) if other_first else (self, other)
            shift = len(left.segments)
            return KimiK3Prompt(left.segments + right.segments,
                                set(left.generated) | {i + shift for i in right.generated}, left.media + right.media)
        if not isinstance(other, str):
            return NotImplemented
        if not other:
            return self
        piece = (Segment(other, True),)  # a plain string is the caller's own prompt text
        if other_first:
            return KimiK3Prompt(piece + self.segments, {i + 1 for i in self.generated}, self.media)
        return KimiK3Prompt(self.segments + piece, self.generated, self.media)

    def __add__(self, other):
        return self._joined(other, other_first=False)

    def __radd__(self, other):
        return self._joined(other, other_first=True)

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            return str.__getitem__(self, key)
        start, stop, _ = key.indices(len(self))
        segments, generated, position = [], [], 0
        for index, segment in enumerate(self.segments):
            end = position + len(segment.text)
            lo, hi = max(start, position), min(stop, end)
            if lo < hi:
                whole = lo == position and hi == end
                # a cut through a control segment leaves text: a partial marker is not a marker
                segments.append(Segment(segment.text[lo - position:hi - position], segment.control and whole))
                if index in self.generated:
                    generated.append(len(segments) - 1)
            position = end
        return KimiK3Prompt(segments, generated)


# ------------------------------------------------------------------------------------------------- small pieces
def _text(value: Any) -> list[Segment]:
    value = str(value)
    return [Segment(value)] if value else []


def _control(value: str) -> list[Segment]:
    return [Segment(value, True)] if value else []


def _attribute_value(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _open(tag: str, attributes: Sequence[tuple[str, Any]] = ()) -> list[Segment]:
    out = _control(OPEN) + _text(tag)
    for key, value in attributes:
        out += _text(f' {key}="{_attribute_value(value)}"')
    return out + _control(SEP)


def _close(tag: str) -> list[Segment]:
    return _control(CLOSE) + _text(tag) + _control(SEP)


def _message_end() -> list[Segment]:
    return _close("message") + _control(END_OF_MSG)


def _system_note(kind: str, body: str) -> list[Segment]:
    return _open("message", [("role", "system"), ("type", kind)]) + _text(body.strip()) + _message_end()


def _json(value: Any, **kwargs) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, **kwargs)
    except RecursionError:
        raise KimiK3ChatError("a value is nested too deeply to write as JSON") from None
    except (TypeError, ValueError) as error:
        raise KimiK3ChatError(f"a value cannot be written as JSON: {error}") from None


def _compact_json(value: Any) -> str:
    return _json(value, separators=(",", ":"))


def _sorted_deep(value: Any) -> Any:
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise KimiK3ChatError(f"a JSON object key must be a string, got {key!r} ({type(key).__name__}) in "
                                      f"{dict(value)!r:.120}; write the key as a string (JSON Schema property names "
                                      "are strings)")
        return {key: _sorted_deep(value[key]) for key in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [_sorted_deep(item) for item in value]
    return value


def _sorted_json(value: Any) -> str:
    """Compact JSON with every object's keys sorted (tool declarations, response schemas)."""
    try:
        return _compact_json(_sorted_deep(value))
    except RecursionError:
        raise KimiK3ChatError("a value is nested too deeply to write as JSON") from None


def _field(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def argument_type(value: Any) -> str:
    """The ``type`` attribute of a tool-call argument (JSON Schema's integer is K3's number)."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    raise TypeError(f"a tool call argument must be a JSON value, got {type(value).__name__}")


def _argument_text(value: Any) -> str:
    return value if isinstance(value, str) else _json(value)


class _Media:
    """Hands out the control text of each image / video slot in order, and keeps the parts in that order."""

    def __init__(self, image_prompts: Sequence[str] | None):
        self.image_prompts = None if image_prompts is None else list(image_prompts)
        self.used = 0
        self.parts: list = []

    def image(self, part) -> list[Segment]:
        self.parts.append(part)
        if self.image_prompts is None:
            return _control(IMAGE_PLACEHOLDER)
        if self.used >= len(self.image_prompts):
            raise KimiK3ChatError(f"the conversation has more images than the {len(self.image_prompts)} "
                                  "image_prompts given; pass one prompt per image part")
        self.used += 1
        return _control(self.image_prompts[self.used - 1])

    def video(self, part) -> list[Segment]:
        self.parts.append(part)
        return _control(VIDEO_PLACEHOLDER)

    def check_used(self) -> None:
        if self.image_prompts is not None and self.used != len(self.image_prompts):
            raise KimiK3ChatError(f"{len(self.image_prompts)} image_prompts were given for {self.used} image parts; "
                                  "pass one prompt per image part")


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise KimiK3ChatError(f"{where} must be a string, got {type(value).__name__} {value!r:.60}")
    return value


def _content(content: Any, media: _Media, where: str) -> list[Segment]:
    if content is None:
        return []
    if isinstance(content, str):
        return _text(content)
    if isinstance(content, Mapping):
        content = [content]
    if not isinstance(content, (list, tuple)):
        raise KimiK3ChatError(f"{where}: content must be a string or a list of parts, got {type(content).__name__}")
    out: list[Segment] = []
    for i, part in enumerate(content):
        kind = _field(part, "type") if isinstance(part, Mapping) else None
        if kind in ("image", "image_url"):
            out += media.image(part)
        elif kind in ("video", "video_url"):
            out += media.video(part)
        elif kind == "text":
            out += _text(_string(part.get("text"), f"{where}: content[{i}]['text']"))
        else:
            raise KimiK3ChatError(f"{where}: unsupported content part {part!r:.80}; K3 takes parts of type 'text' "
                                  "(with a string 'text'), 'image' / 'image_url' and 'video' / 'video_url'")
    return out


# ------------------------------------------------------------------------------------------------- normalising
def _call_arguments(arguments: Any, where: str) -> tuple[dict, str | None]:
    """(arguments as a dict, raw text of arguments that are not JSON), as the release's encoder reads them."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, Mapping):
        return dict(arguments), None
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}, None
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return {}, arguments
        except RecursionError:
            raise KimiK3ChatError(f"{where}: the arguments JSON is nested too deeply to read") from None
        if not isinstance(parsed, dict):
            raise KimiK3ChatError(f"{where}: tool call arguments must be a JSON object, got {type(parsed).__name__}")
        return parsed, None
    raise KimiK3ChatError(f"{where}: tool call arguments must be a dict or a JSON object string, "
                          f"got {type(arguments).__name__}")


class _Call(NamedTuple):
    name: Any
    arguments: dict
    raw: str | None


def _calls(message: Mapping, where: str) -> list[_Call]:
    calls = message.get("tool_calls") or []
    if not isinstance(calls, (list, tuple)):
        raise KimiK3ChatError(f"{where}: tool_calls must be a list")
    out = []
    for position, call in enumerate(calls, start=1):
        if not isinstance(call, Mapping):
            raise KimiK3ChatError(f"{where}: tool_calls[{position - 1}] must be a dict")
        function = call.get("function", call)
        if not isinstance(function, Mapping) or function.get("name") is None:
            raise KimiK3ChatError(f"{where}: tool_calls[{position - 1}] has no function name")
        _string(function["name"], f"{where}: tool_calls[{position - 1}] function name")
        arguments, raw = _call_arguments(function.get("arguments"), f"{where}.tool_calls[{position - 1}]")
        out.append(_Call(function["name"], arguments, raw))
    return out


def _call_ids(message: Mapping) -> dict[str, tuple[int, Any]]:
    index: dict[str, tuple[int, Any]] = {}
    for position, call in enumerate(message.get("tool_calls") or [], start=1):
        if not isinstance(call, Mapping):
            continue
        function = call.get("function", call)
        name = function.get("name") if isinstance(function, Mapping) else None
        if call.get("id") is not None:
            index.setdefault(str(call["id"]), (position, name))
    return index


def order_tool_results(messages: Sequence[Mapping]) -> list[Mapping]:
    """Each run of consecutive ``tool`` messages in the preceding assistant's ``tool_calls`` order, matched by
    ``tool_call_id`` (the matched call's name becomes the result's ``tool``). A run with any id that matches no call
    keeps its order, but its matched results still take their call's name, as the release's encoder does. The input
    is not modified."""
    out: list[Mapping] = []
    ids: dict[str, tuple[int, Any]] = {}
    i = 0
    while i < len(messages):
        message = messages[i]
        role = message.get("role") if isinstance(message, Mapping) else None
        if role != "tool":
            if role == "assistant":
                ids = _call_ids(message)
            out.append(message)
            i += 1
            continue
        run, matched = [], True
        while i < len(messages) and isinstance(messages[i], Mapping) and messages[i].get("role") == "tool":
            result = messages[i]
            call_id = result.get("tool_call_id", result.get("id"))
            target = ids.get(str(call_id)) if call_id is not None else None
            if target is None:
                matched = False
                run.append((0, result))
            else:
                position, name = target
                resolved = dict(result)
                if name is not None:
                    resolved["tool"] = name
                    if "name" in resolved:
                        resolved["name"] = name
                run.append((position, resolved))
            i += 1
        out.extend(resolved for _, resolved in (sorted(run, key=lambda item: item[0]) if matched else run))
    return out


def _response_format(response_format: Any) -> tuple[str | None, Any]:
    """(``"json_object"`` / ``"json_schema"`` / None, the schema) of an OpenAI ``response_format``: a dict, a bare
    type string, an object with those fields, or a pydantic model class (its JSON schema)."""
    if response_format is None:
        return None, None
    if hasattr(response_format, "model_json_schema") and isinstance(response_format, type):
        return "json_schema", response_format.model_json_schema()
    kind = _field(response_format, "type", response_format)
    if kind in (None, "text"):
        return None, None
    if kind == "json_object":
        return kind, None
    if kind != "json_schema":
        raise KimiK3ChatError(f"response_format type {kind!r:.60} is not one K3 knows: use 'text', 'json_object' or "
                              "'json_schema' (with a json_schema: {'schema': ...})")
    json_schema = _field(response_format, "json_schema")
    if json_schema is None:
        raise KimiK3ChatError("response_format 'json_schema' needs a json_schema: {'name': ..., 'schema': {...}}")
    return kind, _field(json_schema, "schema", _field(json_schema, "json_schema", json_schema))


def resolve_thinking(thinking: bool | None = None, enable_thinking: bool | None = None,
                     thinking_effort: str | None = None, reasoning_effort: str | None = None) -> tuple[bool, str | None]:
    """(thinking, thinking_effort) from the names callers use: ``thinking`` (K3's; default on), ``enable_thinking``
    (Qwen-style alias), ``reasoning_effort`` (OpenAI's; ``"none"`` turns thinking off, otherwise it is the effort)."""
    for name, value in (("thinking", thinking), ("enable_thinking", enable_thinking)):
        if value is not None and not isinstance(value, bool):
            raise KimiK3ChatError(f"{name} must be True, False or None, got {value!r:.40}")
    if thinking is not None and enable_thinking is not None and bool(thinking) != bool(enable_thinking):
        raise KimiK3ChatError(f"thinking={thinking!r} and enable_thinking={enable_thinking!r} disagree; pass one")
    if thinking is None:
        thinking = True if enable_thinking is None else bool(enable_thinking)
    if reasoning_effort is not None:
        if reasoning_effort == "none":
            thinking = False
        elif reasoning_effort not in THINKING_EFFORTS:
            # OpenAI's efforts K3 has no equivalent for: warned about, the encoder's default used (K3_SPEC.md 8)
            logger.warning(f"reasoning_effort={reasoning_effort!r} has no K3 thinking_effort (low, high, max); "
                           "rendering without an effort note")
        elif thinking_effort is None:
            thinking_effort = reasoning_effort
    if thinking and thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise KimiK3ChatError(f"thinking_effort={thinking_effort!r} is not one K3 was trained with; pass one of "
                              f"{', '.join(THINKING_EFFORTS)}, or leave it out")
    return bool(thinking), thinking_effort


# ------------------------------------------------------------------------------------------------- rendering
def _assistant(message: Mapping, media: _Media, thinking: bool, where: str, generated: list[int],
               segments: list[Segment], open_end: bool) -> None:
    """Append an assistant message; with ``open_end`` leave it open for the model to continue. The segments after
    what the generation prompt writes (header and first channel) are recorded in ``generated``."""
    segments += _open("message", [("role", "assistant")])
    calls = _calls(message, where)
    if open_end and calls:
        raise KimiK3ChatError(f"{where}: continue_final_message cannot continue a message with tool_calls")
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning is not None:
        _string(reasoning, f"{where}: reasoning_content")
    content = _content(message.get("content"), media, where)
    if thinking:
        segments += _open("think")
        start = len(segments)
        if reasoning is not None and str(reasoning).strip():
            segments += _text(reasoning)
        if open_end and not content:  # continue the reasoning
            generated.extend(range(start, len(segments)))
            return
        segments += _close("think") + _open("response")
    else:
        segments += _open("response")
        start = len(segments)
    segments += content
    if not open_end:
        segments += _close("response")
        if calls:
            segments += _open("tools")
            for index, call in enumerate(calls, start=1):
                segments += _open("call", [("tool", call.name), ("index", index)])
                if call.raw is not None:
                    segments += _open("json", [("type", "object")]) + _text(call.raw) + _close("json")
                else:
                    for key, value in call.arguments.items():
                        try:
                            kind = argument_type(value)
                        except TypeError as error:
                            raise KimiK3ChatError(f"{where}: tool_calls[{index - 1}] argument {key!r:.40}: "
                                                  f"{error}") from None
                        segments += _open("argument", [("key", key), ("type", kind)])
                        segments += _text(_argument_text(value)) + _close("argument")
                segments += _close("call")
            segments += _close("tools")
        segments += _message_end()
    generated.extend(range(start, len(segments)))


def _declare_tools(tools: Any, dynamic: bool) -> list[Segment]:
    spec = _sorted_json(tools)
    if dynamic:
        body = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
                f"```json\n{spec}\n```")
    else:
        body = f"# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{spec}\n```"
    return _system_note("tool-declare", body)


def render_kimi_k3_chat(messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None, *,
                        add_generation_prompt: bool = False, continue_final_message: bool = False,
                        thinking: bool | None = None, thinking_effort: str | None = None,
                        tool_choice: Any = None, response_format: Any = None,
                        image_prompts: Sequence[str] | None = None, enable_thinking: bool | None = None,
                        reasoning_effort: str | None = None) -> KimiK3Prompt:
    """Render a conversation in K3's format.

    ``messages``: OpenAI / transformers chat messages (roles ``system``, ``developer``, ``user``, ``assistant``,
    ``tool``; content a string or a list of ``text`` / ``image`` / ``video`` parts; assistant ``reasoning_content``
    and ``tool_calls``; tool ``tool_call_id``). ``tools``: JSON-schema function declarations. ``thinking`` (default
    **on**, as K3 is trained): the generation prompt opens the think channel and past assistant turns carry their
    think block; ``thinking=False`` opens the response channel instead. ``thinking_effort``: ``low`` / ``high`` /
    ``max`` or None (no effort message). ``tool_choice``: ``"required"`` / ``"none"`` add a system note, anything
    else nothing. ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"schema": ...}}``. ``image_prompts``: the control text to put at each image part (the processor passes the
    expanded media spans); by default each image part is ``<|kimi_image_placeholder|>``.

    Returns a `KimiK3Prompt`; raises `KimiK3ChatError` for what K3's format cannot express."""
    thinking, thinking_effort = resolve_thinking(thinking, enable_thinking, thinking_effort, reasoning_effort)
    if add_generation_prompt and continue_final_message:
        raise KimiK3ChatError("add_generation_prompt and continue_final_message exclude each other: pass one")
    if not isinstance(messages, (list, tuple)):
        raise KimiK3ChatError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise KimiK3ChatError(f"messages[{i}] must be a dict with a 'role', got {message!r:.80}")
        calls = message.get("tool_calls")
        if calls is not None and not isinstance(calls, (list, tuple)):
            raise KimiK3ChatError(f"messages[{i}]: tool_calls must be a list, got {type(calls).__name__}")
    if continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
        raise KimiK3ChatError("continue_final_message needs the conversation to end with an assistant message")
    messages = order_tool_results(messages)
    media = _Media(image_prompts)
    segments: list[Segment] = []
    generated: list[int] = []
    if tools:
        segments += _declare_tools(tools, dynamic=False)
    if thinking and thinking_effort:
        segments += _system_note("thinking-effort", _THINKING_EFFORT_BODY.format(effort=thinking_effort))

    previous_calls: list[_Call] = []
    tool_index = 0
    for i, message in enumerate(messages):
        where = f"messages[{i}] ({message['role']})"
        role = "system" if message["role"] == "developer" else message["role"]
        if role == "system" and message.get("tools"):
            segments += _declare_tools(message["tools"], dynamic=True)
        elif role in ("system", "user"):
            attributes = [("role", role)] + ([("name", _string(message["name"], f"{where}: name"))]
                                             if message.get("name") else [])
            segments += _open("message", attributes)
            segments += _content(message.get("content"), media, where)
            segments += _message_end()
        elif role == "assistant":
            previous_calls, tool_index = _calls(message, where), 0
            last = continue_final_message and i == len(messages) - 1
            _assistant(message, media, thinking, where, generated, segments, open_end=last)
        elif role == "tool":
            tool_index += 1
            name = message.get("tool", message.get("name"))
            if name is not None:
                _string(name, f"{where}: the tool name")
            if name is None and tool_index <= len(previous_calls):
                name = previous_calls[tool_index - 1].name
            if name is None:
                raise KimiK3ChatError(f"{where}: a tool result needs the tool's name: give it a 'tool_call_id' of "
                                      "the assistant's call, a 'name', or put results in the calls' order")
            segments += _open("message", [("role", "tool"), ("tool", name), ("index", tool_index)])
            segments += _content(message.get("content"), media, where)
            segments += _message_end()
        else:
            raise KimiK3ChatError(f"{where}: K3 has no role {message['role']!r}; use system, developer, user, "
                                  "assistant or tool")

    format_type, schema = _response_format(response_format)
    if continue_final_message and (tool_choice in ("required", "none") or format_type in ("json_object",
                                                                                          "json_schema")):
        raise KimiK3ChatError("tool_choice / response_format notes come before the answer; they cannot follow an "
                              "assistant message left open by continue_final_message")
    if isinstance(tool_choice, str) and tool_choice in _TOOL_CHOICE_BODY:
        segments += _system_note("tool-choice", _TOOL_CHOICE_BODY[tool_choice])
    if format_type == "json_object":
        segments += _system_note("response-format", f"The system is invoked with `response_format=json_object`.\n"
                                                    f"{_JSON_ONLY}")
    elif format_type == "json_schema":
        schema = _sorted_json(schema)
        segments += _system_note("response-format", f"The system is invoked with `response_format=json_schema`.\n"
                                                    f"{_JSON_ONLY}\nThe JSON data must match the following schema:\n"
                                                    f"```json\n{schema}\n```")
    if add_generation_prompt:
        segments += _open("message", [("role", "assistant")]) + _open("think" if thinking else "response")
    media.check_used()
    _check_encodable(segments)
    return KimiK3Prompt(segments, generated, media.parts)


def _check_encodable(segments: list[Segment]) -> None:
    """Text with a lone surrogate (e.g. from JSON's \\ud800) has no UTF-8 form: no tokenizer can take it."""
    for segment in segments:
        try:
            segment.text.encode("utf-8")
        except UnicodeEncodeError as error:
            before = segment.text[max(0, error.start - 30):error.start]
            raise KimiK3ChatError(
                f"the conversation holds a lone surrogate {segment.text[error.start]!r} (after {before!r}), which is "
                "not valid Unicode text and cannot be tokenized: remove it, or decode the input with "
                "errors='replace'") from None


__all__ = [
    "IMAGE_PLACEHOLDER",
    "KimiK3ChatError",
    "KimiK3Prompt",
    "Segment",
    "THINKING_EFFORTS",
    "VIDEO_PLACEHOLDER",
    "argument_type",
    "order_tool_results",
    "render_kimi_k3_chat",
    "resolve_thinking",
]
