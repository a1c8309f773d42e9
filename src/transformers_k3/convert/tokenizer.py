"""The official tiktoken-style tokenizer -> a transformers fast tokenizer with the same ids.

The release ships (Kimi K2 / Kimi Linear lineage) a ``tiktoken.model`` BPE ranks file (one
``<base64 token bytes> <rank>`` per line), the special tokens in ``tokenizer_config.json``
(``added_tokens_decoder``, ids from ``len(ranks)`` on), and a Python tokenizer whose ``pat_str`` is the
pre-tokenisation regex. The conversion:

* vocabulary: every ranked byte string under its rank, written in the byte-level alphabet, plus every
  special token under its id; ids between ``len(ranks)`` and the last reserved id that the config does not
  name become ``<|reserved_token_{id}|>``, as the release's tokenizer does (256 reserved ids by default);
* merges: every split ``(left, right)`` of a ranked token into two ranked tokens, ordered by the rank of
  the merged token, with ``ignore_merges`` so that a whole pre-token in the vocabulary is one token; this
  makes transformers' BPE apply merges in tiktoken's order (lowest merged rank first);
* pre-tokenisation: the release's regex (read from its tokenizer code with ``ast``, never executed; the
  Kimi pattern if it cannot be found), then the byte-level mapping; special tokens are matched before it.

``tiktoken`` is not needed for the conversion (the ranks file is read directly); the tests use it as the
reference for the ids.
"""

from __future__ import annotations

import ast
import base64
import json
import shutil
from pathlib import Path

from ..safetensors_header import CheckpointError

# The Kimi K2 / Kimi Linear pre-tokenisation regex (their `tokenization_kimi.py`), used when a release's
# tokenizer code does not state one.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
DEFAULT_NUM_RESERVED_SPECIAL_TOKENS = 256
RANKS_FILE = "tiktoken.model"
ORIGINAL_CONFIG = "tokenizer_config.tiktoken.json"


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Reads a tiktoken BPE file (``<base64> <rank>`` per line); the ranks must be 0..n-1."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise CheckpointError(f"{path}: line {number} is not `<base64 token> <rank>`")
            try:
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except ValueError:
                raise CheckpointError(f"{path}: line {number} is not `<base64 token> <rank>`") from None
            if token in ranks:
                raise CheckpointError(f"{path}: line {number} repeats token {token!r}")
            ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise CheckpointError(f"{path}: ranks are not exactly 0..{len(ranks) - 1}")
    return ranks


def byte_level_alphabet() -> dict[int, str]:
    """The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, the other bytes are
    shifted to code points from 256 up, so every byte is one visible character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def pattern_from_tokenizer_code(directory: str | Path) -> str | None:
    """The ``pat_str`` of a release's ``tokenization_*.py``, read with ``ast`` (the code is never run):
    a string literal, or ``"|".join([...literals...])``."""
    for path in sorted(Path(directory).glob("tokenization_*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            if not any(isinstance(t, (ast.Name, ast.Attribute)) and getattr(t, "id", getattr(t, "attr", None)) == "pat_str"
                       for t in targets) or node.value is None:
                continue
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return value.value
            if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "join"
                    and isinstance(value.func.value, ast.Constant) and len(value.args) == 1
                    and isinstance(value.args[0], (ast.List, ast.Tuple))
                    and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.args[0].elts)):
                return value.func.value.value.join(e.value for e in value.args[0].elts)
    return None


def special_tokens_from_config(tokenizer_config: dict, num_base_tokens: int,
                               num_reserved: int | None = None) -> dict[str, int]:
    """``{content: id}`` for every id from ``num_base_tokens`` to the last reserved one; unnamed ids get
    ``<|reserved_token_{id}|>``."""
    named: dict[int, str] = {}
    for key, entry in (tokenizer_config.get("added_tokens_decoder") or {}).items():
        content = entry["content"] if isinstance(entry, dict) else str(entry)
        named[int(key)] = content
    low = [i for i in named if i < num_base_tokens]
    if low:
        raise CheckpointError(f"tokenizer_config.json: special token {named[low[0]]!r} has id {low[0]}, inside the BPE "
                              f"ranks (0..{num_base_tokens - 1})")
    top = max(named, default=num_base_tokens - 1) + 1 - num_base_tokens
    count = max(num_reserved if num_reserved is not None else DEFAULT_NUM_RESERVED_SPECIAL_TOKENS, top)
    specials = {}
    for i in range(num_base_tokens, num_base_tokens + count):
        content = named.get(i, f"<|reserved_token_{i}|>")
        if content in specials:
            raise CheckpointError(f"tokenizer_config.json: special token {content!r} appears at ids {specials[content]} and {i}")
        specials[content] = i
    return specials


def build_tokenizer(ranks: dict[bytes, int], special_tokens: dict[str, int], pattern: str = KIMI_PATTERN):
    """A `tokenizers.Tokenizer` that encodes like ``tiktoken.Encoding(pat_str=pattern, mergeable_ranks=ranks,
    special_tokens=special_tokens)`` with all special tokens allowed."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = byte_level_alphabet()

    def as_text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {as_text(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        splits.sort(key=lambda lr: (ranks[lr[0]], ranks[lr[1]]))
        merges.extend((rank, left, right) for left, right in splits)
    merges.sort(key=lambda item: item[0])  # stable: ties keep the (left rank, right rank) order
    for content, index in special_tokens.items():
        if content in vocab:
            raise CheckpointError(f"special token {content!r} is also an ordinary BPE token")
        vocab[content] = index
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[(as_text(l), as_text(r)) for _, l, r in merges],
                                     fuse_unk=False, byte_fallback=False, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(content, special=True, normalized=False)
                                  for content, _ in sorted(special_tokens.items(), key=lambda kv: kv[1])])
    return tokenizer


def _token_content(value):
    if isinstance(value, dict):
        return value.get("content")
    return value


def convert_tiktoken_tokenizer(input_dir: str | Path, output_dir: str | Path, pattern: str | None = None,
                               num_reserved_special_tokens: int | None = None, chat_template: str | None = None):
    """Converts the tokenizer files in ``input_dir`` (``tiktoken.model`` + ``tokenizer_config.json``) and
    saves a fast tokenizer (``tokenizer.json``, ``tokenizer_config.json``) to ``output_dir``. The release's
    ``tokenizer_config.json`` is kept there as ``tokenizer_config.tiktoken.json``. Returns the tokenizer.

    The tokenizer is a `KimiK3Tokenizer`: ``apply_chat_template`` renders K3's format in Python as the release's
    encoder does. ``chat_template`` (the Jinja string saved for tools that read only it): kept from the release's
    config when it has one, else this package's ``KIMI_K3_CHAT_TEMPLATE``."""
    from ..tokenization_kimi_k3 import KimiK3Tokenizer

    input_dir, output_dir = Path(input_dir), Path(output_dir)
    ranks_path = input_dir / RANKS_FILE
    if not ranks_path.is_file():
        raise CheckpointError(f"{ranks_path}: missing (the tiktoken BPE ranks file)")
    config_path = input_dir / "tokenizer_config.json"
    if (input_dir / ORIGINAL_CONFIG).is_file():  # converting an already converted directory again
        config_path = input_dir / ORIGINAL_CONFIG
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    ranks = load_tiktoken_ranks(ranks_path)
    specials = special_tokens_from_config(tokenizer_config, len(ranks), num_reserved_special_tokens)
    pattern = pattern or pattern_from_tokenizer_code(input_dir) or KIMI_PATTERN
    backend = build_tokenizer(ranks, specials, pattern)

    roles = {}
    for role in ("bos_token", "eos_token", "unk_token", "pad_token"):
        content = _token_content(tokenizer_config.get(role))
        if content is not None:
            if content not in specials:
                raise CheckpointError(f"{config_path}: {role} {content!r} is not a special token of the tokenizer")
            roles[role] = content
    named = [c for c, _ in sorted(specials.items(), key=lambda kv: kv[1]) if not c.startswith("<|reserved_token_")]
    extra = [c for c in named if c not in roles.values()]
    if chat_template is None:
        chat_template = tokenizer_config.get("chat_template")
    if chat_template is None:
        from ..tokenization_kimi_k3 import KIMI_K3_CHAT_TEMPLATE

        chat_template = KIMI_K3_CHAT_TEMPLATE
    tokenizer = KimiK3Tokenizer(
        tokenizer_object=backend, extra_special_tokens=extra, chat_template=chat_template,
        model_max_length=tokenizer_config.get("model_max_length", int(1e30)), clean_up_tokenization_spaces=False,
        **roles,
    )
    if tokenizer_config.get("response_template") is None:
        from ..chat import KIMI_K3_RESPONSE_TEMPLATE

        # (transformers' text-generation pipeline then returns a chat answer's reasoning and content apart)
        tokenizer.response_template = KIMI_K3_RESPONSE_TEMPLATE
    else:
        tokenizer.response_template = tokenizer_config["response_template"]
    output_dir.mkdir(parents=True, exist_ok=True)
    if config_path.name == "tokenizer_config.json" and config_path.is_file():
        shutil.copy2(config_path, output_dir / ORIGINAL_CONFIG)
    tokenizer.save_pretrained(output_dir)
    return tokenizer


__all__ = [
    "KIMI_PATTERN",
    "build_tokenizer",
    "byte_level_alphabet",
    "convert_tiktoken_tokenizer",
    "load_tiktoken_ranks",
    "pattern_from_tokenizer_code",
    "special_tokens_from_config",
]
