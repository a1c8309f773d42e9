"""``python -m transformers_k3 serve [MODEL]``: K3 behind transformers' own OpenAI-compatible server.

The server is transformers' (``transformers serve``: chat completions, the Responses API, streaming, tool calls,
``reasoning_content`` parsed through the tokenizer's ``response_template``); this module only plugs K3 into it
through the classes the server is built from, each subclassed here and handed to it through its constructor:

* `KimiK3ModelLoader` loads a K3 checkpoint with the K3 classes (transformers' loader picks a class by the static
  names of its own models or by ``getattr(transformers, architecture)``, where K3 is neither);
* `KimiK3EngineClient` tells the server a K3 checkpoint with a vision tower takes images (transformers reads the
  modality from the same static names);
* `KimiK3ModelManager` creates those engines;
* `KimiK3ChatCompletionHandler` / `KimiK3ResponseHandler` map ``reasoning_effort`` (``reasoning.effort`` in the
  Responses API) to K3's thinking (``"none"`` turns it off; ``low`` / ``high`` / ``max`` set the effort), and accept
  media only as ``data:`` URLs: the server never fetches a URL or reads a path a client names.

Continuous batching is refused for K3: transformers' batching manager keeps a paged KV cache for every layer, and
K3's hybrid cache (each KDA layer's recurrent state and convolution window, each MLA layer's latent) has no place in
it; requests are answered one after another with ``generate()`` and the hybrid cache instead (concurrent clients
queue in transformers' ``GenerateRunner``). Needs transformers >= 5.25, whose server runs each model in an engine.
"""

from __future__ import annotations

from functools import cached_property

from transformers import PreTrainedTokenizerBase
from transformers.cli.serving.chat_completion import UNUSED_CHAT_COMPLETION_FIELDS, ChatCompletionHandler
from transformers.cli.serving.model_manager import EngineClient, ModelLoader, ModelManager
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.utils import Modality, ModelNotServedError, canonical_model_id, parse_model_id

import transformers_k3

from .configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig

# Content parts whose URL the processor would load (and so fetch or read from disk): only data URLs pass.
_MEDIA_PARTS = {"image_url": "image_url", "input_image": "image_url", "video_url": "video_url",
                "audio_url": "audio_url"}

CONTINUOUS_BATCHING_REFUSED = (
    "continuous batching cannot hold K3's hybrid state: transformers' batching manager keeps a paged key/value cache "
    "per layer, and K3's KDA layers carry a recurrent state and a convolution window, its MLA layers a compressed "
    "latent (transformers_k3.cache.KimiK3HybridCache); serving without it, one request after another with generate()")


class KimiK3ServeError(ValueError):
    """A request the K3 server refuses (the server answers it with HTTP 400 and this message)."""


def _register() -> None:
    """The K3 Auto registrations, in whichever process loads or renders (the engine process is spawned)."""
    getattr(transformers_k3, "register", lambda: None)()


def k3_model_class(config):
    """The K3 class a config loads with, or None for a model that is not K3."""
    from .modeling_kimi_k3 import KimiK3ForCausalLM
    from .modeling_kimi_k3_vl import KimiK3ForConditionalGeneration

    if isinstance(config, KimiK3Config):
        return KimiK3ForConditionalGeneration if config.vision_config is not None else KimiK3ForCausalLM
    if isinstance(config, KimiK3TextConfig):
        return KimiK3ForCausalLM
    return None


class KimiK3ModelLoader(ModelLoader):
    """transformers' model loader, loading K3 checkpoints with the K3 classes (others as transformers does)."""

    def load_config(self, model_id):
        _register()
        return super().load_config(model_id)

    def load_processor(self, model_id):
        _register()
        return super().load_processor(model_id)

    def _load_model(self, model_id, tqdm_class=None, progress_callback=None):
        from transformers import AutoConfig

        _register()
        repo, revision, gguf_file = parse_model_id(model_id)
        config = AutoConfig.from_pretrained(repo, revision=revision, trust_remote_code=self.trust_remote_code)
        model_class = k3_model_class(config) if gguf_file is None else None
        if model_class is None:
            return super()._load_model(model_id, tqdm_class=tqdm_class, progress_callback=progress_callback)
        if progress_callback is not None:
            progress_callback({"status": "loading", "model": model_id, "stage": "config"})
        kwargs = {"revision": revision, "attn_implementation": self.attn_implementation, "dtype": self.dtype,
                  "device_map": self.device, "tqdm_class": tqdm_class}
        quantization_config = self.get_quantization_config()
        if quantization_config is not None:
            kwargs["quantization_config"] = quantization_config
        return model_class.from_pretrained(repo, config=config, **kwargs).eval()


class KimiK3EngineClient(EngineClient):
    """transformers' engine client; a K3 checkpoint with a processor (vision tower) is a vision-language model."""

    @cached_property
    def modality(self) -> Modality:
        if isinstance(self.model_config, KimiK3Config) and not isinstance(self.processor, PreTrainedTokenizerBase):
            return Modality.VLM
        return super().modality


class KimiK3ModelManager(ModelManager):
    """transformers' model manager, whose engines are `KimiK3EngineClient`s."""

    def preload_engine(self, force_model: str, engine_connection: tuple | None) -> None:
        model_id = canonical_model_id(force_model)
        engine = KimiK3EngineClient(model_id, self.loader, self.generation_state, connection=engine_connection)
        self.engines[model_id] = engine
        if engine_connection is None:
            engine.start()

    def get_engine(self, model: str | None) -> EngineClient:
        if self.force_model is not None:
            if model is not None and model != self.force_model:
                raise ModelNotServedError(f"Server is pinned to '{self.force_model}'; requested '{model}'.")
            model = self.force_model
        if model is None:
            raise ModelNotServedError("The request names no model, and the server wasn't started with one.")
        model_id = canonical_model_id(model)
        if model_id not in self.engines:
            engine = KimiK3EngineClient(model_id, self.loader, self.generation_state, timeout=self.model_timeout)
            self.engines.setdefault(model_id, engine)
        return self.engines[model_id]


def refuse_remote_media(messages: list) -> None:
    """Raise `KimiK3ServeError` for a media part whose URL is not a ``data:`` URL (http, file paths, anything the
    processor would fetch or open on the server's side)."""
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            key = _MEDIA_PARTS.get(part.get("type")) if isinstance(part, dict) else None
            if key is None:
                continue
            url = part.get(key)
            if isinstance(url, dict):
                url = url.get("url")
            if not isinstance(url, str) or not url.startswith("data:"):
                raise KimiK3ServeError(
                    f"{part.get('type')}: this server takes media only as data URLs "
                    f"(data:image/png;base64,...), got {str(url)[:60]!r}; it does not fetch URLs or read paths")


class _KimiK3Requests:
    """What the K3 chat handlers add to transformers': reasoning effort to the chat template, media checked."""

    def _chat_template_kwargs(self, body: dict) -> dict:
        kwargs = super()._chat_template_kwargs(body)
        reasoning = body.get("reasoning")
        effort = body.get("reasoning_effort")
        if effort is None and isinstance(reasoning, dict):
            effort = reasoning.get("effort")
        if effort is not None and "reasoning_effort" not in kwargs and "thinking_effort" not in kwargs:
            kwargs["reasoning_effort"] = effort  # the tokenizer maps it: "none" = thinking off, else K3's effort
        return kwargs

    def render_messages(self, engine, messages: list[dict], body: dict) -> dict:
        refuse_remote_media(messages)
        return super().render_messages(engine, messages, body)


class KimiK3ChatCompletionHandler(_KimiK3Requests, ChatCompletionHandler):
    """``/v1/chat/completions`` with ``reasoning_effort`` taken (transformers ignores it)."""

    _unused_fields = UNUSED_CHAT_COMPLETION_FIELDS - {"reasoning_effort"}


class KimiK3ResponseHandler(_KimiK3Requests, ResponseHandler):
    """``/v1/responses`` with ``reasoning.effort`` taken."""


def build_app(model: str | None, *, continuous_batching: bool = False, device: str = "auto",
              dtype: str | None = "auto", model_timeout: int = -1, max_model_len: int | None = None,
              default_seed: int | None = None, chat_template_kwargs: dict | None = None, log_level: str = "info",
              enable_cors: bool = False):
    """transformers' FastAPI app with the K3 pieces plugged in, and its model manager (``model``: the one model
    served, loaded now; ``None`` serves whichever model a request names)."""
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.systemone import SystemOneHandler
    from transformers.cli.serving.transcription import TranscriptionHandler
    from transformers.cli.serving.utils import GenerationState, set_serve_log_level
    from transformers.utils import logging

    if continuous_batching:
        raise KimiK3ServeError(CONTINUOUS_BATCHING_REFUSED)
    _register()
    set_serve_log_level(logging.log_levels[log_level.lower()], False)
    state = GenerationState(continuous_batching=False, seed=default_seed, max_model_len=max_model_len)
    loader = KimiK3ModelLoader(device=device, dtype=dtype)
    manager = KimiK3ModelManager(loader, state, model_timeout=model_timeout, force_model=model)
    template_kwargs = dict(chat_template_kwargs or {})
    app = build_server(
        manager,
        KimiK3ChatCompletionHandler(model_manager=manager, generation_state=state,
                                    chat_template_kwargs=template_kwargs),
        completion_handler=CompletionHandler(model_manager=manager, generation_state=state),
        response_handler=KimiK3ResponseHandler(model_manager=manager, generation_state=state,
                                               chat_template_kwargs=template_kwargs),
        transcription_handler=TranscriptionHandler(manager),
        systemone_handler=SystemOneHandler(model_manager=manager, generation_state=state,
                                           chat_template_kwargs=template_kwargs, decision_config=None),
        enable_cors=enable_cors,
    )
    return app, manager


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, **options) -> None:
    """Run the server until it is stopped (Ctrl+C / SIGTERM)."""
    import uvicorn

    app, manager = build_app(model, **options)
    print(f"[serving {model} on http://{host}:{port}/v1 ; chat with: transformers chat {model} "
          f"http://{host}:{port}/v1]", flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level=options.get("log_level", "info"))
    finally:
        manager.shutdown()


__all__ = ["CONTINUOUS_BATCHING_REFUSED", "KimiK3ChatCompletionHandler", "KimiK3EngineClient", "KimiK3ModelLoader",
           "KimiK3ModelManager", "KimiK3ResponseHandler", "KimiK3ServeError", "build_app", "k3_model_class",
           "refuse_remote_media", "serve"]
