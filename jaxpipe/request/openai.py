"""OpenAI request bodies (`/v1/chat/completions`, `/v1/completions`) -> what `validate.prepare`
takes: the prompt kind, one or more prompts, and `SamplingParams` fields.

The one reader of OpenAI bodies, for the HTTP front end (jaxpipe.serve.http) and batch lines
(jaxpipe.batch.openai). Sampling fields use OpenAI's names plus vLLM's extras (top_k, min_p,
repetition_penalty, min_tokens, stop_token_ids, ignore_eos, skip_special_tokens,
allowed_token_ids, bad_words, truncate_prompt_tokens, include_stop_str_in_output; best_of is
read to be refused unless it equals n); logit_bias keys are token ids as strings; a key this
server does not know is refused, never silently ignored. Errors name the body key
(`RequestError.field`, e.g. "messages" or "stream_options.include_usage").

Structured outputs, on both URLs: OpenAI's `response_format` (`{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}`, `{"type": "json_object"}`, `{"type": "text"}`)
and vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) become
SamplingParams.structured_outputs; one constraint per request. Whether it compiles is
`validate.prepare`'s question (it has the tokenizer); its errors name "structured_outputs.<kind>".
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxpipe.request.errors import RequestError
from jaxpipe.request.params import STRUCTURED_KINDS
from jaxpipe.request.tools import ToolRequest, read_tools

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
# OpenAI / vLLM body key -> SamplingParams field (the same name unless listed).
SAMPLING_KEYS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
                 "temperature": "temperature", "top_p": "top_p", "n": "n", "stop": "stop",
                 "seed": "seed", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens",
                 "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
                 "skip_special_tokens": "skip_special_tokens"}
SAMPLING_KEYS.update({k: k for k in (
    "logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
    "include_stop_str_in_output", "best_of")})
_COMMON_KEYS = {"model", "user", "stream", "stream_options", "response_format",
                "structured_outputs"}
RESPONSE_FORMATS = ("json_schema", "json_object", "text")
JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}  # response_format.json_schema
CHAT_KEYS = set(SAMPLING_KEYS) | _COMMON_KEYS | {"messages", "logprobs", "top_logprobs"}
CHAT_KEYS |= {"tools", "tool_choice", "parallel_tool_calls"}  # request/tools.py
COMPLETION_KEYS = ((set(SAMPLING_KEYS) - {"max_completion_tokens"}) | _COMMON_KEYS
                   | {"prompt", "logprobs", "echo"})


@dataclass(frozen=True)
class Body:
    """What one request body asks for. `prompts` has one entry per prompt (a completion body may
    list several; a chat body is one conversation)."""

    kind: str  # "text" | "chat" | "token_ids"
    prompts: list
    sampling: dict
    model: str | None
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    echo: bool  # completions: the prompt's text before the completion's
    top_logprobs: int | None  # how many alternatives each token's logprobs list (None: off)
    tools: ToolRequest | None = None  # chat: the functions offered and how calls are made

    @property
    def template_vars(self) -> dict | None:
        """What a chat prompt's template is rendered with beyond its messages."""
        return None if self.tools is None else self.tools.template_vars()


def read_body(url: str, body: dict) -> Body:
    """A decoded body of `url` -> Body, or RequestError naming the offending key."""
    if not isinstance(body, dict):
        raise RequestError("body", "the request body must be a JSON object")
    allowed = CHAT_KEYS if url == CHAT_URL else COMPLETION_KEYS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(unknown[0], f"unknown key for {url}; accepted: "
                           f"{', '.join(sorted(allowed))}")
    # null means "not given": SamplingParams' default applies (as for an absent key)
    sampling = {SAMPLING_KEYS[k]: v for k, v in body.items()
                if k in SAMPLING_KEYS and v is not None}
    sampling.update(structured_outputs(body))
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model", f"must be a string, got {model!r}")
    stream, include_usage = _stream_flags(body)
    if url == CHAT_URL:
        kind, prompts, top = _chat(body)
        echo = False
    else:
        kind, prompts, top = _completion(body)
        echo = _flag(body, "echo")
    if top is not None:
        sampling["logprobs"] = top
    tools = read_tools(body) if url == CHAT_URL else None
    if tools is not None and tools.constrained:
        sampling["structured_outputs"] = {"json": tools.schema()}
    if echo and (top is not None or sampling.get("max_tokens") == 0):
        sampling["prompt_logprobs"] = top or 0  # the echoed prompt's logprobs; max_tokens=0
        # scores the prompt without generating
    return Body(kind, prompts, sampling, model, stream, include_usage, echo, top, tools)


def _flag(body: dict, key: str, where: str | None = None) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise RequestError(where or key, f"must be true or false, got {value!r}")
    return bool(value)


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream, options = _flag(body, "stream"), body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise RequestError("stream_options", "only allowed when stream is true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError("stream_options", "give {\"include_usage\": true | false}")
    return stream, _flag(options, "include_usage")


def structured_outputs(body: dict) -> dict:
    """{"structured_outputs": {kind: value}} from the body's response_format or
    structured_outputs (nothing when neither constrains the output)."""
    fmt, so = _response_format(body.get("response_format")), body.get("structured_outputs")
    if so is None:
        return {} if fmt is None else {"structured_outputs": fmt}
    if fmt is not None:
        raise RequestError("structured_outputs", "give one constraint: response_format or "
                           "structured_outputs, not both")
    if not isinstance(so, dict):
        raise RequestError("structured_outputs", f"must be an object with one of "
                           f"{', '.join(STRUCTURED_KINDS)}, got {so!r}")
    unknown = sorted(set(so) - set(STRUCTURED_KINDS))
    if unknown:
        raise RequestError(f"structured_outputs.{unknown[0]}", f"unknown key; accepted: "
                           f"{', '.join(STRUCTURED_KINDS)}")
    return {"structured_outputs": so}  # SamplingParams checks it holds exactly one


def _response_format(fmt) -> dict | None:
    """OpenAI's response_format -> StructuredOutputsParams fields (None for "text")."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in RESPONSE_FORMATS:
        got = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise RequestError("response_format.type", f"must be one of "
                           f"{', '.join(RESPONSE_FORMATS)}, got {got!r}")
    kind = fmt["type"]
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    unknown = sorted(set(fmt) - allowed)
    if unknown:
        raise RequestError(f"response_format.{unknown[0]}", f"unknown key for type {kind!r}; "
                           f"accepted: {', '.join(sorted(allowed))}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    return {"json": _json_schema(fmt.get("json_schema"))}


def _json_schema(spec) -> dict | bool:
    """The schema of response_format.json_schema ({"name", "schema", "strict",
    "description"}); `strict` may be true or false: the output is always held to the schema."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise RequestError(where, "give {\"name\": ..., \"schema\": {...}, \"strict\": true}")
    unknown = sorted(set(spec) - JSON_SCHEMA_KEYS)
    if unknown:
        raise RequestError(f"{where}.{unknown[0]}", f"unknown key; accepted: "
                           f"{', '.join(sorted(JSON_SCHEMA_KEYS))}")
    for key in ("name", "description"):
        if key in spec and not isinstance(spec[key], str):
            raise RequestError(f"{where}.{key}", f"must be a string, got {spec[key]!r}")
    _flag(spec, "strict", f"{where}.strict")
    schema = spec.get("schema")
    if not isinstance(schema, dict | bool):
        raise RequestError(f"{where}.schema", f"must be a JSON schema (an object), got "
                           f"{schema!r}")
    return schema


def _chat(body: dict) -> tuple[str, list, int | None]:
    if "messages" not in body:
        raise RequestError("messages", "a chat request needs messages")
    top = body.get("top_logprobs")
    if top is not None and not body.get("logprobs"):
        raise RequestError("top_logprobs", "only allowed when logprobs is true")
    return "chat", [body["messages"]], (top or 0) if _flag(body, "logprobs") else None


def _completion(body: dict) -> tuple[str, list, int | None]:
    if "prompt" not in body:
        raise RequestError("prompt", "a completion request needs a prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        kind, prompts = "text", [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        kind, prompts = "text", prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        kind, prompts = "token_ids", prompt
    elif isinstance(prompt, list):
        kind, prompts = "token_ids", [prompt]
    else:
        raise RequestError("prompt", "must be a string, a list of strings, a list of token "
                           "ids or a list of lists of token ids")
    return kind, prompts, body.get("logprobs")


def body_key(field: str) -> str | None:
    """A validation error's field (as `validate.prepare` names it) -> the body key it is about
    (None when the error is not about one key)."""
    head, _, rest = field.partition(".")
    if head == "sampling":
        return rest
    for ours, theirs in (("text", "prompt"), ("token_ids", "prompt"), ("chat", "messages")):
        if field.startswith(ours):
            return theirs + field[len(ours):]
    return None
