"""``python -m transformers_k3 serve`` (transformers' own server with K3 plugged in), talked to with the real
``openai`` client on a loopback port: chat completions and the Responses API, streaming, reasoning on and off, a
tool call round trip, an image as a data URL, concurrent clients. Greedy answers are checked against transformers'
``pipeline()`` on the same checkpoint and messages.

One in-process server for the module, on an ephemeral loopback port, serving the shipped small K3 and a copy of it
whose output head is fitted here to answer one weather question with a tool call and the tool's result with one
sentence, so the tool path is deterministic."""

import base64
import io
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
if not hasattr(pytest.importorskip("transformers.cli.serving.model_manager"), "EngineClient"):
    pytest.skip("serve plugs into the server of transformers >= 5.25", allow_module_level=True)

from transformers_k3.small import SMALL_DIR  # noqa: E402

pytestmark = pytest.mark.skipif(not (SMALL_DIR / "model.safetensors").exists(), reason="small checkpoint not shipped")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTION = "What is the weather in Paris?"
REASONING = "I should ask the weather tool."
RESULT = '{"temp_c": 21}'
FINAL = "It is 21 C in Paris."
CODE = [{"role": "user", "content": "Write a Python function: add"}]


def _server_inputs(messages):
    """The processor's messages the server builds from OpenAI messages for a vision-language model."""
    from transformers.cli.serving.utils import BaseHandler, Modality

    return BaseHandler.get_processor_inputs_from_messages(messages, Modality.VLM)


def _ids(processor, messages, **kwargs):
    return processor.apply_chat_template(_server_inputs(messages), tools=[WEATHER], tokenize=True, return_dict=True,
                                         return_tensors="pt", **kwargs)["input_ids"][0]


def _tune(out_dir: Path) -> None:
    """Fine-tune the small K3 until greedy decoding answers the two tool turns exactly, then save it."""
    import torch

    from transformers_k3 import load_small

    torch.manual_seed(0)
    model, processor = load_small()
    tokenizer = processor.tokenizer
    end = tokenizer.convert_tokens_to_ids("<|end_of_msg|>")
    user = [{"role": "user", "content": QUESTION}]
    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    tool = {"role": "tool", "tool_call_id": "call_0", "content": RESULT}
    examples = []
    # turn 1: the server's prompt, and the call with reasoning as the model should write it
    prompt = _ids(processor, user, add_generation_prompt=True)
    written = processor.apply_chat_template(user + [{**turn, "reasoning_content": REASONING}], tools=[WEATHER],
                                            tokenize=True, return_dict=True, return_tensors="pt")["input_ids"][0]
    assert written[:len(prompt)].tolist() == prompt.tolist()
    examples.append((prompt, written[len(prompt):]))
    # turn 2: the history as the client sends it back (no reasoning), and a one-sentence answer
    prompt = _ids(processor, user + [turn, tool], add_generation_prompt=True)
    written = processor.apply_chat_template(
        _server_inputs(user + [turn, tool]) + [{"role": "assistant", "content": FINAL, "reasoning_content": ""}],
        tools=[WEATHER], tokenize=True, return_dict=True, return_tensors="pt")["input_ids"][0]
    assert written[:len(prompt)].tolist() == prompt.tolist()
    examples.append((prompt, written[len(prompt):]))
    for prompt, target in examples:
        assert target.tolist().count(end) == 1 and int(target[-1]) == end, tokenizer.decode(target)
    model.generation_config.repetition_penalty = 1.0  # memorised answers repeat the format's markers
    # Only the output head learns (the rest is frozen): on the model's own features of the two sequences it is a
    # linear classifier, fitted in seconds; greedy decoding then writes the answers.
    text = model.language_model
    with torch.no_grad():
        features = [text.model(input_ids=torch.cat([prompt, target])[None]).last_hidden_state[0, len(prompt) - 1:-1]
                    for prompt, target in examples]
    features, targets = torch.cat(features), torch.cat([target for _, target in examples])
    head = text.lm_head.weight.detach().clone().requires_grad_(True)
    optimizer = torch.optim.Adam([head], lr=0.05)
    for step in range(500):
        logits = features @ head.T * text.config.logit_scale
        if bool((logits.argmax(-1) == targets).all()) and step >= 50:
            break
        loss = torch.nn.functional.cross_entropy(logits, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        text.lm_head.weight.copy_(head)
        done = all(model.generate(prompt[None], max_new_tokens=len(target) + 2, do_sample=False)[0, len(prompt):]
                   .tolist() == target.tolist() for prompt, target in examples)
    assert done, f"the tool answers were not learned in {step + 1} steps (loss {loss.item():.3g})"
    model.eval().save_pretrained(out_dir)
    processor.save_pretrained(out_dir)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server for the module, not pinned to a model: requests name the shipped small model or the tool-tuned
    copy (each loads in a process of its own on its first request)."""
    import threading

    import uvicorn

    from transformers_k3.serving import build_app

    tuned = tmp_path_factory.mktemp("k3_tools")
    _tune(tuned)
    app, manager = build_app(None, log_level="warning")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="k3-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        port = server.servers[0].sockets[0].getsockname()[1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300, max_retries=0)
        yield client, str(SMALL_DIR), str(tuned)
    finally:
        server.should_exit = True
        thread.join(60)
        manager.shutdown()


@pytest.fixture(scope="module")
def pipe():
    from transformers import pipeline

    return pipeline("text-generation", model=str(SMALL_DIR))


def _pipeline_answer(pipe, messages, max_new_tokens, **encode):
    out = pipe(messages, max_new_tokens=max_new_tokens, tokenizer_encode_kwargs=encode or None)
    return out[0]["generated_text"][-1]


def _chat(client, model, messages, max_tokens=24, **kwargs):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                          **kwargs).choices[0].message


def _streamed(client, model, messages, max_tokens=24, **kwargs):
    content, reasoning, chunks = "", "", 0
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, **kwargs):
        chunks += 1
        if chunk.choices:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
    return content, reasoning, chunks


def test_chat_completion_and_stream_equal_the_pipeline(served, pipe):
    client, model, _ = served
    expected = _pipeline_answer(pipe, CODE, 24)
    assert expected["reasoning_content"]  # thinking is K3's default: the answer starts in the think channel
    message = _chat(client, model, CODE)
    assert (message.content or "", message.reasoning_content) == (expected.get("content") or "",
                                                                  expected["reasoning_content"])
    content, reasoning, chunks = _streamed(client, model, CODE)
    assert (content, reasoning) == (expected.get("content") or "", expected["reasoning_content"]) and chunks > 3


def test_reasoning_off_and_effort(served, pipe):
    client, model, _ = served
    off = _chat(client, model, CODE, reasoning_effort="none")
    expected = _pipeline_answer(pipe, CODE, 24, thinking=False)
    assert getattr(off, "reasoning_content", None) is None and "reasoning_content" not in expected
    assert off.content == expected["content"] and off.content
    high = _chat(client, model, CODE, reasoning_effort="high")
    expected = _pipeline_answer(pipe, CODE, 24, thinking_effort="high")
    assert (high.content or "", high.reasoning_content) == (expected.get("content") or "",
                                                            expected["reasoning_content"])
    # the Responses API: reasoning.effort is the same switch
    response = client.responses.create(model=model, input=CODE[0]["content"], max_output_tokens=24, temperature=0,
                                       reasoning={"effort": "high"})
    reasoning = [item for item in response.output if item.type == "reasoning"]
    assert reasoning and reasoning[0].content[0].text == expected["reasoning_content"]
    assert response.output_text == (expected.get("content") or "")
    response = client.responses.create(model=model, input=CODE[0]["content"], max_output_tokens=24, temperature=0,
                                       reasoning={"effort": "none"})
    assert not [item for item in response.output if item.type == "reasoning"] and response.output_text == off.content


def test_tool_call_round_trip(served):
    client, _, model = served
    messages = [{"role": "user", "content": QUESTION}]
    message = _chat(client, model, messages, max_tokens=80, tools=[WEATHER])
    assert message.reasoning_content == REASONING and not message.content
    (call,) = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert isinstance(call.function.arguments, str) and json.loads(call.function.arguments) == {"city": "Paris"}
    history = messages + [{"role": "assistant", "content": message.content,
                           "tool_calls": [{"id": call.id, "type": "function",
                                           "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
                          {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    final = _chat(client, model, history, max_tokens=40, tools=[WEATHER])
    assert final.content == FINAL and not final.tool_calls
    # streamed, the call comes as one tool_calls delta with its arguments as a JSON string
    calls = []
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=80, temperature=0,
                                                stream=True, tools=[WEATHER]):
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            calls += chunk.choices[0].delta.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def _png_data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_image_as_data_url_and_remote_urls_refused(served):
    from transformers import pipeline

    from transformers_k3.small import data

    client, model, _ = served
    image = data.draw_shape("circle", "red", 56, rng=random.Random(0))
    question = [{"type": "text", "text": data.IMAGE_QUESTION}]
    message = _chat(client, model, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _png_data_url(image)}}, *question]}], max_tokens=20,
        reasoning_effort="none")
    reference = pipeline("image-text-to-text", model=model)
    expected = reference(text=[{"role": "user", "content": [{"type": "image", "image": image}, *question]}],
                         max_new_tokens=20, generate_kwargs={"do_sample": False}, thinking=False)
    assert message.content == expected[0]["generated_text"][-1]["content"] and message.content
    for url in ("http://127.0.0.1:9/a.png", "/etc/hostname", "file:///etc/hostname"):
        with pytest.raises(openai.BadRequestError) as refused:
            _chat(client, model, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                               *question]}], max_tokens=4)
        assert "only as data URLs" in refused.value.response.json()["detail"]


def test_concurrent_clients_get_the_answers_of_sequential_requests(served):
    client, model, _ = served
    requests = [(CODE, {}), ([{"role": "user", "content": "def fibonacci(n):"}], {"reasoning_effort": "none"}),
                ([{"role": "user", "content": QUESTION}], {"tools": [WEATHER]}),
                ([{"role": "user", "content": "Sort a list in Python"}], {"reasoning_effort": "high"})]

    def ask(index):
        messages, kwargs = requests[index]
        if index % 2:
            return _streamed(client, model, messages, max_tokens=16, **kwargs)[:2]
        message = _chat(client, model, messages, max_tokens=16, **kwargs)
        return message.content or "", getattr(message, "reasoning_content", None) or ""

    one_at_a_time = [ask(index) for index in range(4)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, range(4)))
    assert together == one_at_a_time
    assert len(set(one_at_a_time)) == 4


def test_serve_refuses_continuous_batching_with_the_reason():
    from transformers_k3.serving import CONTINUOUS_BATCHING_REFUSED, KimiK3ServeError, build_app

    with pytest.raises(KimiK3ServeError, match="continuous batching cannot hold K3's hybrid state"):
        build_app(None, continuous_batching=True)
    assert "KDA" in CONTINUOUS_BATCHING_REFUSED and "MLA" in CONTINUOUS_BATCHING_REFUSED
