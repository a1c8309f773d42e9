"""Kimi K3 prompt format and a small stand-in tokenizer.

K3 prompts are XTML (K3_SPEC.md section 8): every message is ``<|open|>message role="..."<|sep|> ... <|close|>message
<|sep|><|end_of_msg|>``; the assistant writes inside channels (``think``, ``response``, ``tools``) opened and closed
the same way. `KIMI_K3_CHAT_TEMPLATE` renders that format with Jinja, so ``tokenizer.apply_chat_template`` and
``processor.apply_chat_template`` both work.

SGLang renders K3 prompts with the checkpoint tokenizer's Python encoder, which is not in its wheel; the markers and
fixed texts here come from SGLang's parsers and native renderer strings ([R]) and the assistant-history layout from
public reimplementations validated against that encoder ([I]):

* system / user: ``<|open|>message role="user"<|sep|>CONTENT<|close|>message<|sep|><|end_of_msg|>`` (``developer``
  is rendered as ``system``; an optional ``name`` becomes a second attribute);
* assistant history: ``<|open|>message role="assistant"<|sep|>`` + ``<|open|>think<|sep|>R<|close|>think<|sep|>``
  when the message carries ``reasoning_content`` and thinking is on + ``<|open|>response<|sep|>CONTENT<|close|>
  response<|sep|><|close|>message<|sep|><|end_of_msg|>``;
* generation prompt: ``<|open|>message role="assistant"<|sep|>`` + ``<|open|>think<|sep|>`` (thinking, the default)
  or ``<|open|>response<|sep|>`` (``thinking=False``);
* ``thinking_effort`` (low / high / max) adds a ``type="thinking-effort"`` system message before the conversation;
* each image part renders as one ``<|media_pad|>`` and each video part as one ``<|kimi_video_placeholder|>``;
  `KimiK3Processor` expands them (spec 7.7). User text that spells the template-level image placeholder is escaped
  to ``<| kimi_image_placeholder |>`` as SGLang does.

Tool declarations, tool calls and tool results are not rendered yet; passing ``tools`` or a ``tool`` message
raises an error instead of producing a prompt the model was not trained on.

`build_test_tokenizer` makes a byte-level tokenizer with every K3 special token, for tests and tiny demo models
until the official tiktoken tokenizer is converted.
"""

from __future__ import annotations

KIMI_K3_SPECIAL_TOKENS = (
    "<|open|>", "<|close|>", "<|sep|>",
    "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
    "<|end_of_msg|>", "[EOS]", "[EOT]",
    "<|kimi_image_placeholder|>",
)
MEDIA_PAD = "<|media_pad|>"
VIDEO_PLACEHOLDER = "<|kimi_video_placeholder|>"
THINKING_EFFORTS = ("low", "high", "max")

# Jinja variables: messages, add_generation_prompt, thinking (default true), thinking_effort (default none), tools.
KIMI_K3_CHAT_TEMPLATE = (
    "{%- macro attr(value) -%}{{ value|string|replace('&', '&amp;')|replace('\"', '&quot;') }}{%- endmacro -%}"
    "{%- macro open_message(role, name=none, kind=none) -%}"
    "{{ '<|open|>message role=\"' ~ role ~ '\"' }}"
    "{%- if kind %}{{ ' type=\"' ~ attr(kind) ~ '\"' }}{% endif -%}"
    "{%- if name %}{{ ' name=\"' ~ attr(name) ~ '\"' }}{% endif -%}"
    "{{ '<|sep|>' }}"
    "{%- endmacro -%}"
    "{%- macro close_message() -%}{{ '<|close|>message<|sep|><|end_of_msg|>' }}{%- endmacro -%}"
    "{%- macro text(value) -%}{{ (value or '')|string|replace('<|kimi_image_placeholder|>', "
    "'<| kimi_image_placeholder |>') }}{%- endmacro -%}"
    "{%- macro content(value) -%}"
    "{%- if value is string or value is none -%}{{ text(value) }}"
    "{%- else -%}{%- for part in value -%}"
    "{%- if part.type in ['image', 'image_url'] -%}{{ '<|media_pad|>' }}"
    "{%- elif part.type in ['video', 'video_url'] -%}{{ '<|kimi_video_placeholder|>' }}"
    "{%- elif part.type == 'text' -%}{{ text(part.text) }}"
    "{%- else -%}{{ raise_exception('Kimi K3 chat template: unsupported content part type ' ~ part.type) }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if thinking is not defined or thinking is none %}{% set thinking = true %}{% endif -%}"
    "{%- if tools %}{{ raise_exception('Kimi K3 chat template: tool declarations are not supported yet') }}"
    "{% endif -%}"
    "{%- if thinking and thinking_effort is defined and thinking_effort is not none -%}"
    "{%- if thinking_effort not in ['low', 'high', 'max'] -%}"
    "{{ raise_exception('Unsupported Kimi K3 thinking_effort=' ~ thinking_effort ~ "
    "'; supported values are low, high, and max') }}"
    "{%- endif -%}"
    "{{ open_message('system', kind='thinking-effort') }}"
    "{{ '`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\\nNow the system is invoked with "
    "`thinking_effort=' ~ thinking_effort ~ '`.' }}"
    "{{ close_message() }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = 'system' if message.role == 'developer' else message.role -%}"
    "{%- if role in ['system', 'user'] -%}"
    "{{ open_message(role, message.name) }}{{ content(message.content) }}{{ close_message() }}"
    "{%- elif role == 'assistant' -%}"
    "{%- if message.tool_calls %}{{ raise_exception('Kimi K3 chat template: tool calls are not supported yet') }}"
    "{% endif -%}"
    "{{ open_message('assistant', message.name) }}"
    "{%- set reasoning = message.reasoning_content or message.reasoning -%}"
    "{%- if thinking and reasoning -%}{{ '<|open|>think<|sep|>' }}{{ text(reasoning) }}"
    "{{ '<|close|>think<|sep|>' }}{%- endif -%}"
    "{{ '<|open|>response<|sep|>' }}{{ content(message.content) }}{{ '<|close|>response<|sep|>' }}"
    "{{ close_message() }}"
    "{%- else -%}"
    "{{ raise_exception('Kimi K3 chat template: unsupported message role ' ~ message.role) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ open_message('assistant') }}{{ '<|open|>think<|sep|>' if thinking else '<|open|>response<|sep|>' }}"
    "{%- endif -%}"
)


def build_test_tokenizer(vocab_size: int = 512, media_pad_id: int = 500, pad_id: int = 0, bos_id: int = 1,
                         eos_id: int = 2, chat_template: str | None = KIMI_K3_CHAT_TEMPLATE):
    """A byte-level BPE tokenizer (no merges: one token per UTF-8 byte) with every K3 special token, sized for the
    tiny test models (`KimiK3Config.tiny()`: 512 ids, ``<|media_pad|>`` = 500).

    Layout: ``[PAD]``/``[BOS]``/``[EOS]`` at ``pad_id``/``bos_id``/``eos_id`` (defaults 0/1/2, the tiny config's
    ids; ``[EOS]`` doubles as K3's end token), the 256 byte tokens next, ``<|media_pad|>`` at ``media_pad_id``, the
    other K3 specials after it, and reserved special tokens in every remaining id so that any generated id decodes.
    Returns a transformers fast tokenizer (``TokenizersBackend``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
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

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]",
        extra_special_tokens={"image_token": MEDIA_PAD}, model_max_length=1 << 20, padding_side="left",
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    for token in KIMI_K3_SPECIAL_TOKENS + ("[PAD]", "[BOS]"):
        if tokenizer.convert_tokens_to_ids(token) != model_vocab[token]:
            raise AssertionError(f"test tokenizer lost the id of {token}")
    return tokenizer


__all__ = ["KIMI_K3_CHAT_TEMPLATE", "KIMI_K3_SPECIAL_TOKENS", "MEDIA_PAD", "VIDEO_PLACEHOLDER", "build_test_tokenizer"]
