"""Tool-call parsers for `tool_choice: "auto"`: a model's own free text -> the calls it made and
the text left as the answer, by the format the model was trained to write calls in.

    parser = TOOL_PARSERS["hermes"]
    parsed = parser.parse(text)        # Parsed(content, calls)
    parser.content_end(text)           # how much of a partial text is surely plain answer
    parser.calls_end(text)             # how much of it holds only finished calls (and text)

`hermes`: Hermes / Qwen 2.5+ write `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, with free text around them. `llama3_json`: Llama 3.x answers a call with
the bare JSON `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`; several
calls separated by ";"). vLLM's parsers of the same names read the same forms. A block that is
not a call (bad JSON, no name) is left in the content, never dropped. `content_end` lets a
stream send the answer as it comes and hold back only what may still turn into a call;
`calls_end` lets it send each call once it is closed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Parsed:
    """What a model's output says: `content` (None when no text is left) and its calls."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


def _call(obj, args_key: str) -> ToolCall | None:
    """{"name": str, args_key: object | JSON text} -> ToolCall (None: not a call)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (it may become one)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesParser:
    """`<tool_call>{json}</tool_call>` blocks; the text outside them is the content."""

    start, end = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        calls, kept, at = [], [], 0
        for match in self._block.finditer(text):
            call = self._read(match.group(1))
            if call is None:
                continue  # not a call: its text stays in the content
            kept.append(text[at:match.start()])
            calls.append(call)
            at = match.end()
        if not calls:
            return Parsed(text)
        content = ("".join(kept) + text[at:]).rstrip()
        return Parsed(content if content.strip() else None, tuple(calls))

    @staticmethod
    def _read(body: str) -> ToolCall | None:
        try:
            return _call(json.loads(body), "arguments")
        except json.JSONDecodeError:
            return None

    def content_end(self, text: str) -> int:
        """Text before the first `<tool_call>` (or a partial one at the end), less trailing
        whitespace (dropped from the content of an answer with calls)."""
        found = text.find(self.start)
        end = found if found >= 0 else len(text) - _held_prefix(text, self.start)
        return len(text[:end].rstrip())

    def calls_end(self, text: str) -> int:
        """Up to the last `</tool_call>`: the calls there are the first calls of any longer
        text."""
        found = text.rfind(self.end)
        return found + len(self.end) if found >= 0 else 0


class Llama3JsonParser:
    """A whole answer of JSON calls `{"name": ..., "parameters": {...}}`, ";"-separated,
    optionally after `<|python_tag|>`; any other answer is content."""

    tag = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        if body.startswith(self.tag):
            body = body[len(self.tag):].lstrip()
        if not body.startswith("{"):
            return Parsed(text)
        calls = self._calls(body)
        return Parsed(None, calls) if calls else Parsed(text)

    @staticmethod
    def _calls(body: str) -> tuple[ToolCall, ...]:
        """Every call of `body`, or () unless all of it is calls."""
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return ()
            call = _call(obj, "parameters")
            if call is None:
                return ()
            calls.append(call)
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        return tuple(calls)

    def content_end(self, text: str) -> int:
        """All of it once it is surely not a call, else nothing."""
        head = text.lstrip()
        if not head or head.startswith(("{", self.tag)) or self.tag.startswith(head):
            return 0
        return len(text)

    @staticmethod
    def calls_end(text: str) -> int:
        """Nothing: a call's JSON may go on (another ";"-separated call) until the end."""
        return 0


TOOL_PARSERS = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}
