"""The assistant's answer of a chat request with tools, in OpenAI's shapes: the calls found in
(or forced on) the output as `message.tool_calls`, whole (`message`) or as stream deltas
(`ToolCallStream`), for the HTTP front end and batch jobs.

A named `tool_choice` makes the whole output the arguments; "required" makes it a JSON array
of {"name", "parameters"}, one call per item; "auto" hands it to a tool-call parser
(`tool_parsers`). Calls found turn a "stop" into finish_reason "tool_calls" (a "length" stays:
the arguments may be cut short). Streamed, a named call's arguments go out as the tokens come;
"required" calls one by one as their names and arguments come; "auto" calls whole, each once
it is closed (hermes: at its `</tool_call>`; llama3_json: at the end), and an "auto" answer's
text as soon as it can no longer be the start of a call. The streamed pieces concatenate to
the whole response's content and arguments.
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
    """One call per item of the array (as far as the output got: a cut-short last item is a
    call with the arguments it has, as a cut-short named call is)."""
    array = CallArray()
    array.feed(text)
    calls = tuple(ToolCall(name, args) for name, args in array.calls())
    return Parsed(None, calls) if calls else Parsed(text)


class CallArray:
    """Reads a "required" answer, `[{"name": ..., "parameters": {...}}, ...]`, as it grows:
    each item's name and its parameters' raw text (their span of the output, not a
    re-serialization, so that streamed and whole arguments are the same text)."""

    def __init__(self):
        self.text, self.depth = "", 0
        self.in_string = self.escape = False
        self.string_start = 0
        self.key: str | None = None  # the item's key being read or last read
        self.expect_key = False
        self.items: list[list] = []  # per item: [name, parameters' start, their end]

    def feed(self, text: str) -> None:
        start, self.text = len(self.text), self.text + text
        for i in range(start, len(self.text)):
            self._char(i, self.text[i])

    def calls(self) -> list[tuple[str, str]]:
        """(name, arguments so far) of the items whose name has been read."""
        return [(name, self._arguments(start, end)) for name, start, end in self.items
                if name is not None]

    def _arguments(self, start: int | None, end: int | None) -> str:
        if start is None:
            return ""
        return self.text[start:len(self.text) if end is None else end].lstrip()

    def _char(self, i: int, c: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.depth == 2:
                    self._string(json.loads(self.text[self.string_start:i + 1]))
        elif c == '"':
            self.in_string, self.string_start = True, i
        elif c in "[{":
            self.depth += 1
            if self.depth == 2 and c == "{":
                self.items.append([None, None, None])
                self.expect_key = True
        elif c in "]}":
            if self.depth == 2:
                self._value_end(i)
            self.depth -= 1
        elif self.depth == 2 and c == ",":
            self._value_end(i)
            self.expect_key = True
        elif self.depth == 2 and c == ":":
            self.expect_key = False
            if self.key == "parameters":
                self.items[-1][1] = i + 1

    def _string(self, value: str) -> None:
        """A string at an item's own level: a key, or the item's name."""
        if self.expect_key:
            self.key = value
        elif self.key == "name" and self.items:
            self.items[-1][0] = value

    def _value_end(self, i: int) -> None:
        if self.key == "parameters" and self.items and self.items[-1][2] is None:
            self.items[-1][2] = i
        self.key = None


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
        self.array = CallArray()  # named: one call; "required": the calls so far
        self.args_sent: list[int] = []  # per call out: how much of its arguments went out
        self.calls_sent, self.closed_at = 0, 0  # "auto": calls out; text read for them

    def step(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """(the delta's fields, finish_reason) for `text`, the choice's next piece of output;
        `reason` is set on its last."""
        self.text += text
        if self.tools.constrained:
            return self._forced(text, reason)
        if reason is not None:
            return self._last(reason)
        if self.tools.choice == "none":
            return self._content(len(self.text)), None
        fields = self._content(self.parser.content_end(self.text))  # "auto"
        return {**fields, **self._closed_calls()}, None

    def _closed_calls(self) -> dict:
        """An "auto" answer's calls closed since the last delta, whole."""
        end = self.parser.calls_end(self.text)
        if end == self.closed_at:
            return {}
        self.closed_at = end
        calls = parse(self.text[:end], self.tools, self.parser_name).calls[self.calls_sent:]
        if not calls:
            return {}
        first, self.calls_sent = self.calls_sent, self.calls_sent + len(calls)
        return {"tool_calls": wire_calls(calls, first)}

    def _forced(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        if self.tools.choice == "named":
            calls = [(self.tools.name, self.text)]
        else:
            self.array.feed(text)
            calls = self.array.calls()
        fields = self._calls(calls)
        if reason is not None and not self.args_sent:  # cut short before a call: text
            return self._last(reason)
        return fields, "tool_calls" if reason == "stop" else reason

    def _calls(self, calls: list[tuple[str, str]]) -> dict:
        """The new part of forced calls: a call's header with its first arguments, then its
        arguments as they come."""
        out = []
        for i, (name, args) in enumerate(calls):
            if i == len(self.args_sent):
                self.args_sent.append(len(args))
                out += wire_calls([ToolCall(name, args)], i)
            elif len(args) > self.args_sent[i]:
                out.append({"index": i, "function": {"arguments": args[self.args_sent[i]:]}})
                self.args_sent[i] = len(args)
        return {"tool_calls": out} if out else {}

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
        if parsed.calls[self.calls_sent:]:
            fields["tool_calls"] = wire_calls(parsed.calls[self.calls_sent:], self.calls_sent)
        return fields, finish(reason, parsed)
