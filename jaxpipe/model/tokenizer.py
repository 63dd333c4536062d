"""Text <-> token ids: a tokenizer built from GGUF metadata or an HF `tokenizer.json`.

The heavy lifting (BPE merges, byte-level mapping, added-token matching) is done by the Rust
`tokenizers` library; this module only assembles the pipeline the way `transformers` does when it
loads the same file, so ids and decoded text match `AutoTokenizer` exactly.

    tok = Tokenizer.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    detok = IncrementalDetokenizer(tok, prompt_ids=ids)
    for new_ids in generated_chunks:
        print(detok.push(new_ids), end="")
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

# llama.cpp's token types (gguf `tokenizer.ggml.token_type`).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_SPM_SPACE = "\u2581"  # SentencePiece's visible space, "▁"

# Words each thread's BPE merge cache keeps. tokenizers >= 0.23 keeps one cache per thread, each
# up to the model's capacity (10,000 words by default), and a server encodes on every one of its
# request threads (68 by default): a gRPC soak's front end grew by ~700 bytes a request for 30
# minutes, on the way to ~120 MB of cached words. 1,024 words a thread bound that at about a tenth.
BPE_CACHE_WORDS = 1024

# Split regexes for `tokenizer.ggml.pre` values whose merges were learned on a different split than
# GPT-2's. Same table transformers uses; anything absent (including `smollm`) keeps GPT-2's regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx", "smaug-bpe"],
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2_SPLIT),
}

# SentencePiece architectures transformers rebuilds differently; we refuse them rather than guess.
_UNSUPPORTED_SPM_ARCHS = ("gemma", "gemma2", "gemma3")
_SUPPORTED_MODELS = ("gpt2", "llama")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character table (the alphabet byte-level BPE vocabularies use)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:  # unprintable bytes are shifted past 255 so every byte has a visible stand-in
            table[byte] = chr(256 + extra)
            extra += 1
    return table


# ---------------------------------------------------------------------------------------------
# GGUF -> Rust tokenizer
# ---------------------------------------------------------------------------------------------


def _read_gguf_metadata(path: Path) -> dict[str, Any]:
    """The `general.architecture` and `tokenizer.*` key/values of a GGUF file, as Python values."""
    # lazy: only the GGUF path needs it (a front end with an HF tokenizer does not)
    import gguf

    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {str(path)!r}")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # gguf raises bare ValueErrors etc. without the path
        raise ValueError(f"Could not read {str(path)!r} as a GGUF file: {exc}") from exc
    return _metadata_from_reader(reader)


def _metadata_from_reader(reader: Any) -> dict[str, Any]:
    """Pull only the keys a tokenizer needs out of an already-open `gguf.GGUFReader`."""
    wanted = ("tokenizer.", "general.architecture")
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith(wanted)}


def _special_token_names(meta: dict[str, Any]) -> dict[str, str | None]:
    """`{"bos_token": "<s>", ...}` from the GGUF's special-token ids."""
    tokens = meta["tokenizer.ggml.tokens"]
    keys = {
        "bos_token": "bos_token_id",
        "eos_token": "eos_token_id",
        "unk_token": "unknown_token_id",
        "pad_token": "padding_token_id",
    }
    names = {}
    for name, key in keys.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        names[name] = tokens[token_id] if token_id is not None and token_id < len(tokens) else None
    return names


def _byte_level_backend(meta: dict[str, Any]) -> RustTokenizer:
    """GPT-2 style byte-level BPE (`tokenizer.ggml.model = gpt2`)."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # Some converters store tokens as raw UTF-8; respell those into the byte alphabet so the
    # merges (always in the alphabet) line up with them.
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(meta["tokenizer.ggml.tokens"])
    }
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = RustTokenizer(models.BPE(
        vocab=vocab, merges=merges, fuse_unk=False,
        continuing_subword_prefix="", end_of_word_suffix="",
    ))
    split = _PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Recover BPE merges from a SentencePiece vocabulary: every split of a token into two
    vocabulary pieces is a merge, ranked by the merged token's score (higher merges first)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked = []
    for tok, score in zip(tokens, scores, strict=True):
        local = [
            (tok[:k], tok[k:], score)
            for k in range(1, len(tok))
            if tok[:k] in vocab and tok[k:] in vocab
        ]
        ranked.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _sentencepiece_backend(meta: dict[str, Any]) -> RustTokenizer:
    """SentencePiece BPE with byte fallback (`tokenizer.ggml.model = llama`)."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = _spm_merges(tokens, list(meta["tokenizer.ggml.scores"]))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = RustTokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True)
    )
    if meta.get("general.architecture") == "phi3":
        # Phi-3 prepends "▁" via a normalizer, which differs from Metaspace on leading spaces.
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend(_SPM_SPACE), normalizers.Replace(" ", _SPM_SPACE)]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPM_SPACE, prepend_scheme="first", split=False
        )
    backend.decoder = decoders.Sequence([
        decoders.Replace(_SPM_SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
        decoders.Strip(content=" ", left=1, right=0),  # drop the prepended space
    ])
    return backend


def _add_gguf_added_tokens(backend: RustTokenizer, meta: dict[str, Any]) -> None:
    """Register CONTROL tokens as special and USER_DEFINED ones as plain added tokens, so text
    containing them (e.g. "<|im_start|>") maps to one id instead of being cut into pieces."""
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    byte_level = meta.get("tokenizer.ggml.model") == "gpt2"
    alphabet = set(_bytes_to_unicode().values())
    vocab = backend.get_vocab(with_added_tokens=False)
    special, plain = [], []
    for tok, kind in zip(tokens, types, strict=True):
        # A "control" token outside the byte alphabet is a converter mislabel (transformers skips
        # these too): it is an ordinary, respelled vocabulary entry.
        if kind == _TOKEN_CONTROL and (not byte_level or set(tok) <= alphabet):
            special.append(tok)
        elif kind == _TOKEN_USER_DEFINED and tok in vocab:
            plain.append(tok)
    # bos/eos/unk/pad are special even when typed otherwise (e.g. SentencePiece's <unk>).
    special += [t for t in _special_token_names(meta).values() if t is not None and t in vocab]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in plain])


def _bos_eos_post_processor(
    backend: RustTokenizer, bos: str | None, eos: str | None
) -> processors.TemplateProcessing:
    """A post-processor adding `bos` in front and `eos` at the end (None = don't), built the
    way transformers' `update_post_processor` builds it."""

    def template(seq: str, type_id: int) -> str:
        parts = [f"{bos}:{type_id}"] if bos is not None else []
        parts.append(f"{seq}:{type_id}")
        parts += [f"{eos}:{type_id}"] if eos is not None else []
        return " ".join(parts)

    specials = [(t, backend.token_to_id(t)) for t in (bos, eos) if t is not None]
    missing = [t for t, i in specials if i is None]
    if missing:
        raise ValueError(f"BOS/EOS token(s) {missing} are not in the vocabulary")
    return processors.TemplateProcessing(
        single=template("$A", 0),
        pair=f"{template('$A', 0)} {template('$B', 1)}",
        special_tokens=specials,
    )


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """Accept HF's `{% generation %}...{% endgeneration %}` marker and render its body as-is
    (HF uses it only to build assistant-token masks, which we don't need)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        """Parse the block body up to `endgeneration`."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # HF overrides jinja's tojson, which HTML-escapes; templates rely on the un-escaped form.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same sandboxed environment HF uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# ---------------------------------------------------------------------------------------------
# HF directory helpers
# ---------------------------------------------------------------------------------------------


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _hf_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """The default chat template of an HF tokenizer directory, from wherever it is stored."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    json_file = directory / "chat_template.json"
    if template is None and json_file.is_file():
        template = json.loads(json_file.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _bound_bpe_cache(backend: RustTokenizer) -> None:
    """Cap a BPE model's per-thread merge cache at BPE_CACHE_WORDS (other models keep theirs)."""
    model = backend.model
    if isinstance(model, models.BPE) and hasattr(model, "_resize_cache"):
        model._resize_cache(BPE_CACHE_WORDS)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template.

    Build with `Tokenizer.from_gguf(path)` or `Tokenizer.from_hf_dir(path)`.
    """

    def __init__(
        self,
        backend: RustTokenizer,
        *,
        special_tokens: dict[str, str | None],
        chat_template: str | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """Wrap a ready `tokenizers.Tokenizer`; `special_tokens` maps bos_token/eos_token/
        unk_token/pad_token to their strings (or None). Prefer the `from_*` constructors."""
        self._backend = backend
        _bound_bpe_cache(backend)
        self._special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        self.bos_token_id = self.token_to_id(special_tokens.get("bos_token"))
        self.eos_token_id = self.token_to_id(special_tokens.get("eos_token"))
        self.pad_token_id = self.token_to_id(special_tokens.get("pad_token"))
        self.unk_token_id = self.token_to_id(special_tokens.get("unk_token"))
        self.vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        specials = {i for i, tok in added.items() if tok.special}
        specials |= {i for i in (self.bos_token_id, self.eos_token_id) if i is not None}
        self.special_token_ids: frozenset[int] = frozenset(specials)

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """Build the tokenizer described by a GGUF file's `tokenizer.*` metadata.

        Raises FileNotFoundError if the file is missing and ValueError if it is not a GGUF or its
        tokenizer model is not one we support ("gpt2" byte-level BPE, "llama" SentencePiece).
        """
        return cls.from_gguf_metadata(_read_gguf_metadata(Path(path)), source=str(path))

    @classmethod
    def from_gguf_reader(cls, reader: Any) -> Tokenizer:
        """Like `from_gguf`, reusing an open `gguf.GGUFReader` (parsing one takes seconds)."""
        # GGUFReader keeps no path attribute; its memmap knows the file name.
        source = getattr(getattr(reader, "data", None), "filename", None) or "<GGUFReader>"
        return cls.from_gguf_metadata(_metadata_from_reader(reader), source=str(source))

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], source: str = "<metadata>") -> Tokenizer:
        """Build from a dict of GGUF key/values (`tokenizer.ggml.*`, `general.architecture`)."""
        model = meta.get("tokenizer.ggml.model")
        arch = meta.get("general.architecture")
        if model not in _SUPPORTED_MODELS or "tokenizer.ggml.tokens" not in meta:
            raise ValueError(
                f"{source}: unsupported GGUF tokenizer model {model!r}; "
                f"supported: {', '.join(_SUPPORTED_MODELS)}"
            )
        if model == "llama" and arch in _UNSUPPORTED_SPM_ARCHS:
            raise ValueError(f"{source}: SentencePiece tokenizer of architecture {arch!r} "
                             "is not supported (its vocabulary needs Gemma-specific fixes)")
        backend = (_byte_level_backend if model == "gpt2" else _sentencepiece_backend)(meta)
        _add_gguf_added_tokens(backend, meta)
        names = _special_token_names(meta)
        # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama"))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        bos = names["bos_token"] if add_bos else None
        eos = names["eos_token"] if add_eos else None
        backend.post_processor = _bos_eos_post_processor(backend, bos, eos)
        return cls(backend, special_tokens=names, chat_template=meta.get("tokenizer.chat_template"),
                   vocab_size=len(meta["tokenizer.ggml.tokens"]))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Build from an HF tokenizer directory (`tokenizer.json`, optional
        `tokenizer_config.json` / `chat_template.jinja` for template and special tokens)."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"No tokenizer.json in {str(directory)!r}")
        backend = RustTokenizer.from_file(str(tokenizer_file))
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text("utf-8")) if config_file.is_file() else {}
        names = {k: _token_content(config.get(k))
                 for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        # Like transformers: an explicit add_bos/add_eos flag (or no post-processor at all)
        # overrides tokenizer.json's post-processor; otherwise tokenizer.json is trusted.
        if "add_bos_token" in config or "add_eos_token" in config or not backend.post_processor:
            bos = names["bos_token"] if config.get("add_bos_token") else None
            eos = names["eos_token"] if config.get("add_eos_token") else None
            backend.post_processor = _bos_eos_post_processor(backend, bos, eos)
        template = _hf_chat_template(directory, config)
        return cls(backend, special_tokens=names, chat_template=template)

    def save(self, directory: str | os.PathLike) -> None:
        """Write `tokenizer.json` + `tokenizer_config.json`, readable by `from_hf_dir` (and HF).

        The post-processor (BOS/EOS insertion) travels inside tokenizer.json, so no add_bos /
        add_eos flag is written."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / "tokenizer.json"))
        config = dict(self._special_tokens)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), "utf-8")

    # -- text <-> ids --------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. Special tokens written in the text (e.g. "<|im_start|>") become
        their single ids; BOS/EOS are added only if the model's metadata asks for them and
        `add_special_tokens` is true."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for `ids`; special tokens are dropped when `skip_special_tokens`."""
        ids = [int(i) for i in ids]  # accept numpy / jax arrays as well as lists
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, tok: str | None) -> int | None:
        """The id of the token spelled `tok` (in the vocabulary's own spelling), or None."""
        return None if tok is None else self._backend.token_to_id(tok)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary spelling of `token_id`, or None if out of range."""
        return self._backend.id_to_token(token_id)

    @property
    def backend(self) -> RustTokenizer:
        """The underlying `tokenizers.Tokenizer` (for batch encoding, offsets, ...)."""
        return self._backend

    # -- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_vars: Any
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template,
        exactly as HF's `apply_chat_template(..., tokenize=False)` does. Extra keyword arguments
        (e.g. `tools=[...]`) are passed to the template."""
        if self.chat_template is None:
            raise ValueError("This tokenizer has no chat template")
        if self._compiled_template is None:
            self._compiled_template = _compile_chat_template(self.chat_template)
        variables = {"tools": None, "documents": None, **self._special_tokens, **template_vars}
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )


class IncrementalDetokenizer:
    """Turn a stream of generated ids into text deltas, O(a few tokens) per step.

    Decoding token-by-token is wrong for byte-level BPE (one emoji can span several tokens) and
    for SentencePiece (a token's leading space depends on what precedes it). So each step decodes
    a short window: `ids[prefix_offset:read_offset]` (text already emitted) and
    `ids[prefix_offset:]`, and emits the difference -- unless it ends in U+FFFD, which means a
    UTF-8 sequence is still incomplete and must wait for more ids.
    """

    # How many prompt tokens to use as left context, so the first output token decodes with the
    # spacing it has mid-sequence (matters for SentencePiece's stripped leading space).
    _PROMPT_CONTEXT = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        """Start a stream after `prompt_ids` (used only as decoding context, never emitted)."""
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids)
        self._ids = [int(i) for i in context[max(0, len(context) - self._PROMPT_CONTEXT):]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._chunks: list[str] = []

    def push(self, new_ids: Sequence[int]) -> str:
        """Add generated ids; return the text they complete ("" if it is still incomplete)."""
        self._ids.extend(int(i) for i in new_ids)  # int(): accept numpy / jax scalars too
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        after = decode(self._ids[self._prefix_offset:], self._skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._trim()
        self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (e.g. a truncated multi-byte character, as U+FFFD)."""
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        delta = decode(self._ids[self._prefix_offset:], self._skip)[len(before):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._trim()
        if delta:
            self._chunks.append(delta)
        return delta

    def _trim(self) -> None:
        # Ids before prefix_offset are never decoded again; drop them so memory stays bounded.
        del self._ids[:self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:  # join lazily, keep one string so repeated reads stay cheap
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""
