"""The OpenAI batch format: request lines in, result records out.

In:  {"custom_id": str, "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
      "body": {...}}  -- one prompt per line, no streaming; bodies are read by
      jaxpipe.request.openai, the same reader as the HTTP front end's.
Out: {"id", "custom_id", "response": {"status_code": 200, "request_id", "body": {...}},
      "error": null}, or {"id", "custom_id", "response": null, "error": {"code", "message",
      "param"}} (plus "line" for lines that could not be read as a request).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from jaxpipe.request.errors import RequestError
from jaxpipe.request.openai import CHAT_URL, COMPLETIONS_URL, Body, body_key, read_body
from jaxpipe.request.outputs import Completion
from jaxpipe.request.tool_calls import message
from jaxpipe.request.tools import ToolRequest

LINE_KEYS = {"custom_id", "method", "url", "body"}


@dataclass(frozen=True)
class BatchLine:
    """One readable request line: where it came from and what it asks for."""

    line: int
    custom_id: str
    url: str
    model: str
    kind: str  # "text" | "chat" | "token_ids"
    prompt: object
    sampling: dict
    tools: ToolRequest | None = None  # chat: the functions offered (request/tools.py)

    @property
    def template_vars(self) -> dict | None:
        return None if self.tools is None else self.tools.template_vars()


@dataclass(frozen=True)
class Finished:
    """A completed request, from either runner."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    logprobs: list | None  # per token [[id, logprob], ...], sampled token first
    others: tuple[Finished, ...] = ()  # n > 1: samples 1..n-1 (this one is sample 0)

    @classmethod
    def of(cls, c: Completion, *others: Completion) -> Finished:
        """The record of a finished Completion, and of its request's other samples (how both
        in-process and serving runners build it)."""
        return cls(c.prep.prompt_token_ids, c.token_ids, c.text, c.finish_reason, c.stop_reason,
                   c.requested_logprobs, tuple(cls.of(o) for o in others))

    @property
    def samples(self) -> tuple[Finished, ...]:
        return (self, *self.others)

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)


@dataclass(frozen=True)
class Failed:
    """A request refused by validation (code "invalid_argument") or by the server."""

    code: str
    message: str
    param: str | None

    @classmethod
    def from_error(cls, e: RequestError) -> Failed:
        return cls("invalid_argument", e.message, body_field(e.field))


def parse_line(raw: dict, line: int) -> BatchLine:
    """A decoded JSON line -> BatchLine, or RequestError naming the offending key."""
    if not isinstance(raw, dict):
        raise RequestError("line", "each line must be a JSON object")
    unknown = sorted(set(raw) - LINE_KEYS)
    if unknown:
        raise RequestError(unknown[0], f"unknown key; a line has {sorted(LINE_KEYS)}")
    cid = raw.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise RequestError("custom_id", "every line needs a non-empty string custom_id")
    if raw.get("method", "POST") != "POST":
        raise RequestError("method", f"only POST is supported, got {raw.get('method')!r}")
    url, body = raw.get("url"), raw.get("body")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise RequestError("url", f"must be {CHAT_URL} or {COMPLETIONS_URL}, got {url!r}")
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    b = parse_body(url, body)
    return BatchLine(line, cid, url, str(body.get("model", "")), b.kind, b.prompts[0],
                     b.sampling, b.tools)


def parse_body(url: str, body: dict) -> Body:
    """A batch line's body, read: one prompt, no streaming; errors name the key as
    "body.<key>"."""
    try:
        b = read_body(url, body)
        if b.stream:
            raise RequestError("stream", "streaming is not available in batch jobs")
        if len(b.prompts) != 1:
            raise RequestError("prompt", "a batch line holds one prompt; give each its own line")
        if b.echo:
            raise RequestError("echo", "echo is not available in batch jobs")
    except RequestError as e:
        raise RequestError(f"body.{e.field}", e.message) from None
    return b


def body_field(field: str) -> str:
    """A validation error's field (as `validate.prepare` names it) -> the request body's key."""
    key = body_key(field)
    return field if key is None else f"body.{key}"


def success_record(item: BatchLine, result: Finished, model: str,
                   tool_call_parser: str = "hermes") -> dict:
    """The output record of a completed request (`model`: the body's model, else the engine's;
    `tool_call_parser`: how an "auto" tool choice's answer is read for calls)."""
    rid = f"req_{uuid.uuid4().hex[:24]}"
    usage = {"prompt_tokens": len(result.prompt_token_ids),  # once for its n samples
             "completion_tokens": result.completion_tokens,
             "total_tokens": len(result.prompt_token_ids) + result.completion_tokens}
    chat = item.url == CHAT_URL
    body = ({"id": f"chatcmpl-{rid}", "object": "chat.completion"} if chat else
            {"id": f"cmpl-{rid}", "object": "text_completion"})
    body.update(created=int(time.time()), model=item.model or model,
                choices=[_choice(i, s, chat, item.tools, tool_call_parser)
                         for i, s in enumerate(result.samples)], usage=usage)
    return {"id": f"batch_{rid}", "custom_id": item.custom_id,
            "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}


def _choice(index: int, result: Finished, chat: bool, tools: ToolRequest | None,
            parser: str) -> dict:
    choice = {"index": index, "finish_reason": result.finish_reason,
              "stop_reason": result.stop_reason, "token_ids": result.token_ids,
              "logprobs": _logprobs(result.logprobs)}
    if chat and tools is not None:
        choice["message"], choice["finish_reason"] = message(
            result.text, result.finish_reason, tools, parser)
    elif chat:
        choice["message"] = {"role": "assistant", "content": result.text}
    else:
        choice["text"] = result.text
    return choice


def error_record(custom_id: str | None, code: str, message: str, param: str | None,
                 line: int | None = None) -> dict:
    """The output record of a request that failed (line is set for unreadable lines)."""
    record = {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": custom_id,
              "response": None, "error": {"code": code, "message": message, "param": param}}
    if line is not None:
        record["line"] = line
    return record


def _logprobs(entries) -> dict | None:
    """Per-token logprobs as {"content": [{"token_id", "logprob", "top_logprobs"}]}; the top list
    holds the top-N tokens and the sampled one, most likely first."""
    if entries is None:
        return None
    content = []
    for per_token in entries:
        tok, lp = per_token[0]
        top = sorted(per_token, key=lambda e: -e[1])
        content.append({"token_id": tok, "logprob": lp,
                        "top_logprobs": [{"token_id": t, "logprob": v} for t, v in top]})
    return {"content": content}
