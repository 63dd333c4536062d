"""Output constraints compiled against a model's tokenizer: what `StructuredOutputsParams`
asks for, as llguidance matchers.

    grammars = grammars_for(tokenizer, vocab_size) # one per tokenizer and vocab, shared
    grammar = grammars.compile(params.structured_outputs)   # cached by the constraint
    matcher = grammar.matcher()                    # a fresh llguidance LLMatcher per sequence

Why llguidance: it fills NumPy token bitmasks (32 tokens per int32, the layout the samplers
unpack) for a batch of matchers on its own Rust threads with the GIL released, needs neither
torch (xgrammar imports it) nor numba (outlines-core's mask fill), and compiles JSON schemas,
regexes, choices and Lark/GBNF grammars to one matcher type. Its masks already force EOS once
a grammar is complete; the engine ends such a sequence at once ("stop") instead of spending a
step on it.

JSON is generated compactly with the usual separators (", " and ": ") and no free whitespace:
a small model allowed any whitespace can fill its whole budget with newlines.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass

import llguidance

from jaxpipe.request.errors import RequestError
from jaxpipe.request.params import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 256  # compiled constraints kept per tokenizer (least recently used dropped)


@dataclass(frozen=True)
class Grammar:
    """One compiled constraint: fresh matchers are copies of `template`, never advanced."""

    key: tuple[str, str]
    template: llguidance.LLMatcher

    def matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


class Grammars:
    """Compiles constraints for one tokenizer and keeps the last `_CACHE_SIZE` of them."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...] = ()):
        """`tokenizer`: jaxpipe's `Tokenizer` (its Rust backend is what llguidance reads);
        `vocab_size`: the width of the model's logits (ids past the tokenizer's are never
        allowed); `eos_ids`: the model's end tokens besides the tokenizer's (a chat model's
        end of turn), each allowed wherever the grammar may end."""
        eos = sorted({i for i in (tokenizer.eos_token_id, *eos_ids) if i is not None})
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                eos_token=eos or None)
        self.vocab_size = vocab_size
        self._cache: dict[tuple[str, str], Grammar] = {}
        self._lock = threading.Lock()

    def compile(self, so: StructuredOutputsParams) -> Grammar:
        """The compiled constraint of `so` (cached), or RequestError naming its field and
        what the grammar engine said."""
        key = so.key
        with self._lock:
            grammar = self._cache.pop(key, None)
            if grammar is not None:
                self._cache[key] = grammar  # most recently used last
                return grammar
        grammar = Grammar(key, self._matcher(so))
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > _CACHE_SIZE:
                self._cache.pop(next(iter(self._cache)))
        return grammar

    def _matcher(self, so: StructuredOutputsParams) -> llguidance.LLMatcher:
        field = f"sampling.structured_outputs.{so.kind}"
        try:
            text = grammar_text(so)
        except (ValueError, TypeError) as e:
            raise RequestError(field, f"does not compile: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise RequestError(field, f"does not compile: {error}")
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise RequestError(field, f"does not compile: {matcher.get_error()}")
        return matcher


_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {key: Grammars}
_SHARED_LOCK = threading.Lock()


def grammars_for(tokenizer, vocab_size: int, eos_ids: tuple[int, ...] = ()) -> Grammars:
    """The one `Grammars` of `tokenizer`, `vocab_size` and `eos_ids` in this process: the
    front ends' validation (`validate.prepare`) and an engine in the same process share its
    llguidance tokenizer (built once, ~0.2 s for SmolLM2's 49,152 tokens) and its compiled
    constraints when they agree on the end tokens. Dropped with the tokenizer."""
    key = (vocab_size, tuple(sorted(set(eos_ids) - {tokenizer.eos_token_id})))
    with _SHARED_LOCK:
        by_key = _SHARED.setdefault(tokenizer, {})
        if key not in by_key:
            by_key[key] = Grammars(tokenizer, vocab_size, key[1])
        return by_key[key]


def grammar_text(so: StructuredOutputsParams) -> str:
    """llguidance's grammar text of a constraint."""
    if so.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(so.json), overrides=JSON_OPTIONS)
    if so.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            '{"type": "object"}', overrides=JSON_OPTIONS)
    if so.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.regex)
    if so.kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(so.choice)))
    return llguidance.grammar_from("grammar", so.grammar)


def mask_width(vocab_size: int) -> int:
    """int32 words of one row's token bitmask."""
    return (vocab_size + 31) // 32

