"""The assistant's answer of a chat request with tools, in OpenAI's shapes: the calls found in
(or forced on) the output as `message.tool_calls`, whole (`message`) or as stream deltas
(`ToolCallStream`), for the HTTP front end and batch jobs.

A named `tool_choice` makes the whole output the arguments; "required" makes it a JSON array
of {"name", "parameters"}, one call per item; "auto" hands it to a tool-call parser
(`tool_parsers`). Calls found turn a "stop" into finish_reason "tool_calls" (a "length" stays:
the arguments may be cut short). Streamed, a named call's arguments go out as the tokens come;
"required" and "auto" calls go out whole once the output is complete, and an "auto" answer's
text goes out as soon as it can no longer be the start of a call. The streamed pieces
concatenate to the whole response's content and arguments.
"""

from __future__ import annotations

import json
import uuid

from jaxpipe.request.tool_parsers import TOOL_PARSERS, Parsed, ToolCall
from jaxpipe.request.tools import ToolRequest


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse(text: str, tools: ToolRequest, parser: str) -> Parsed:
    """The content and calls of a complete output."""
    if tools.choice == "named":
        return Parsed(None, (ToolCall(tools.name, text),))
    if tools.choice == "required":
        return _required(text)
    if tools.choice == "none":
        return Parsed(text)
    parsed = TOOL_PARSERS[parser].parse(text)
    return parsed if tools.parallel else Parsed(parsed.content, parsed.calls[:1])


def _required(text: str) -> Parsed:
    """A JSON array of {"name", "parameters"} -> one call per item (text as content if the
    output was cut short)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return Parsed(text)
    calls = tuple(ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                  for item in items if isinstance(item, dict) and "name" in item)
    return Parsed(None, calls) if calls else Parsed(text)


def finish(reason: str | None, parsed: Parsed) -> str | None:
    return "tool_calls" if parsed.calls and reason == "stop" else reason


def wire_calls(calls, first: int = 0) -> list[dict]:
    """Calls as OpenAI's `tool_calls` entries (with their stream `index`)."""
    return [{"index": i, "id": call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls, first)]


def message(text: str, reason: str | None, tools: ToolRequest, parser: str
            ) -> tuple[dict, str | None]:
    """(the choice's `message`, its finish_reason) for a complete output."""
    parsed = parse(text, tools, parser)
    out = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        out["tool_calls"] = [{k: v for k, v in c.items() if k != "index"}
                             for c in wire_calls(parsed.calls)]
    return out, finish(reason, parsed)


class ToolCallStream:
    """One choice's text deltas -> its chunk deltas ({"content"} and / or {"tool_calls"})."""

    def __init__(self, tools: ToolRequest, parser: str):
        self.tools, self.parser = tools, TOOL_PARSERS[parser]
        self.parser_name = parser
        self.text, self.sent = "", 0  # all the text so far; how much went out as content
        self.started = False  # a named call's header is out

    def step(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """(the delta's fields, finish_reason) for `text`, the choice's next piece of output;
        `reason` is set on its last."""
        self.text += text
        if self.tools.choice == "named":
            return self._named(text), "tool_calls" if reason == "stop" else reason
        if reason is not None:
            return self._last(reason)
        if self.tools.choice == "none":
            return self._content(len(self.text)), None
        if self.tools.choice == "auto":
            return self._content(self.parser.content_end(self.text)), None
        return {}, None  # "required": whole calls at the end

    def _named(self, text: str) -> dict:
        """The call's header with the first arguments, then the arguments as they come."""
        if not self.started:
            self.started = True
            return {"tool_calls": wire_calls([ToolCall(self.tools.name, text)])}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}

    def _content(self, end: int) -> dict:
        if end <= self.sent:
            return {}
        out, self.sent = self.text[self.sent:end], end
        return {"content": out}

    def _last(self, reason: str) -> tuple[dict, str | None]:
        """Whatever the complete output adds to what was sent: the rest of its content and
        its calls."""
        parsed = parse(self.text, self.tools, self.parser_name)
        fields = {}
        rest = (parsed.content or "")[self.sent:]
        if rest:
            fields["content"] = rest
        if parsed.calls:
            fields["tool_calls"] = wire_calls(parsed.calls)
        return fields, finish(reason, parsed)
