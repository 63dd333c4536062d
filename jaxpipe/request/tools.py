"""`tools` and `tool_choice` of a chat request: which functions the model is offered (rendered
into the prompt by the chat template's `tools` variable, as HF's
`apply_chat_template(tools=...)` does) and how its answer becomes calls.

    "none"       tools rendered, the answer is text
    "auto"       (the default with tools) the model's own call format is parsed afterwards
                 (`tool_parsers`, chosen by the server's --tool-call-parser)
    "required"   the output is constrained to a JSON array of one or more
                 {"name": <a tool>, "parameters": <its arguments>} (vLLM's form)
    {"type": "function", "function": {"name": N}}
                 the output is constrained to N's `parameters` schema: the arguments

The constraint is a JSON schema in `SamplingParams.structured_outputs`, compiled by the engine
like any other; here a schema is only checked to compile (llguidance, no tokenizer needed) so
that a bad one is refused naming its tool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance

from jaxpipe.request.errors import RequestError

CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a tool that takes no arguments
_CONSTRAINT_KEYS = ("response_format", "structured_outputs")  # other output constraints


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools. `tools`: OpenAI's list, as the chat template gets it;
    `choice`: one of CHOICES or "named" (then `name` is the tool); `parallel`: whether the
    answer may hold more than one call (`parallel_tool_calls`)."""

    tools: list
    choice: str
    name: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")

    def parameters(self, name: str) -> dict:
        return next(t["function"].get("parameters") or EMPTY_PARAMETERS
                    for t in self.tools if t["function"]["name"] == name)

    def schema(self) -> dict | None:
        """The JSON schema the output is constrained to (None: free output)."""
        if self.choice == "named":
            return self.parameters(self.name)
        if self.choice != "required":
            return None
        items = [{"type": "object", "properties": {
            "name": {"type": "string", "enum": [t["function"]["name"]]},
            "parameters": self.parameters(t["function"]["name"])},
            "required": ["name", "parameters"], "additionalProperties": False}
            for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        return schema if self.parallel else {**schema, "maxItems": 1}

    def template_vars(self) -> dict:
        """What the chat template is rendered with."""
        return {"tools": self.tools}


def read_tools(body: dict) -> ToolRequest | None:
    """The tools of a chat body (None: no tools), or RequestError naming the key."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls", f"must be true or false, got {parallel!r}")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise RequestError("tool_choice", f"{json.dumps(choice)} needs tools; give the "
                               "functions in tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("tools", f"must be a list of tools, got {tools!r}")
        return None
    _check_tools(tools)
    choice, name = _choice(choice, [t["function"]["name"] for t in tools])
    request = ToolRequest(tools, choice, name, parallel is not False)
    if request.constrained:
        _check_alone(body, choice)
    return request


def _check_tools(tools) -> None:
    if not isinstance(tools, list):
        raise RequestError("tools", f"must be a list of tools, got {tools!r}")
    seen = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise RequestError(where, 'each tool is {"type": "function", "function": {"name", '
                               '"description", "parameters"}}')
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}.function.name", f"must be a non-empty string, got "
                               f"{name!r}")
        if name in seen:
            raise RequestError(f"{where}.function.name", f"{name!r} is given twice")
        seen.add(name)
        if not isinstance(fn.get("description", ""), str):
            raise RequestError(f"{where}.function.description", "must be a string")
        if fn.get("parameters") is not None:
            _check_schema(f"{where}.function.parameters", fn["parameters"])


def _check_schema(where: str, schema) -> None:
    """RequestError unless `schema` is a JSON schema object the grammar engine compiles."""
    if not isinstance(schema, dict):
        raise RequestError(where, f"must be a JSON schema (an object), got {schema!r}")
    error = llguidance.LLMatcher.validate_grammar(
        llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
    if error:
        raise RequestError(where, f"is not a JSON schema this server can constrain to: {error}")


def _choice(choice, names: list[str]) -> tuple[str, str | None]:
    """tool_choice -> (one of CHOICES or "named", the named tool)."""
    if choice is None:
        return "auto", None
    if isinstance(choice, str) and choice in CHOICES:
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or choice.get("type", "function") != "function" \
            or not isinstance(fn.get("name"), str):
        raise RequestError("tool_choice", f'must be "none", "auto", "required" or '
                           f'{{"type": "function", "function": {{"name": ...}}}}, got '
                           f"{json.dumps(choice)}")
    if fn["name"] not in names:
        raise RequestError("tool_choice", f"names the tool {fn['name']!r}, which is not in "
                           f"tools; given: {', '.join(names)}")
    return "named", fn["name"]


def _check_alone(body: dict, choice: str) -> None:
    """A forced call constrains the output: no second constraint."""
    for key in _CONSTRAINT_KEYS:
        value = body.get(key)
        if value is not None and value != {"type": "text"}:
            raise RequestError(key, f"cannot be combined with tool_choice {choice!r}, which "
                               "already constrains the output to a tool call")
