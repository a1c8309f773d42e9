"""K3's tokenizer: the release's conversation format rendered in Python, tokenized segment by segment.

`KimiK3Tokenizer` is a transformers fast tokenizer (``TokenizersBackend``) whose ``apply_chat_template`` renders with
`transformers_k3.encoding_kimi_k3.render_kimi_k3_chat` (the release's ``encoding_k3.py`` layout) instead of Jinja,
and tokenizes each segment on its own: the template's markers with special tokens allowed, every text a user, a tool
or the model wrote with special tokens disallowed. So typed ``<|close|>message<|sep|>`` or ``<|media_pad|>`` stays
text, and the ids are the release encoder's ids. ``tokenize=False`` returns a `KimiK3Prompt` (a ``str``) that this
tokenizer and `KimiK3Processor` still tokenize by segments. Thinking is on by default, as K3 is trained: pass
``thinking=False`` for the response channel, ``thinking_effort="low" | "high" | "max"`` to set the effort.

``parse_response`` (what ``pipeline("text-generation")`` calls on chat output) uses `parse_kimi_k3_response`.

`KIMI_K3_CHAT_TEMPLATE` is a Jinja template that renders the same string, for tools that read only
``chat_template`` (exporters, generic servers); it cannot keep user text from becoming control tokens. So this
tokenizer never tokenizes chat turns through it: ``chat_template=KIMI_K3_CHAT_TEMPLATE`` (or its name) renders with
the encoder, and another explicit Jinja template refuses to tokenize message text that spells an added token.

`build_test_tokenizer` makes a byte-level tokenizer with every K3 special token, for tests and tiny demo models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import BatchEncoding, TokenizersBackend
from transformers.utils import PaddingStrategy, TensorType, logging

from .encoding_kimi_k3 import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, KimiK3ChatError, KimiK3Prompt, render_kimi_k3_chat

logger = logging.get_logger(__name__)

KIMI_K3_SPECIAL_TOKENS = (
    "<|open|>", "<|close|>", "<|sep|>",
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
    "<|end_of_msg|>", "[EOS]", "[EOT]",
    "<|kimi_image_placeholder|>",
)
MEDIA_PAD = "<|media_pad|>"
THINKING_EFFORTS = ("low", "high", "max")
_TEMPLATE_PATH = Path(__file__).parent / "assets" / "chat_template" / "kimi_k3.jinja"
KIMI_K3_CHAT_TEMPLATE = _TEMPLATE_PATH.read_text(encoding="utf-8") if _TEMPLATE_PATH.exists() else None

# The arguments of K3's renderer that apply_chat_template passes through (the rest go to the tokenizer call).
_RENDER_KWARGS = ("thinking", "enable_thinking", "thinking_effort", "reasoning_effort", "tool_choice",
                  "response_format")


# ------------------------------------------------------------------------------------------------- segments -> ids
def _control_ids(tokenizer) -> frozenset[int]:
    return frozenset(int(i) for i in tokenizer.added_tokens_decoder)


def _segment_backends(tokenizer):
    """Two private copies of the tokenizer's backend, never changed after they are made (so other threads' calls,
    which set padding or special-token splitting on the shared backend, cannot leak in): one that splits special
    tokens (for text segments), one that matches them (for control segments). Remade when tokens are added."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    key = (id(backend), backend.get_vocab_size(with_added_tokens=True))
    cached = tokenizer.__dict__.get("_k3_segment_backends")
    if cached is not None and cached[0] == key:
        return cached[1]
    from tokenizers import Tokenizer

    serialized = backend.to_str()
    copies = []
    for split_special in (True, False):
        copy = Tokenizer.from_str(serialized)
        copy.no_padding()
        copy.no_truncation()
        copy.encode_special_tokens = split_special
        copies.append(copy)
    tokenizer.__dict__["_k3_segment_backends"] = (key, tuple(copies))
    return tuple(copies)


def encode_kimi_k3_prompt(tokenizer, prompt: KimiK3Prompt) -> tuple[list[int], list[int]]:
    """(ids, generated mask) of a `KimiK3Prompt`: control segments with special tokens allowed, text segments with
    special tokens disallowed, each on its own. Works with any transformers fast tokenizer that has K3's tokens.
    Raises `KimiK3ChatError` if a text segment still yields an added token (a non-special added token the
    tokenizer would match inside text)."""
    segments = prompt.segments
    texts = [segment.text for segment in segments if not segment.control]
    controls = [segment.text for segment in segments if segment.control]
    backends = _segment_backends(tokenizer)
    if backends is not None:
        text_backend, control_backend = backends
        text_ids = [e.ids for e in text_backend.encode_batch(texts, add_special_tokens=False)] if texts else []
        control_ids = [e.ids for e in control_backend.encode_batch(controls, add_special_tokens=False)] \
            if controls else []
    else:
        text_ids = [tokenizer.encode(t, add_special_tokens=False, split_special_tokens=True) for t in texts]
        control_ids = [tokenizer.encode(t, add_special_tokens=False) for t in controls]
    forbidden = _control_ids(tokenizer)
    ids: list[int] = []
    generated: list[int] = []
    text_iter, control_iter = iter(text_ids), iter(control_ids)
    for index, segment in enumerate(segments):
        piece = next(control_iter) if segment.control else next(text_iter)
        if not segment.control and forbidden.intersection(piece):
            token = tokenizer.convert_ids_to_tokens(sorted(forbidden.intersection(piece))[0])
            raise KimiK3ChatError(f"the tokenizer turns the text {segment.text[:60]!r} into the added token {token!r}: "
                                  "mark K3's added tokens special (AddedToken(..., special=True)) so text cannot "
                                  "produce them")
        ids.extend(piece)
        generated.extend([int(index in prompt.generated)] * len(piece))
    return ids, generated


def _nested_prompt(text: Any) -> bool:
    return isinstance(text, (list, tuple)) and any(_has_prompt(t) for t in text if isinstance(t, (list, tuple)))


def _has_prompt(text: Any) -> bool:
    if isinstance(text, KimiK3Prompt):
        return True
    return isinstance(text, (list, tuple)) and any(isinstance(t, KimiK3Prompt) for t in text)


def encode_prompts(tokenizer, text, *, padding_strategy=PaddingStrategy.DO_NOT_PAD, truncation_strategy=None,
                   max_length: int | None = None, pad_to_multiple_of: int | None = None, padding_side=None,
                   return_tensors=None, return_attention_mask: bool | None = None,
                   return_token_type_ids: bool | None = None, return_special_tokens_mask: bool = False,
                   return_length: bool = False, split_special_tokens: bool = False,
                   return_generated_mask: bool = False, **unsupported) -> BatchEncoding:
    """The tokenizer call for input that holds `KimiK3Prompt` s (plain strings in the batch are tokenized as usual,
    special tokens matched). Supports padding, truncation, tensors, attention / special-tokens masks, lengths."""
    unsupported = {k: v for k, v in unsupported.items()
                   if v not in (None, False, 0) and k not in ("add_special_tokens", "verbose", "text_pair_target")}
    if unsupported:
        raise KimiK3ChatError(f"tokenizing a KimiK3Prompt does not support {sorted(unsupported)}; pass str(prompt) "
                              "to tokenize it as plain text")
    batched = isinstance(text, (list, tuple))
    items = list(text) if batched else [text]
    rows, masks = [], []
    for item in items:
        if isinstance(item, KimiK3Prompt):
            ids, generated = encode_kimi_k3_prompt(tokenizer, item)
        elif isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=False, split_special_tokens=split_special_tokens)
            generated = [0] * len(ids)
        else:
            raise KimiK3ChatError(f"cannot tokenize a {type(item).__name__} together with a KimiK3Prompt")
        truncating = truncation_strategy not in (None, False, "do_not_truncate") and             getattr(truncation_strategy, "value", truncation_strategy) != "do_not_truncate"
        if truncating and max_length is not None and len(ids) > max_length:
            keep = slice(len(ids) - max_length, None) if tokenizer.truncation_side == "left" else slice(0, max_length)
            ids, generated = ids[keep], generated[keep]
        rows.append(ids)
        masks.append(generated)
    data: dict[str, Any] = {"input_ids": rows}
    if return_attention_mask is not False:
        data["attention_mask"] = [[1] * len(r) for r in rows]
    if return_token_type_ids:
        data["token_type_ids"] = [[0] * len(r) for r in rows]
    if return_special_tokens_mask:
        special = _control_ids(tokenizer)
        data["special_tokens_mask"] = [[int(i in special) for i in r] for r in rows]
    if return_generated_mask:
        data["assistant_masks"] = masks
    if return_length:
        data["length"] = [len(r) for r in rows]
    out = BatchEncoding(data)
    if PaddingStrategy(padding_strategy) != PaddingStrategy.DO_NOT_PAD:
        pad_keys = {k: data[k] for k in ("input_ids", "attention_mask", "token_type_ids", "special_tokens_mask")
                    if k in data}
        padded = tokenizer.pad(pad_keys, padding=padding_strategy, max_length=max_length,
                               pad_to_multiple_of=pad_to_multiple_of, padding_side=padding_side,
                               return_attention_mask=return_attention_mask is not False)
        side = padding_side or tokenizer.padding_side
        for key, value in padded.items():
            data[key] = value
        if "assistant_masks" in data:
            width = len(data["input_ids"][0]) if data["input_ids"] else 0
            data["assistant_masks"] = [([0] * (width - len(m)) + m) if side == "left" else (m + [0] * (width - len(m)))
                                       for m in data["assistant_masks"]]
        out = BatchEncoding(data)
    if not batched:
        out = BatchEncoding({k: v[0] if isinstance(v, list) else v for k, v in out.items()})
        if return_tensors is not None:
            out = BatchEncoding({k: [v] if isinstance(v, list) else v for k, v in out.items()},
                                tensor_type=return_tensors)
    elif return_tensors is not None:
        out = BatchEncoding(dict(out), tensor_type=return_tensors)
    return out


# ------------------------------------------------------------------------------------------------- chat template
def apply_kimi_k3_chat_template(tokenizer, conversation, tools=None, documents=None, add_generation_prompt=False,
                                continue_final_message=False, tokenize=True, padding=False, truncation=False,
                                max_length=None, return_tensors=None, return_dict=True,
                                return_assistant_tokens_mask=False, tokenizer_kwargs=None, **kwargs):
    """transformers' ``apply_chat_template`` for K3 with any fast tokenizer that has K3's tokens (what
    `KimiK3Tokenizer.apply_chat_template` runs). Renderer arguments (``thinking``, ``thinking_effort``,
    ``tool_choice``, ``response_format``, ...) are as in `render_kimi_k3_chat`; ``tokenize=False`` returns the
    `KimiK3Prompt` (or a list of them for a batch)."""
    if documents:
        raise KimiK3ChatError("K3's format has no documents channel; put retrieved text into a message")
    kwargs.pop("sanitize_control_tokens", None)  # always on here: message text never becomes control tokens
    render = {k: kwargs.pop(k) for k in _RENDER_KWARGS if k in kwargs}
    unknown = sorted(k for k, v in kwargs.items() if v is not None)
    if unknown:
        raise KimiK3ChatError(f"the K3 chat format takes no {unknown}; its options are {', '.join(_RENDER_KWARGS)}")
    if return_assistant_tokens_mask and not (tokenize and return_dict):
        raise KimiK3ChatError("return_assistant_tokens_mask=True needs tokenize=True and return_dict=True")
    if isinstance(conversation, (list, tuple)) and not conversation:
        raise KimiK3ChatError("cannot render an empty conversation: give at least one message")
    if tools:
        from transformers.utils import get_json_schema

        tools = [get_json_schema(tool) if callable(tool) else tool for tool in tools]
    batched = isinstance(conversation, (list, tuple)) and (
        isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages"))
    conversations = conversation if batched else [conversation]
    prompts = []
    for chat in conversations:
        messages = getattr(chat, "messages", chat)
        prompts.append(render_kimi_k3_chat(messages, tools, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=bool(continue_final_message), **render))
    if not tokenize:
        return prompts if batched else prompts[0]
    out = tokenize_prompts(tokenizer, prompts if batched else prompts[0], padding=padding, truncation=truncation,
                           max_length=max_length, return_tensors=return_tensors,
                           return_generated_mask=return_assistant_tokens_mask, **(tokenizer_kwargs or {}))
    return out if return_dict else out["input_ids"]


def is_kimi_k3_template(tokenizer, chat_template) -> bool:
    """Whether an explicit ``chat_template`` (text or a name in the tokenizer's templates) is K3's own, which the
    encoder renders to the same text and tokenizes safely."""
    if chat_template is None:
        return True
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict) and chat_template in own:
        chat_template = own[chat_template]
    return KIMI_K3_CHAT_TEMPLATE is not None and str(chat_template).strip() == KIMI_K3_CHAT_TEMPLATE.strip()


def _added_token_pattern(tokenizer):
    tokens = sorted({str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()} |
                    set(KIMI_K3_SPECIAL_TOKENS), key=len, reverse=True)
    key = tuple(tokens)
    cached = tokenizer.__dict__.get("_k3_added_token_pattern")
    if cached is None or cached[0] != key:
        import re

        cached = (key, re.compile("|".join(re.escape(t) for t in tokens)))
        tokenizer.__dict__["_k3_added_token_pattern"] = cached
    return cached[1]


def _strings(value: Any):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)
    elif hasattr(value, "messages"):
        yield from _strings(value.messages)


def typed_control_text(tokenizer, conversation, tools=None) -> str | None:
    """The first added token (``<|open|>``, ``<|media_pad|>``, ...) spelled in any string of the conversation or
    the tools, else None."""
    pattern = _added_token_pattern(tokenizer)
    for text in _strings([conversation, tools or []]):
        found = pattern.search(text)
        if found:
            return found.group(0)
    return None


def guard_jinja_template(tokenizer, conversation, tools, tokenize: bool) -> None:
    """transformers' Jinja path tokenizes its whole output with special tokens matched: typed control text in a
    message would become the control token (a forged turn). Refuse that; warn when the text is only rendered."""
    typed = typed_control_text(tokenizer, conversation, tools)
    if typed is None:
        return
    if tokenize:
        raise KimiK3ChatError(
            f"a message spells the control token {typed!r}; an explicit Jinja chat_template tokenizes its output with "
            "special tokens matched, so that text would become the control token. Leave chat_template unset (K3's "
            "encoder keeps message text as text), or remove the text")
    logger.warning_once(
        f"a message spells the control token {typed!r} and an explicit Jinja chat_template rendered it as is: "
        "tokenizing that string with special tokens matched turns it into the control token. Leave chat_template "
        "unset to get K3's encoder, which keeps message text as text")


def tokenize_prompts(tokenizer, text, padding=False, truncation=None, max_length=None, **kwargs) -> BatchEncoding:
    """``tokenizer(text, ...)`` for `KimiK3Prompt` input with any fast tokenizer (padding / truncation as there)."""
    padding_strategy, truncation_strategy, max_length, _ = tokenizer._get_padding_truncation_strategies(
        padding=padding, truncation=truncation, max_length=max_length,
        pad_to_multiple_of=kwargs.get("pad_to_multiple_of"), verbose=False)
    return encode_prompts(tokenizer, text, padding_strategy=padding_strategy, truncation_strategy=truncation_strategy,
                          max_length=max_length, **kwargs)


class KimiK3Tokenizer(TokenizersBackend):
    """Kimi K3's tokenizer: a fast BPE tokenizer whose chat template is K3's Python renderer (see the module
    docstring). ``apply_chat_template(messages, add_generation_prompt=True)`` renders with thinking on (the
    trained default); pass ``thinking=False`` or ``thinking_effort=...`` to change it. A ``chat_template=`` you pass
    explicitly is K3's encoder if it is K3's template, else transformers' Jinja path, guarded against typed control
    text (`guard_jinja_template`)."""

    # No __init__ of our own: transformers then loads tokenizer.json as it is.
    @property
    def response_template(self) -> dict:
        """Set by default: transformers' chat pipelines parse their output (through `parse_response`) only then."""
        from .chat import KIMI_K3_RESPONSE_TEMPLATE

        return self.__dict__.get("_response_template") or KIMI_K3_RESPONSE_TEMPLATE

    @response_template.setter
    def response_template(self, value) -> None:
        self.__dict__["_response_template"] = value

    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template=None, **kwargs):
        """K3's encoder (see the class docstring). A ``chat_template`` that is K3's own template (by text or by
        name) renders through the encoder too; another Jinja template goes to transformers' path, which refuses to
        tokenize (and warns when it renders) message text that spells one of the tokenizer's added tokens."""
        if is_kimi_k3_template(self, chat_template):
            return apply_kimi_k3_chat_template(self, conversation, tools=tools, documents=documents, **kwargs)
        guard_jinja_template(self, conversation, tools, tokenize=kwargs.get("tokenize", True))
        return super().apply_chat_template(conversation, tools=tools, documents=documents,
                                           chat_template=chat_template, **kwargs)

    def _encode_plus(self, text, text_pair=None, **kwargs):
        if _has_prompt(text_pair) or _nested_prompt(text) or _nested_prompt(text_pair):
            raise KimiK3ChatError("a KimiK3Prompt can only be tokenized on its own or in a batch of prompts (not as a "
                                  "pair or a pre-tokenized word); pass str(prompt) to tokenize it as plain text")
        if _has_prompt(text):
            if text_pair is not None:
                raise KimiK3ChatError("a KimiK3Prompt cannot be tokenized as a pair")
            if kwargs.get("is_split_into_words"):
                raise KimiK3ChatError("a KimiK3Prompt is not split into words")
            kwargs.pop("is_split_into_words", None)
            return encode_prompts(self, text, **kwargs)
        kwargs.pop("return_generated_mask", None)
        return super()._encode_plus(text, text_pair=text_pair, **kwargs)

    def tokenize(self, text, pair=None, add_special_tokens=False, **kwargs):
        if isinstance(text, KimiK3Prompt) and pair is None:
            return self.convert_ids_to_tokens(encode_kimi_k3_prompt(self, text)[0])
        return super().tokenize(text, pair=pair, add_special_tokens=add_special_tokens, **kwargs)

    def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
        """With special tokens kept, the text is a `KimiK3Prompt` whose control segments are the special tokens
        that were generated, so `parse_response` (the chat pipelines) can tell them from text that spells them."""
        text = super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if skip_special_tokens:
            return text
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        special = _control_ids(self)
        segments, run = [], []
        for token in ids + [None]:
            if token is None or token in special:
                if run:
                    segments.append((super()._decode(run, skip_special_tokens=False, **kwargs), False))
                    run = []
                if token is not None:
                    segments.append((super()._decode([token], skip_special_tokens=False, **kwargs), True))
            else:
                run.append(token)
        prompt = KimiK3Prompt(segments)
        return prompt if prompt == text else text

    def parse_response(self, response, schema=None, *, prefix=None, tools=None):
        """The assistant message of a K3 answer (``content``, ``reasoning_content``, ``tool_calls``) by
        `parse_kimi_k3_response`; ``response`` / ``prefix`` as text or ids. Another ``schema`` passed explicitly
        uses transformers' ``response_template`` parser instead (K3's own, as `transformers serve` passes it, keeps
        K3's parser: the two differ on malformed or truncated answers)."""
        from .chat import KIMI_K3_RESPONSE_TEMPLATE

        if schema is not None and schema != KIMI_K3_RESPONSE_TEMPLATE:
            return super().parse_response(response, schema, prefix=prefix, tools=tools)
        from .chat import parse_kimi_k3_response

        if isinstance(response, (list, tuple)) and response and isinstance(response[0], (list, tuple)):
            return [self.parse_response(r, prefix=prefix, tools=tools) for r in response]
        # ids stay ids: only real control tokens are markers then (decoded text cannot tell them from typed text)
        return parse_kimi_k3_response(response, prompt=prefix, tokenizer=self).to_message()


def build_test_tokenizer(vocab_size: int = 512, media_pad_id: int = 500, pad_id: int = 0, bos_id: int = 1,
                         eos_id: int = 2, chat_template: str | None = KIMI_K3_CHAT_TEMPLATE):
    """A byte-level BPE tokenizer (no merges: one token per UTF-8 byte) with every K3 special token, sized for the
    tiny test models (`KimiK3Config.tiny()`: 512 ids, ``<|media_pad|>`` = 500).

    Layout: ``[PAD]``/``[BOS]``/``[EOS]`` at ``pad_id``/``bos_id``/``eos_id`` (defaults 0/1/2, the tiny config's
    ids; ``[EOS]`` doubles as K3's end token), the 256 byte tokens next, ``<|media_pad|>`` at ``media_pad_id``, the
    other K3 specials after it, and reserved special tokens in every remaining id so that any generated id decodes.
    Returns a transformers fast tokenizer (``TokenizersBackend``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    fixed = {pad_id: "[PAD]", bos_id: "[BOS]", eos_id: "[EOS]", media_pad_id: MEDIA_PAD}
    specials_after = [t for t in KIMI_K3_SPECIAL_TOKENS if t not in fixed.values()]
    byte_chars = list(bytes_to_unicode().values())
    needed = len(fixed) + len(specials_after) + len(byte_chars)
    if needed > vocab_size or media_pad_id >= vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is too small for {needed} tokens (media_pad_id={media_pad_id})")

    tokens: dict[int, str] = dict(fixed)
    free = (i for i in range(vocab_size) if i not in tokens)
    vocab = {}
    for char in byte_chars:
        index = next(free)
        vocab[char] = index
        tokens[index] = char
    # K3 specials right after <|media_pad|> where they fit, else in the next free ids.
    special_ids = []
    for token in specials_after:
        candidates = [i for i in range(media_pad_id + 1, vocab_size) if i not in tokens]
        index = candidates[0] if candidates else next(i for i in range(vocab_size) if i not in tokens)
        tokens[index] = token
        special_ids.append(index)
    for index in range(vocab_size):
        tokens.setdefault(index, f"<|reserved_{index}|>")

    model_vocab = dict(vocab)
    for index, token in tokens.items():
        model_vocab.setdefault(token, index)
    backend = Tokenizer(models.BPE(vocab=model_vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    # Added tokens are matched before byte-level splitting; added in id order so ids are kept.
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i in sorted(tokens) if tokens[i] not in vocab])

    tokenizer = KimiK3Tokenizer(
        tokenizer_object=backend, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]",
        extra_special_tokens={"image_token": MEDIA_PAD}, model_max_length=1 << 20, padding_side="left",
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    for token in KIMI_K3_SPECIAL_TOKENS + ("[PAD]", "[BOS]"):
        if tokenizer.convert_tokens_to_ids(token) != model_vocab[token]:
            raise AssertionError(f"test tokenizer lost the id of {token}")
    return tokenizer


__all__ = [
    "KIMI_K3_CHAT_TEMPLATE",
    "KIMI_K3_SPECIAL_TOKENS",
    "MEDIA_PAD",
    "VIDEO_PLACEHOLDER",
    "IMAGE_PLACEHOLDER",
    "KimiK3Tokenizer",
    "apply_kimi_k3_chat_template",
    "build_test_tokenizer",
    "encode_kimi_k3_prompt",
    "tokenize_prompts",
]
