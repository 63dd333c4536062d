"""The JSON the HTTP front end answers with, in OpenAI's shapes: whole responses, SSE chunks,
logprobs, usage and errors. Plain dicts; no I/O and no engine state.

Logprobs arrive from the engine per token as [[token id, logprob], ...] with the sampled token
first and then the top alternatives (`messages.TokenDelta`); token strings are the token's own
decoded text (special tokens kept), as vLLM reports them.
"""

from __future__ import annotations

from jaxpipe.request.openai import CHAT_URL

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """{"error": {"message", "type", "param", "code"}} as OpenAI's API returns it."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(url: str, rid: str, model: str, created: int, choices: list, *,
             chunk: bool = False) -> dict:
    """The outer object of a response (chunk=False) or of one SSE chunk."""
    if url == CHAT_URL:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}


def choice(url: str, index: int, text: str, finish_reason: str | None, logprobs: dict | None,
           *, chunk: bool = False, first: bool = False, fields: dict | None = None) -> dict:
    """One entry of `choices`: a chat message (or chunk delta) or a completion's text.
    `fields`: the chat message's (or delta's) fields instead of {"content": text} (tool
    calls: `request.tool_calls`)."""
    out: dict = {"index": index}
    fields = {"content": text} if fields is None else fields
    if url != CHAT_URL:
        out["text"] = text
    elif chunk:
        out["delta"] = {"role": "assistant", **fields} if first else fields
    else:
        out["message"] = {"role": "assistant", **fields}
    out["logprobs"] = logprobs
    out["finish_reason"] = finish_reason
    return out


def logprobs(url: str, entries: list, top: int, tokenizer, text_offset: int = 0) -> dict | None:
    """The engine's per-token entries -> the logprobs object of `url`'s choices (None: none)."""
    if not entries:
        return None
    if url == CHAT_URL:
        return _chat_logprobs(entries, top, tokenizer)
    return _completion_logprobs(entries, tokenizer, text_offset)


def _token(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([int(token_id)], skip_special_tokens=False)


def _entry(tokenizer, token_id: int, logprob: float) -> dict:
    text = _token(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _chat_logprobs(entries: list, top: int, tokenizer) -> dict:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}; top_logprobs holds
    the `top` most likely tokens, most likely first."""
    content = []
    for per_token in entries:
        tok, lp = per_token[0]
        best = sorted(per_token, key=lambda e: -e[1])[:top]
        content.append({**_entry(tokenizer, tok, lp),
                        "top_logprobs": [_entry(tokenizer, t, v) for t, v in best]})
    return {"content": content}


def echo_logprobs(prompt_ids: list[int], entries: list, tokenizer, text_offset: int = 0
                  ) -> dict:
    """An echoed prompt's part of a completion's logprobs (OpenAI's legacy shape, which
    lm-evaluation-harness reads): its tokens, their logprobs and alternatives (None for the
    first token), and text offsets. `entries`: per prompt token, None or [[id, logprob], ...]
    with the prompt's token first (`messages.TokenDelta.prompt_logprobs`)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, per_token in zip(prompt_ids, entries, strict=True):
        text = _token(tokenizer, token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if per_token is None else per_token[0][1])
        out["top_logprobs"].append(None if per_token is None else {
            _token(tokenizer, t): v for t, v in per_token})
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def joined(first: dict, then: dict | None) -> dict:
    """Two completion logprobs objects one after the other (`then` None: none)."""
    return first if then is None else {k: first[k] + then[k] for k in first}


def _completion_logprobs(entries: list, tokenizer, text_offset: int) -> dict:
    """{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for per_token in entries:
        tok, lp = per_token[0]
        text = _token(tokenizer, tok)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({_token(tokenizer, t): v for t, v in per_token})
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out
