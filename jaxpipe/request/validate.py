"""Turning a client's request into what the engine accepts, or a `RequestError` naming the field.

The one validator of requests: `Engine` (add_request, generate, chat, stream), the gRPC front
end and the JSONL batch jobs all refuse exactly the same inputs with the same messages.
A prompt is given as one of three kinds:

    "text"       a string, tokenized with the model's tokenizer (special tokens added)
    "chat"       [{"role", "content"}, ...], rendered with the model's chat template (with
                 `template_vars` such as `tools`); an assistant message may carry
                 `tool_calls` instead of content, a "tool" message its `tool_call_id`
    "token_ids"  a list of token ids
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np
from jinja2 import TemplateError

from jaxpipe.request.errors import RequestError
from jaxpipe.request.params import SamplingParams

PROMPT_KINDS = ("text", "chat", "token_ids")
CHAT_ROLES = ("system", "user", "assistant", "tool")
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


@dataclass(frozen=True)
class Limits:
    """What the running engine accepts."""

    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class Prepared:
    """A validated request: prompt ids and sampling parameters (also as a JSON-able dict)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    params_dict: dict


def prepare(kind: str | None, value, sampling: dict, tokenizer, limits: Limits,
            template_vars: dict | None = None) -> Prepared:
    """Validate one request and tokenize its prompt, or raise RequestError. `template_vars`:
    what a chat prompt's template gets beyond the messages (e.g. `tools`)."""
    params = sampling_params(sampling)
    if params.stop and tokenizer is None:
        raise RequestError("sampling.stop", "stop strings need a tokenizer; this model has none "
                           "(use stop_token_ids)")
    if params.bad_words and tokenizer is None:
        raise RequestError("sampling.bad_words", "bad_words need a tokenizer; this model has "
                           "none (use logit_bias with -100)")
    check_vocab(params, limits)
    check_structured(params, tokenizer, limits)
    ids = prompt_token_ids(kind, value, tokenizer, limits, params.truncate_prompt_tokens,
                           template_vars)
    max_tokens(ids, params, limits)
    as_dict = {k: list(v) if isinstance(v, tuple) else v
               for k, v in dataclasses.asdict(params).items()}
    return Prepared(ids, params, as_dict)


def check_vocab(params: SamplingParams, limits: Limits) -> None:
    """RequestError unless every id of logit_bias and allowed_token_ids is in the vocabulary."""
    v = limits.vocab_size
    for name, ids in (("logit_bias", params.logit_bias or ()),
                      ("allowed_token_ids", params.allowed_token_ids or ())):
        bad = [i for i in ids if i >= v]
        if bad:
            raise RequestError(f"sampling.{name}", f"token id {bad[0]} is outside the "
                               f"vocabulary [0, {v})")


def check_structured(params: SamplingParams, tokenizer, limits: Limits) -> None:
    """RequestError ("sampling.structured_outputs.<kind>") unless the request's output
    constraint compiles against the model's tokenizer; compiled here, before the request
    reaches the engine, into the cache the engine shares in-process."""
    so = params.structured_outputs
    if so is None:
        return
    if tokenizer is None:
        raise RequestError("sampling.structured_outputs", "structured outputs need the model's "
                           "tokenizer; this model has none")
    from jaxpipe.request.grammar import grammars_for  # lazy: llguidance only when asked

    grammars_for(tokenizer, limits.vocab_size).compile(so)


def max_tokens(ids: list[int], params: SamplingParams, limits: Limits) -> int:
    """The tokens the request may generate: its max_tokens, or all the room max_model_len
    leaves after the prompt; RequestError when max_tokens asks for more than that."""
    room = limits.max_model_len - len(ids)
    if params.max_tokens is None:
        return room
    if params.max_tokens > room:
        raise RequestError("sampling.max_tokens", f"max_tokens={params.max_tokens} with a "
                           f"{len(ids)}-token prompt exceeds max_model_len="
                           f"{limits.max_model_len}; at most {room}")
    return params.max_tokens


def sampling_params(fields: dict) -> SamplingParams:
    """`SamplingParams(**fields)`, with errors naming the field as "sampling.<name>"."""
    unknown = sorted(set(fields) - set(SAMPLING_FIELDS))
    if unknown:
        raise RequestError(f"sampling.{unknown[0]}", f"unknown sampling parameter; accepted: "
                           f"{', '.join(SAMPLING_FIELDS)}")
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as e:
        first = str(e).split(" ", 1)[0]
        name = first if first.split(".")[0] in SAMPLING_FIELDS else "params"
        raise RequestError(f"sampling.{name}", str(e)) from None


def prompt_token_ids(kind: str | None, value, tokenizer, limits: Limits,
                     truncate: int | None = None, template_vars: dict | None = None
                     ) -> list[int]:
    """The prompt's token ids, checked against the vocabulary and max_model_len: only its
    last `truncate` ids when that is given (`truncate_prompt_tokens`)."""
    if kind not in PROMPT_KINDS:
        raise RequestError("prompt", f"give a prompt as one of {', '.join(PROMPT_KINDS)}")
    if kind != "token_ids" and tokenizer is None:
        raise RequestError(kind, "this model has no tokenizer; give the prompt as token_ids")
    if kind == "text":
        ids = _text_ids(value, tokenizer)
    elif kind == "chat":
        ids = _chat_ids(value, tokenizer, template_vars or {})
    else:
        ids = _checked_ids(value, limits.vocab_size)
    if truncate is not None:
        ids = ids[-truncate:]
    if len(ids) >= limits.max_model_len:
        raise RequestError(kind, f"the prompt has {len(ids)} tokens; max_model_len is "
                           f"{limits.max_model_len}, which must leave room for one new token")
    return ids


def _text_ids(text, tokenizer) -> list[int]:
    if not isinstance(text, str):
        raise RequestError("text", f"must be a string, got {type(text).__name__}")
    if not text:
        raise RequestError("text", "the prompt is empty")
    return tokenizer.encode(text)


def _chat_ids(messages, tokenizer, template_vars: dict) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("chat", "give a non-empty list of messages")
    messages = [_message(f"chat[{i}]", msg) for i, msg in enumerate(messages)]
    if tokenizer.chat_template is None:
        raise RequestError("chat", "this model has no chat template; give text or token_ids")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             **template_vars)
    except (TemplateError, TypeError) as e:
        raise RequestError("chat", f"the model's chat template cannot render these messages: "
                           f"{type(e).__name__}: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def _message(where: str, msg) -> dict:
    """A checked message, as the chat template gets it (a copy: tool call arguments given
    as JSON text become objects, as vLLM passes them, since templates write them out)."""
    if not isinstance(msg, dict):
        raise RequestError(where, "each message is an object with role and content")
    if msg.get("role") not in CHAT_ROLES:
        raise RequestError(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}, "
                           f"got {msg.get('role')!r}")
    calls = msg.get("tool_calls") if msg["role"] == "assistant" else None
    if not isinstance(msg.get("content"), str) and not (calls and msg.get("content") is None):
        raise RequestError(f"{where}.content", "must be a string (null only beside an "
                           "assistant's tool_calls)")
    if msg["role"] == "tool" and not isinstance(msg.get("tool_call_id", ""), str):
        raise RequestError(f"{where}.tool_call_id", "must be a string")
    if calls is None:
        return msg
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls", "must be a list of "
                           '{"id", "type": "function", "function": {"name", "arguments"}}')
    return {**msg, "tool_calls": [_tool_call(f"{where}.tool_calls[{i}]", call)
                                  for i, call in enumerate(calls)]}


def _tool_call(where: str, call) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(where, 'must be {"id", "type": "function", "function": {"name", '
                           '"arguments"}}')
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise RequestError(f"{where}.function.arguments", f"is not JSON: {args!r}") from None
    return {**call, "function": {**fn, "arguments": args}}


def _checked_ids(ids, vocab_size: int) -> list[int]:
    """A list of ints (numpy integers and arrays welcome) inside the vocabulary."""
    if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__len__"):
        raise RequestError("token_ids", "give a non-empty list of token ids")
    if not len(ids):
        raise RequestError("token_ids", "the prompt is empty: give at least one token id")
    out = []
    for i, tok in enumerate(ids):
        if isinstance(tok, (bool, np.bool_)) or not isinstance(tok, (int, np.integer)) \
                or not 0 <= tok < vocab_size:
            raise RequestError(f"token_ids[{i}]", f"token id {tok!r} is outside the vocabulary "
                               f"[0, {vocab_size})")
        out.append(int(tok))
    return out
