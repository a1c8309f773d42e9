"""The Jinja chat template (`assets/chat_template/kimi_k3.jinja`) renders the same prompt string as K3's Python
renderer `render_kimi_k3_chat`, in transformers' own Jinja environment (`render_jinja_template`).

1. against the independent corpus `data/k3_chat_corpus.json` (the release's reference encoder's output);
2. against `render_kimi_k3_chat` on conversations written here (multi-turn, tools, results out of order,
   continue_final_message, developer, video, error cases).
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

from transformers_k3.encoding_kimi_k3 import KimiK3ChatError, render_kimi_k3_chat

TEMPLATE_PATH = (Path(__file__).resolve().parents[1] / "src" / "transformers_k3" / "assets" / "chat_template"
                 / "kimi_k3.jinja")
TEMPLATE = TEMPLATE_PATH.read_text(encoding="utf-8")
CORPUS_PATH = Path(__file__).with_name("data") / "k3_chat_corpus.json"
LIMITATION = "cannot parse JSON"  # the template's message for tool-call arguments given as a JSON string


# ------------------------------------------------------------------------------------------------- helpers
def jinja(messages, tools=None, *, add_generation_prompt=False, continue_final_message=False, **kwargs) -> str:
    """Render the template the way transformers' apply_chat_template does (continue_final_message included)."""
    rendered, _ = render_jinja_template([copy.deepcopy(messages)], tools=copy.deepcopy(tools), chat_template=TEMPLATE,
                                        add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, **copy.deepcopy(kwargs))
    return rendered[0]


def jinja_direct(messages, **variables) -> str:
    """Render the compiled template with every variable passed straight in (as engines that pass
    continue_final_message to the template do)."""
    return _compile_jinja_template(TEMPLATE).render(messages=copy.deepcopy(messages), **copy.deepcopy(variables))


def python(messages, tools=None, **kwargs) -> str:
    return str(render_kimi_k3_chat(copy.deepcopy(messages), copy.deepcopy(tools), **copy.deepcopy(kwargs)))


def assert_same(messages, tools=None, **kwargs):
    expected = python(messages, tools, **kwargs)
    assert jinja(messages, tools, **kwargs) == expected
    return expected


def assert_both_raise(messages, tools=None, match=None, **kwargs):
    with pytest.raises(KimiK3ChatError):
        python(messages, tools, **kwargs)
    with pytest.raises(jinja2.exceptions.TemplateError, match=match):
        jinja(messages, tools, **kwargs)


def has_string_arguments(messages) -> bool:
    for message in messages:
        for call in (message.get("tool_calls") or []) if isinstance(message, dict) else []:
            function = call.get("function", call) if isinstance(call, dict) else {}
            if isinstance(function, dict) and isinstance(function.get("arguments"), str) \
                    and function["arguments"].strip():
                return True
    return False


def user(content, **extra):
    return {"role": "user", "content": content, **extra}


def system(content, **extra):
    return {"role": "system", "content": content, **extra}


def assistant(content=None, **extra):
    return {"role": "assistant", "content": content, **extra}


def call(name, arguments, call_id=None, flat=False):
    function = {"name": name, "arguments": arguments}
    out = function if flat else {"type": "function", "function": function}
    if call_id is not None:
        out["id"] = call_id
    return out


def tool(content, **extra):
    return {"role": "tool", "content": content, **extra}


# ------------------------------------------------------------------------------------------------- 1. corpus
def _corpus_cases(kind=None):
    """The corpus cases without image_prompts; kind "render" / "error": only those with expected_text /
    expected_error."""
    if not CORPUS_PATH.exists():
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"{CORPUS_PATH} is not there"), id="no-corpus")]
    cases = json.loads(CORPUS_PATH.read_text(encoding="utf-8"))["cases"]
    key = {"render": "expected_text", "error": "expected_error"}.get(kind)
    return [pytest.param(case, id=case["name"]) for case in cases
            if "image_prompts" not in case and (key is None or key in case)]


def _corpus_kwargs(case):
    kwargs = dict(case["kwargs"])
    kwargs.setdefault("add_generation_prompt", True)  # the reference encoder's default
    tools = kwargs.pop("tools", None)
    return tools, kwargs


def _has_developer(case):
    return any(isinstance(m, dict) and m.get("role") == "developer" for m in case["messages"])


@pytest.mark.parametrize("case", _corpus_cases("render"))
def test_corpus_matches_reference_encoder(case):
    """Every rendering case of the reference corpus (no image_prompts; no developer role, which the reference
    skips and K3's serving layer renders as system) gives the reference's text. Tool-call arguments given as a JSON
    string may instead raise the template's documented limitation, never render something else."""
    if _has_developer(case):
        pytest.skip("developer messages: the reference skips them, K3 renders them as system "
                    "(test_corpus_matches_python)")
    text = _jinja_or_limitation(case)
    if text is not None:
        assert text == case["expected_text"]


def _jinja_or_limitation(case):
    """The template's rendering of a corpus case, or None where it raised its documented limitation (tool-call
    arguments given as a JSON string); any other template error fails the test."""
    tools, kwargs = _corpus_kwargs(case)
    try:
        return jinja(case["messages"], tools, **kwargs)
    except jinja2.exceptions.TemplateError as error:
        assert LIMITATION in str(error) and has_string_arguments(case["messages"]), error
        return None


def _python_or_both_raise(case, jinja_too=True):
    """The Python rendering of a corpus case; if it raises, the template must raise too (then None). With
    ``jinja_too`` the template's rendering must also equal it."""
    tools, kwargs = _corpus_kwargs(case)
    try:
        expected = python(case["messages"], tools, **kwargs)
    except KimiK3ChatError:
        with pytest.raises(jinja2.exceptions.TemplateError):
            jinja(case["messages"], tools, **kwargs)
        return None
    if jinja_too:
        assert jinja(case["messages"], tools, **kwargs) == expected
    return expected


@pytest.mark.parametrize("case", _corpus_cases("error"))
def test_corpus_errors(case):
    """The reference's error cases raise in the template too, where the Python renderer raises (it renders video
    parts, which the reference cannot)."""
    _python_or_both_raise(case)


@pytest.mark.parametrize("case", _corpus_cases())
def test_corpus_matches_python(case):
    """Every corpus conversation without image_prompts, developer ones included: the template and the Python renderer
    give the same string (or both raise)."""
    expected = _python_or_both_raise(case, jinja_too=False)
    if expected is None:
        return
    text = _jinja_or_limitation(case)
    if text is not None:
        assert text == expected


def test_corpus_coverage():
    """The corpus comparison is not vacuous: most of its rendering cases are compared exactly."""
    if not CORPUS_PATH.exists():
        pytest.skip(f"{CORPUS_PATH} is not there")
    compared = 0
    for param in _corpus_cases("render"):
        case = param.values[0]
        if not _has_developer(case):
            tools, kwargs = _corpus_kwargs(case)
            try:
                compared += jinja(case["messages"], tools, **kwargs) == case["expected_text"]
            except jinja2.exceptions.TemplateError:
                pass
    assert compared >= 70


# ------------------------------------------------------------------------------------------------- 2. vs Python
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "天气 ☀️ \"quoted\" & more",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City"}, "Zone": {"type": "string"},
        "days": {"type": "integer", "minimum": 1}, "a": {"type": "object", "properties": {"z": {}, "B": {}}}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "q": {"type": "string"}}}}}
ALL_TYPES = {"s": "Paris \"centre\" & <b>x</b>", "empty": "", "i": 3, "f": 0.5, "neg": -1e-7, "t": True, "fa": False,
             "n": None, "o": {"b": [1, {"y": None, "x": "é"}], "a": "ü"}, "l": [1, "two", [3.0], {}], "big": 10**20,
             "k&\"ey": "v"}

CONVERSATIONS = {
    "multi_turn_reasoning": ([
        system("You are Kimi."), user("Hi"), assistant("Hello!", reasoning_content="greet"),
        user("2+2?"), assistant("4", reasoning="  add  "), user("and 3+3?")], None, {"add_generation_prompt": True}),
    "whitespace_and_missing_reasoning": ([
        user("a"), assistant("b", reasoning_content=" \n "), user("c"), assistant("d"),
        user("e"), assistant("f", reasoning_content="", reasoning="fallback")], None, {}),
    "names_and_escapes": ([
        system("s", name='A & "B" &amp;'), user("u", name="x"), user("v", name=""),
        assistant("w", name="dropped")], None, {"add_generation_prompt": True}),
    "tools_and_all_argument_types": ([
        user("weather?"),
        assistant("", reasoning_content="call it", tool_calls=[call("get_weather", ALL_TYPES, "c1"),
                                                                call("search", {}, "c2"),
                                                                call("search", None, "c3"),
                                                                call("flat", {"q": "x"}, "c4", flat=True)]),
        tool("sunny", tool_call_id="c1"), tool("found", tool_call_id="c2"), tool("none", tool_call_id="c3"),
        tool([{"type": "text", "text": "flat "}, {"type": "text", "text": "result"}], tool_call_id="c4"),
        assistant("Done.")], [WEATHER, SEARCH], {"add_generation_prompt": True}),
    "results_out_of_order": ([
        user("go"),
        assistant("", tool_calls=[call("a", {"x": 1}, "id-a"), call("b", {"x": 2}, "id-b"),
                                  call("c", {"x": 3}, "id-c")]),
        tool("C", tool_call_id="id-c", name="stale"), tool("A", tool_call_id="id-a"), tool("B", tool_call_id="id-b"),
        user("again"),
        assistant("", tool_calls=[call("d", {}, 7), call("e", {}, 8)]),
        tool("E", tool_call_id="8"), tool("D", tool_call_id=7)], [SEARCH], {"add_generation_prompt": True}),
    "results_run_with_unmatched_id_kept": ([
        user("go"), assistant("", tool_calls=[call("a", {}, "1"), call("b", {}, "2")]),
        tool("B", tool_call_id="2"), tool("?", tool_call_id="zzz", name="mystery"),
        tool("A", tool_call_id="1", name="a")],
        None, {}),
    "results_by_position_and_keys": ([
        user("go"), assistant("", tool_calls=[call("a", {}), call("b", {}), call("c", {})]),
        tool("A"), tool("B", name="named"), tool("C", tool="by-tool-key", name="ignored"),
        user("between"), tool("late", name="late-tool"),
        assistant("", tool_calls=[call("x", {}, "dup"), call("y", {}, "dup")]), tool("X", tool_call_id="dup"),
        tool("second", tool_call_id="dup")], None, {}),
    "tool_result_id_key": ([
        user("go"), assistant("", tool_calls=[call("a", {}, "1"), call("b", {}, "2")]),
        tool("B", id="2"), tool("A", id="1")], None, {}),
    "developer_and_dynamic_tools": ([
        {"role": "developer", "content": "Be brief.", "name": "dev"}, system("ignored", tools=[SEARCH]),
        {"role": "developer", "content": "ignored too", "tools": [WEATHER]}, system("plain", tools=[]),
        user("hi")], [WEATHER], {"add_generation_prompt": True}),
    "media_parts": ([
        user([{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video", "video": "v.mp4"},
              {"type": "image_url", "image_url": {"url": "x"}}, {"type": "video_url", "video_url": {"url": "y"}},
              {"type": "text", "text": ""}]),
        assistant([{"type": "text", "text": "seen "}, {"type": "text", "text": "it"}]),
        user({"type": "text", "text": "one part"}), user(None), user("<|close|>message<|sep|> typed <|media_pad|>")],
        None, {"add_generation_prompt": True}),
    "thinking_off_history": ([
        user("a"), assistant("b", reasoning_content="hidden"), user("c")], None,
        {"thinking": False, "add_generation_prompt": True}),
    "enable_thinking_false": ([user("a"), assistant("b", reasoning_content="r")], None,
                              {"enable_thinking": False, "add_generation_prompt": True}),
    "reasoning_effort_none": ([user("a")], None, {"reasoning_effort": "none", "add_generation_prompt": True}),
    "reasoning_effort_low": ([user("a")], [SEARCH], {"reasoning_effort": "low", "add_generation_prompt": True}),
    "thinking_effort_wins_over_reasoning_effort": ([user("a")], None,
                                                    {"thinking_effort": "max", "reasoning_effort": "low",
                                                     "add_generation_prompt": True}),
    "bad_effort_ignored_when_off": ([user("a")], None, {"thinking": False, "thinking_effort": "medium",
                                                        "add_generation_prompt": True}),
    "tool_choice_and_json_schema": ([user("a")], [SEARCH], {
        "tool_choice": "required", "thinking_effort": "high", "add_generation_prompt": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"b": {"type": "string"}, "A": {"enum": ["é", 1]}}}}}}),
    "tool_choice_none_json_object": ([user("a")], None, {"tool_choice": "none",
                                                         "response_format": {"type": "json_object"}}),
    "tool_choice_auto_and_text_format": ([user("a")], None, {"tool_choice": "auto",
                                                             "response_format": {"type": "text"}}),
    "json_schema_fallbacks": ([user("a")], None, {"response_format": {"type": "json_schema", "json_schema": {
        "json_schema": {"z": 1, "a": 2}}}}),
    "json_schema_itself": ([user("a")], None, {"response_format": {"type": "json_schema",
                                                                   "json_schema": {"type": "object", "b": 1}}}),
    "response_format_string": ([user("a")], None, {"response_format": "json_object"}),
    "empty_conversation": ([], None, {"add_generation_prompt": True}),
    "non_ascii": ([system("系统"), user("Grüße 👋"), assistant("こんにちは", reasoning_content="думаю")],
                  [WEATHER], {"add_generation_prompt": True}),
    "raw_argument_strings": ([
        user("go"), assistant("", tool_calls=[
            call("a", "get the weather"), call("b", "{city: Paris}"), call("c", "find me"), call("d", "   "),
            call("e", "{}"), call("f", " { \n } "), call("g", "nullish"), call("h", "{ 'x': 1 }"),
            call("i", "\ufeff{\"a\": 1}"), call("j", "Infinity and beyond"), call("k", "{")])],
        None, {}),
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_matches_python(name):
    messages, tools, kwargs = CONVERSATIONS[name]
    assert_same(messages, tools, **kwargs)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_does_not_depend_on_trim_and_lstrip_blocks(name):
    """Every tag trims its own whitespace: a plain sandboxed environment (no trim_blocks / lstrip_blocks), as other
    engines set up, renders the same."""
    messages, tools, kwargs = CONVERSATIONS[name]
    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    text = env.from_string(TEMPLATE).render(messages=copy.deepcopy(messages), tools=copy.deepcopy(tools),
                                             **copy.deepcopy(kwargs))
    assert text == python(messages, tools, **kwargs)


def test_thinking_defaults_on_when_none():
    messages = [user("a"), assistant("b", reasoning_content="r"), user("c")]
    expected = assert_same(messages, thinking=None, add_generation_prompt=True)
    assert expected.endswith("<|open|>think<|sep|>")
    assert jinja(messages, thinking=True, enable_thinking=True, add_generation_prompt=True) == expected


def test_tool_results_reordered_names_and_indices():
    """The hardest part in Jinja, spelled out: results in the calls' order, names from the matched calls, index by
    position in the run."""
    messages = CONVERSATIONS["results_out_of_order"][0]
    text = assert_same(messages, add_generation_prompt=True)
    assert text.index('tool="a" index="1"<|sep|>A') < text.index('tool="b" index="2"<|sep|>B') \
        < text.index('tool="c" index="3"<|sep|>C')
    assert text.index('tool="d" index="1"<|sep|>D') < text.index('tool="e" index="2"<|sep|>E')
    assert "stale" not in text


def _random_conversation(rng: random.Random):
    """A random agent conversation: assistants with calls (ids or not, duplicated, flat or nested), runs of results
    shuffled, with ids that match, ids that don't, name / tool keys, users in between, random argument values."""
    def value(depth=0):
        kinds = ["str", "int", "float", "bool", "none"] + (["list", "dict"] if depth < 2 else [])
        kind = rng.choice(kinds)
        if kind == "str":
            return rng.choice(["", "x", 'q"&<', "é 👋", "1", "true", "{}"])
        if kind == "int":
            return rng.randint(-5, 10**12)
        if kind == "float":
            return rng.choice([0.5, -2.25, 1e-9, 3.0])
        if kind == "bool":
            return rng.random() < 0.5
        if kind == "none":
            return None
        if kind == "list":
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(["b", "A", "z", "é", "k k"]): value(depth + 1) for _ in range(rng.randint(0, 3))}

    messages = [user("start")]
    for _ in range(rng.randint(1, 4)):
        calls = []
        for position in range(rng.randint(0, 4)):
            call_id = rng.choice([None, f"id{position}", f"id{position}", "dup", position])
            arguments = {rng.choice(["city", "q", "n", "Key", "a&b"]) + str(i): value()
                         for i in range(rng.randint(0, 3))}
            calls.append(call(rng.choice(["f", "g", "h&\"i"]), arguments, call_id, flat=rng.random() < 0.2))
        messages.append(assistant(rng.choice(["", "ok", None]), reasoning_content=rng.choice([None, "", "r", " "]),
                                  tool_calls=calls))
        results = []
        for position, c in enumerate(calls):
            result = tool(f"result {position}")
            pick = rng.random()
            if pick < 0.6 and "id" in c:
                result["tool_call_id"] = c["id"] if rng.random() < 0.8 else str(c["id"])
            elif pick < 0.7:
                result["tool_call_id"] = "nope"
            if rng.random() < 0.3:
                result["name"] = "named"
            if rng.random() < 0.1:
                result["tool"] = "tooled"
            results.append(result)
        if rng.random() < 0.1:
            results.append(tool("extra result: no name unless a call is left at its position"))
        rng.shuffle(results)
        if results and rng.random() < 0.2:
            results.insert(rng.randrange(len(results) + 1), user("interjection"))
        messages.extend(results)
        if rng.random() < 0.5:
            messages.append(user("next"))
    return messages


def test_random_agent_conversations_match_python():
    rng = random.Random(1234)
    compared = raised = 0
    for _ in range(300):
        messages = _random_conversation(rng)
        kwargs = {"thinking": rng.random() < 0.7, "add_generation_prompt": rng.random() < 0.5}
        try:
            expected = python(messages, [SEARCH], **kwargs)
        except KimiK3ChatError:
            with pytest.raises(jinja2.exceptions.TemplateError):
                jinja(messages, [SEARCH], **kwargs)
            raised += 1
            continue
        assert jinja(messages, [SEARCH], **kwargs) == expected, messages
        compared += 1
    assert compared > 150 and raised > 10


# ------------------------------------------------------------------------------------------- continue_final_message
CONTINUATIONS = {
    "text": [user("Hi"), assistant("Hel", reasoning_content="greet")],
    "text_no_reasoning": [user("Hi"), assistant("Hel")],
    "parts_with_media_after_text": [user("Hi"), assistant([{"type": "text", "text": "Look: "}, {"type": "image"},
                                                          {"type": "video"}])],
    "empty_content_continues_reasoning": [user("Hi"), assistant("", reasoning_content="let me")],
    "empty_content_no_reasoning": [user("Hi"), assistant("")],
    "whitespace_content": [user("Hi"), assistant("  ", reasoning_content="r")],
    "after_tools": [user("go"), assistant("", tool_calls=[call("a", {"x": 1}, "1")]), tool("ok", tool_call_id="1"),
                    assistant("The result is", reasoning_content="read it")],
}


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("name", sorted(CONTINUATIONS))
def test_continue_final_message_through_transformers(name, thinking):
    """transformers does not pass continue_final_message to the template: it tags the final message and cuts the
    output there. The template writes the open message (as `_assistant(open_end=True)`) and the tag at the end."""
    messages = CONTINUATIONS[name]
    expected = assert_same(messages, continue_final_message=True, thinking=thinking)
    assert "CONTINUE_FINAL_MESSAGE_TAG" not in expected
    assert jinja_direct(messages, continue_final_message=True, thinking=thinking) == expected


def test_continue_final_message_refuses_notes_after_the_open_answer():
    """tool_choice / response_format notes precede the answer, so an answer left open cannot be followed by them:
    both renderers refuse."""
    messages = CONTINUATIONS["text"]
    for kwargs in ({"tool_choice": "required"}, {"response_format": {"type": "json_object"}}):
        assert_both_raise(messages, [SEARCH], match="cannot follow an assistant message", continue_final_message=True,
                          **kwargs)


def test_continue_reasoning_field():
    """continue_final_message="reasoning_content" (transformers tags the reasoning): the think channel stays open,
    as the Python renderer leaves it when the message has no content."""
    messages = [user("Hi"), assistant("", reasoning_content="let me ")]
    expected = python(messages, continue_final_message=True)
    assert expected.endswith("<|open|>think<|sep|>let me ")
    assert jinja(messages, continue_final_message="reasoning_content") == expected
    with pytest.raises(jinja2.exceptions.TemplateError, match="needs thinking on"):
        jinja(messages, continue_final_message="reasoning_content", thinking=False)


def test_continue_final_message_errors():
    assert_both_raise([user("go"), assistant("", tool_calls=[call("a", {})])], continue_final_message=True,
                      match="tool_calls")
    assert_both_raise([user("Hi"), assistant("x"), user("more")], continue_final_message=True,
                      match="end with an assistant message")
    with pytest.raises(KimiK3ChatError):
        python([user("Hi"), assistant("x")], continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(jinja2.exceptions.TemplateError, match="exclude each other"):
        jinja_direct([user("Hi"), assistant("x")], continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(jinja2.exceptions.TemplateError, match="exclude each other"):
        jinja([user("Hi"), assistant("x")], continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(jinja2.exceptions.TemplateError, match="end with an assistant message"):
        jinja_direct([], continue_final_message=True)


# ------------------------------------------------------------------------------------------------- errors
def test_errors_match_python():
    assert_both_raise([user("a")], thinking_effort="medium", match="thinking_effort='?medium")
    assert python([user("a")], reasoning_effort="minimal") == jinja([user("a")], reasoning_effort="minimal") == \
        python([user("a")])  # OpenAI's other efforts: no effort note (the Python renderer warns)
    for value in ("false", 0, 1):
        assert_both_raise([user("a")], thinking=value, match="must be True, False or None")
    assert_both_raise([user([{"type": "text"}])], match="must be a string")
    assert_both_raise([user("a")], response_format={"type": "json_schema"}, match="needs a json_schema")
    assert_both_raise([user("a")], response_format={"type": "json"}, match="is not one K3 knows")
    assert_both_raise([user("a")], thinking=True, enable_thinking=False, match="disagree")
    assert_both_raise([{"role": "robot", "content": "beep"}], match="no role robot")
    assert_both_raise([{"content": "no role"}], match="must be a dict with a 'role'")
    with pytest.raises(KimiK3ChatError):  # transformers itself refuses non-dict messages before the template
        python(["not a dict"])
    with pytest.raises(jinja2.exceptions.TemplateError, match="must be a dict with a 'role'"):
        jinja_direct(["not a dict"])
    assert_both_raise([user([{"type": "audio"}])], match="unsupported content part")
    assert_both_raise([user([{"type": "image"}, "bare string part"])], match="unsupported content part")
    assert_both_raise([user(5)], match="content must be a string or a list of parts")
    assert_both_raise([user("a"), tool("orphan")], match="needs the tool's name")
    assert_both_raise([user("a"), assistant("", tool_calls=[call("a", {})]), tool("1"), tool("2")],
                      match="needs the tool's name")
    assert_both_raise([user("a"), assistant("", tool_calls={"not": "a list"})], match="must be a list")
    assert_both_raise([user("a"), assistant("", tool_calls=["x"])], match="must be a dict")
    assert_both_raise([user("a"), assistant("", tool_calls=[{"function": {"arguments": {}}}])],
                      match="no function name")
    assert_both_raise([user("a"), assistant("", tool_calls=[call("f", ["a"])])], match="must be a dict or a JSON")
    assert_both_raise([user("a"), assistant("", tool_calls=[call("f", 42)])], match="must be a dict or a JSON")


@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', ' {"a": 1} ', "[1, 2]", "42", "-1", '"text"', "true",
                                       "null ", "NaN", "{ \"unterminated"])
def test_json_string_arguments_raise_limitation(arguments):
    """A tool call's arguments as a string that may be JSON: Jinja cannot parse it, so the template raises and says
    to pass a dict; the same arguments as a dict render as the Python renderer renders the string."""
    messages = [user("go"), assistant("", tool_calls=[call("f", arguments)])]
    with pytest.raises(jinja2.exceptions.TemplateError, match=LIMITATION):
        jinja(messages)
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return
    if isinstance(parsed, dict):
        dict_messages = [user("go"), assistant("", tool_calls=[call("f", parsed)])]
        assert jinja(dict_messages) == python(messages) == python(dict_messages)


def test_template_is_the_packaged_file():
    from transformers_k3 import tokenization_kimi_k3

    assert tokenization_kimi_k3.KIMI_K3_CHAT_TEMPLATE == TEMPLATE


def test_plain_apply_chat_template_of_a_tokenizer():
    """What a tool that only reads `chat_template` does: transformers' own apply_chat_template (the base class's,
    not K3's Python override), which also drops None-valued keys and handles continue_final_message."""
    from transformers import TokenizersBackend

    from transformers_k3 import build_test_tokenizer

    tokenizer = build_test_tokenizer()
    tokenizer.chat_template = TEMPLATE
    messages, tools, _ = CONVERSATIONS["tools_and_all_argument_types"]
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    text = TokenizersBackend.apply_chat_template(tokenizer, messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=True, thinking_effort="high")
    assert text == python(messages, tools, add_generation_prompt=True, thinking_effort="high")
    messages = CONTINUATIONS["text"]
    text = TokenizersBackend.apply_chat_template(tokenizer, messages, tokenize=False, continue_final_message=True,
                                                 thinking=False)
    assert text == python(messages, continue_final_message=True, thinking=False)
