"""The request side of tool calling: checking `tools` and `tool_choice`, and what a forced call must look like.

    check_tools(tools)                      -> {name: parameters schema}; ToolError naming the field when a
                                               definition is unusable (no name, parameters not an object schema)
    resolve_tool_choice(choice, tools, auto_enabled) -> ToolChoice (mode none/auto/required/named + the name);
                                               ToolError for an unknown name, "auto" without the server flags
    arguments_schema(parameters)            -> the JSON schema a call's arguments must satisfy

The format a forced call (`required`, a named function) must take in the model's own markup is the tool-call
parser's business: `ToolCallParser.structural_tag(...)` (tool_calls.py) builds it for structured decoding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# what a tool name may hold: it is written into the prompt and into the model's markup (M3: <invoke name="...">),
# so quotes, angle brackets and whitespace would break the format
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


class ToolError(ValueError):
    """A bad tool definition or tool_choice; `param` is the request field it names (e.g. tools[1].function.name)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function, for "named"

    @property
    def parses_calls(self) -> bool:
        """Whether the output is read for tool calls (not for "none": the calls then stay content)."""
        return self.mode != "none"

    @property
    def forced(self) -> bool:
        """Whether structured decoding must make the model call a tool."""
        return self.mode in ("required", "named")


def check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    """The request's function tools ({"type": "function", "function": {"name", "description", "parameters"}})
    checked: name -> parameters schema (None when the tool takes no parameters)."""
    out: dict[str, dict[str, Any] | None] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ToolError(where, "must be an object")
        if tool.get("type", "function") != "function":
            raise ToolError(f"{where}.type", f"only 'function' tools are supported (got {tool.get('type')!r})")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function", "this field is required (an object with a name)")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError(f"{where}.function.name", "this field is required (a non-empty string)")
        if not TOOL_NAME.fullmatch(name):
            raise ToolError(f"{where}.function.name", f"{name[:40]!r} is not a valid tool name (letters, digits, "
                                                     f"'_', '-', '.', ':'; at most 128)")
        if name in out:
            raise ToolError(f"{where}.function.name", f"two tools are named {name!r}")
        out[name] = check_parameters(fn.get("parameters"), f"{where}.function.parameters")
    return out


def check_parameters(params: Any, where: str) -> dict[str, Any] | None:
    """A tool's `parameters`: a JSON schema of an object (or absent)."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ToolError(where, "must be a JSON schema object")
    kind = params.get("type", "object")
    if kind != "object":
        raise ToolError(f"{where}.type", f"must be 'object': a tool takes named arguments (got {kind!r})")
    props = params.get("properties", {})
    if not isinstance(props, dict):
        raise ToolError(f"{where}.properties", "must be an object mapping each parameter to its schema")
    for key, schema in props.items():
        if not isinstance(schema, (dict, bool)):
            raise ToolError(f"{where}.properties.{key}", "must be a JSON schema (an object)")
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ToolError(f"{where}.required", "must be a list of parameter names")
    return params


def resolve_tool_choice(choice: Any, tools: dict[str, Any] | None, auto_enabled: bool) -> ToolChoice:
    """The request's tool_choice (vLLM's rules: the default is "auto" when tools are given, else "none";
    "auto" needs --enable-auto-tool-choice and --tool-call-parser; "required" with no tools is "none")."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolChoice("none")
    if tools is None:
        raise ToolError("tool_choice", "when tool_choice is set, tools must be set too")
    if choice == "auto":
        if not auto_enabled:
            raise ToolError("tool_choice", '"auto" tool choice requires --enable-auto-tool-choice and '
                                           '--tool-call-parser to be set')
        return ToolChoice("auto")
    if choice == "required":
        return ToolChoice("required") if tools else ToolChoice("none")
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise ToolError("tool_choice", 'a named tool choice is {"type": "function", "function": {"name": '
                                           '"my_function"}}')
        if name not in tools:
            raise ToolError("tool_choice.function.name", f"{name!r} is not one of the request's tools "
                                                         f"({', '.join(sorted(tools)) or 'none'})")
        return ToolChoice("named", name)
    raise ToolError("tool_choice", f'must be "none", "auto", "required" or a named function (got {choice!r})')


def arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON schema of a call's arguments object (a tool without parameters takes an empty object)."""
    if parameters is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return {"type": "object", **parameters}
