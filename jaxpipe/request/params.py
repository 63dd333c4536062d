"""`SamplingParams`: how a request wants its tokens chosen, with vLLM's fields, defaults and
meanings, validated once in `__post_init__` (each error names the field and what is accepted).
The device and host samplers that act on them are `runtime/sampling.py` and
`runtime/host_sampler.py`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

import numpy as np

GREEDY_EPS = 1e-5  # temperature below this is greedy (as vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20
MAX_N = 128  # samples of one request (each takes a device slot while it decodes)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]


# ----------------------------------------------------------------------------------------------
# Host side: request parameters
# ----------------------------------------------------------------------------------------------


def is_int(value) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _check_int(name: str, value, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if not is_int(value):
        kind = "an integer or None" if allow_none else "an integer"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
    return int(value)


def _check_float(name: str, value) -> float:
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.number):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def _normalise_stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise TypeError(f"stop must be a str, a list of str or None, got {value!r}")
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError(f"stop must contain only non-empty strings, got {item!r}")
    return tuple(items)


def _normalise_stop_token_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise TypeError(f"stop_token_ids must be a list of int or None, got {value!r}")
    for item in value:
        if not is_int(item) or item < 0:
            raise ValueError(f"stop_token_ids must contain only ints >= 0, got {item!r}")
    return tuple(int(i) for i in value)


def _normalise_logit_bias(value) -> dict[int, float] | None:
    """{token id: bias}; ids may be strings of ints (OpenAI's JSON keys)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"logit_bias must be a dict {{token_id: bias}} or None, got {value!r}")
    out = {}
    for key, bias in value.items():
        tok = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
        if not is_int(tok) or tok < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {key!r}")
        bias = _check_float("logit_bias", bias)
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}], got {bias} for token {tok}")
        out[int(tok)] = bias
    return out


def _normalise_allowed(value) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(f"allowed_token_ids must be a non-empty list of token ids or None, "
                         f"got {value!r}")
    for item in value:
        if not is_int(item) or item < 0:
            raise ValueError(f"allowed_token_ids must contain only ints >= 0, got {item!r}")
    return tuple(sorted({int(i) for i in value}))


def _normalise_bad_words(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise TypeError(f"bad_words must be a list of str or None, got {value!r}")
    for item in value:
        if not isinstance(item, str) or not item.strip():
            raise ValueError(f"bad_words must contain only non-blank strings, got {item!r}")
    return tuple(value)


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output, by vLLM's names: `json` (a JSON schema, as a
    dict or its JSON text), `regex`, `choice` (the output is one of these strings), `grammar`
    (Lark, or GBNF/EBNF as llama.cpp and vLLM accept it) or `json_object=True` (any JSON
    object). Exactly one is set. A dict given for SamplingParams.structured_outputs is read
    as these fields. Whether the constraint compiles is checked against the model's
    tokenizer (`request/grammar.py`)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar, json_object; got {given or 'none'}")
        if self.json is not None:
            self.json = _schema(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {value!r}")
        if self.choice is not None:
            self.choice = _choices(self.choice)
        if self.json_object is not None:
            self.json_object = _check_bool("structured_outputs.json_object", self.json_object)

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, its text): equal for equal constraints (a schema's keys sorted)."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "choice"):
            return self.kind, json.dumps(value, sort_keys=True)
        return self.kind, "" if self.kind == "json_object" else value


STRUCTURED_KINDS = tuple(f.name for f in fields(StructuredOutputsParams))


def _schema(value) -> dict | bool:
    """A JSON schema: a dict (or true/false), or its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(value, dict | bool):
        raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got "
                         f"{type(value).__name__} {value!r}")
    return value


def _choices(value) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, "
                         f"got {value!r}")
    for item in value:
        if not isinstance(item, str) or not item:
            raise ValueError(f"structured_outputs.choice must contain only non-empty strings, "
                             f"got {item!r}")
    return tuple(value)


def _structured(value) -> StructuredOutputsParams | None:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"structured_outputs must be a StructuredOutputsParams, a dict of its "
                        f"fields or None, got {type(value).__name__} {value!r}")
    known = {f.name for f in fields(StructuredOutputsParams)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"structured_outputs has no field {unknown[0]!r}; accepted: "
                         f"{', '.join(sorted(known))}")
    return StructuredOutputsParams(**{k: v for k, v in value.items() if v is not None})


@dataclass
class SamplingParams:
    """Per-request sampling parameters: vLLM's names, defaults and meanings.

    `top_k=-1` is normalised to 0 (off); `stop`, `stop_token_ids`, `bad_words` and
    `allowed_token_ids` (sorted, unique) are normalised to tuples, `logit_bias` keys to ints.
    `best_of` is accepted only as None or n: vLLM V1 dropped it.
    Invalid values raise ValueError (TypeError for wrong types) naming the field, the value and
    the accepted range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # added to the raw logits, in [-100, 100]
    allowed_token_ids: list[int] | tuple[int, ...] | None = None  # only these may be sampled
    bad_words: list[str] | tuple[str, ...] | None = None  # words never generated
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    include_stop_str_in_output: bool = False  # keep a matched stop string in the text
    best_of: int | None = None  # refused unless None or n (vLLM V1 dropped it)
    prompt_logprobs: int | None = None  # each prompt token's logprob and the top k (vLLM's)
    structured_outputs: StructuredOutputsParams | dict | None = None  # one output constraint

    def __post_init__(self):
        self._validate_floats()
        self._validate_ints()
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _check_bool("skip_special_tokens", self.skip_special_tokens)
        self._validate_token_lists()
        self.structured_outputs = _structured(self.structured_outputs)

    def _validate_token_lists(self):
        """logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens,
        include_stop_str_in_output and best_of (ids are checked against the vocabulary by
        `validate.check_vocab`, which knows the model)."""
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        self.allowed_token_ids = _normalise_allowed(self.allowed_token_ids)
        self.bad_words = _normalise_bad_words(self.bad_words)
        self.truncate_prompt_tokens = _check_int("truncate_prompt_tokens",
                                                 self.truncate_prompt_tokens, allow_none=True)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or None, "
                             f"got {self.truncate_prompt_tokens}")
        self.include_stop_str_in_output = _check_bool("include_stop_str_in_output",
                                                      self.include_stop_str_in_output)
        self.best_of = _check_int("best_of", self.best_of, allow_none=True)
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise ValueError(f"best_of must be None or equal to n={self.n}, got {self.best_of}: "
                             "vLLM V1 dropped best_of; ask for n completions instead")

    def _validate_floats(self):
        f = {name: _check_float(name, getattr(self, name)) for name in (
            "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty")}
        if f["temperature"] < 0:
            raise ValueError(f"temperature must be >= 0, got {f['temperature']}")
        if not 0 < f["top_p"] <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {f['top_p']}")
        if not 0 <= f["min_p"] <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {f['min_p']}")
        if f["repetition_penalty"] <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {f['repetition_penalty']}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= f[name] <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {f[name]}")
        for name, value in f.items():
            setattr(self, name, value)

    def _validate_ints(self):
        self.n = _check_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        self.top_k = max(self.top_k, 0)
        self.seed = _check_int("seed", self.seed, allow_none=True)
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32) or None, got {self.seed}")
        self.max_tokens = _check_int("max_tokens", self.max_tokens, allow_none=True)
        self._validate_prompt_logprobs()
        if self.prompt_logprobs is not None and self.n > 1:
            raise ValueError(f"prompt_logprobs needs n=1 (the prompt is scored once; ask for "
                             f"the samples in another request), got n={self.n}")
        self.min_tokens = _check_int("min_tokens", self.min_tokens)
        upper = "max_tokens" if self.max_tokens is not None else "inf"
        if self.min_tokens < 0 or self.min_tokens > (
                math.inf if self.max_tokens is None else self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, {upper}={self.max_tokens}], "
                             f"got {self.min_tokens}")
        self.logprobs = _check_int("logprobs", self.logprobs, allow_none=True)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be None or in [0, {MAX_LOGPROBS}], "
                             f"got {self.logprobs}")

    def _validate_prompt_logprobs(self):
        """prompt_logprobs in [0, MAX_LOGPROBS] or None; max_tokens=0 (score the prompt, no
        output) only with prompt_logprobs."""
        self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs,
                                          allow_none=True)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be None or in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs}")
        lowest = 0 if self.prompt_logprobs is not None else 1
        if self.max_tokens is not None and self.max_tokens < lowest:
            accepted = ("an int >= 0 (0: score the prompt only) or None" if lowest == 0 else
                        "an int >= 1 or None (0 only with prompt_logprobs)")
            raise ValueError(f"max_tokens must be {accepted}, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (temperature below 1e-5, as in vLLM)."""
        return self.temperature < GREEDY_EPS


