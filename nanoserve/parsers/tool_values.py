"""Typing a tool call's arguments by the tool's JSON schema.

Models that write tool calls as markup (M3: `<city>Paris</city>`, `<days>5</days>`) produce text, not JSON: every
value arrives as a string, or as nested elements for objects and arrays. The tool's `parameters` schema says what
each value is meant to be, so `5` becomes the number 5 for an integer parameter but stays the string "5" for a
string one. The rules (the ones vLLM's markup parsers apply):

    string            the text exactly as written (whitespace and all)
    integer / number  the text as a JSON number ("018956" -> 18956, "5.0" -> 5.0)
    boolean           true / false / 1 / 0, any case
    null, or the text "null" for any non-string type  -> null
    object / array    nested elements (an array takes every child, whatever its tag), or the text as JSON;
                      an empty value is {} / []
    anyOf / oneOf / a type list   the first alternative the value converts to
    no schema, or a value that does not convert   the text as a string; nested elements as an object, a tag
                      that repeats becoming a list

Values are never rejected here: a value the schema does not fit passes through untyped (the client's tool sees
what the model wrote). Enforcing the schema is structured decoding's job.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Union

MAX_SCHEMA_DEPTH = 32  # $ref chains and nesting beyond this are treated as "no schema" (a recursive schema ends)
INTEGER_TEXT = re.compile(r"[+-]?\d+")


@dataclass
class Element:
    """One markup element: <name>value</name>, where value is text or a list of child elements."""

    name: str
    value: Union[str, list["Element"]]


# -- the schema, normalized to what typing needs ---------------------------------------------------------------
@dataclass
class ValueType:
    """A parameter's type: kind is string / integer / number / boolean / null / object / array / any_of."""

    kind: str
    properties: dict[str, "ValueType"] = field(default_factory=dict)  # object
    additional: "ValueType | None" = None  # object: the type of undeclared keys
    items: "ValueType | None" = None  # array
    options: list["ValueType"] = field(default_factory=list)  # any_of

    def field(self, name: str) -> "ValueType | None":
        """An object's field: its declared type, else the type of undeclared keys."""
        return self.properties.get(name, self.additional)


TYPE_NAMES = {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean", "null": "null",
              "object": "object", "array": "array"}


def arguments_type(parameters: dict[str, Any] | None) -> ValueType | None:
    """The type of a call's arguments, from the tool's `parameters` schema (None: nothing usable)."""
    if not isinstance(parameters, dict):
        return None
    root = value_type(parameters, parameters, 0)
    return root if root is not None and root.kind == "object" else None


def declared_keys(parameters: dict[str, Any] | None) -> frozenset[str] | None:
    """The argument names a tool's `parameters` declare (its properties and required keys), or None when any name
    is welcome: an object schema that declares no properties, or one whose additionalProperties (or
    patternProperties) admits others. A tool without parameters takes no arguments."""
    if parameters is None:
        return frozenset()
    if not isinstance(parameters, dict):
        return None
    props = parameters.get("properties")
    extra = parameters.get("additionalProperties")
    if not isinstance(props, dict) or extra not in (None, False) or parameters.get("patternProperties"):
        return None
    required = parameters.get("required")
    return frozenset(props) | frozenset(r for r in required if isinstance(r, str)) \
        if isinstance(required, list) else frozenset(props)


def value_type(schema: Any, root: dict[str, Any], depth: int) -> ValueType | None:
    """Normalize one JSON schema (a subset: type, anyOf/oneOf, enum, const, items, properties,
    additionalProperties, local $ref). None when it says nothing usable."""
    if not isinstance(schema, dict) or depth > MAX_SCHEMA_DEPTH:
        return None
    if isinstance(schema.get("$ref"), str):
        return value_type(resolve_ref(schema["$ref"], root), root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        options = [t for t in (type_from_name(k, schema, root, depth) for k in kind) if t is not None]
        return one_of(options)
    if isinstance(kind, str):
        return type_from_name(kind, schema, root, depth)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return one_of([t for t in (value_type(s, root, depth + 1) for s in schema[key]) if t is not None])
    if isinstance(schema.get("enum"), list):
        return enum_type(schema["enum"])
    if "const" in schema:
        return enum_type([schema["const"]])
    if "items" in schema:
        return type_from_name("array", schema, root, depth)
    if "properties" in schema or "additionalProperties" in schema:
        return type_from_name("object", schema, root, depth)
    return None


def type_from_name(name: str, schema: dict[str, Any], root: dict[str, Any], depth: int) -> ValueType | None:
    kind = TYPE_NAMES.get(name.strip().lower())
    if kind == "object":
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        properties = {k: t for k, t in ((k, value_type(s, root, depth + 1)) for k, s in props.items())
                      if t is not None}
        extra = schema.get("additionalProperties")
        return ValueType("object", properties=properties,
                         additional=value_type(extra, root, depth + 1) if isinstance(extra, dict) else None)
    if kind == "array":
        return ValueType("array", items=value_type(schema.get("items"), root, depth + 1))
    return ValueType(kind) if kind is not None else None


def enum_type(values: list[Any]) -> ValueType:
    """An enum's values decide its type: all strings -> string, all numbers -> number, else the mix."""
    kinds = []
    for v in values:
        kind = "null" if v is None else "boolean" if isinstance(v, bool) else \
            "integer" if isinstance(v, int) else "number" if isinstance(v, float) else "string"
        if kind not in kinds:
            kinds.append(kind)
    # a string alternative goes last: "5" in an enum of [5, "auto"] is the number 5
    kinds.sort(key=lambda k: k == "string")
    return one_of([ValueType(k) for k in kinds]) or ValueType("string")


def one_of(options: list[ValueType]) -> ValueType | None:
    if not options:
        return None
    return options[0] if len(options) == 1 else ValueType("any_of", options=options)


def resolve_ref(ref: str, root: dict[str, Any]) -> Any:
    """A local JSON pointer (#/$defs/name); anything else resolves to nothing."""
    if not ref.startswith("#"):
        return None
    node: Any = root
    for part in ref[1:].split("/"):
        if not part:
            continue
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


# -- converting values ----------------------------------------------------------------------------------------
def convert(value: str | list[Element], vtype: ValueType | None) -> Any:
    """A parsed markup value as the JSON value its type asks for (see the module docstring)."""
    if isinstance(value, str) and value.strip().lower() == "null" and (vtype is None or vtype.kind != "string"):
        return None
    if vtype is not None:
        ok, converted = try_convert(value, vtype)
        if ok:
            return converted
    if isinstance(value, str):
        return value
    return elements_to_object(value, None)


def try_convert(value: str | list[Element], vtype: ValueType) -> tuple[bool, Any]:
    kind = vtype.kind
    if kind == "any_of":
        for option in vtype.options:
            ok, converted = try_convert(value, option)
            if ok:
                return True, converted
        return False, None
    if isinstance(value, list):  # nested elements: only containers can take them
        if kind == "object":
            return True, elements_to_object(value, vtype)
        if kind == "array":
            return True, [convert(e.value, vtype.items) for e in value]
        return False, None
    text = value
    if kind == "string":
        return True, text
    stripped = text.strip()
    if kind == "integer":
        return (True, int(stripped)) if INTEGER_TEXT.fullmatch(stripped) else (False, None)
    if kind == "number":
        return number(stripped)
    if kind == "boolean":
        low = stripped.lower()
        return (True, low in ("true", "1")) if low in ("true", "false", "1", "0") else (False, None)
    if kind == "null":
        return (True, None) if stripped.lower() == "null" else (False, None)
    if kind in ("object", "array"):
        if not stripped:
            return True, {} if kind == "object" else []
        try:
            parsed = json.loads(stripped)
        except ValueError:
            return False, None
        return (True, parsed) if isinstance(parsed, dict if kind == "object" else list) else (False, None)
    return False, None


def number(text: str) -> tuple[bool, Any]:
    if INTEGER_TEXT.fullmatch(text):
        return True, int(text)
    try:
        value = float(text)
    except ValueError:
        return False, None
    return (True, value) if math.isfinite(value) else (False, None)


def elements_to_object(elements: list[Element], vtype: ValueType | None) -> dict[str, Any]:
    """Child elements as an object, typed by the object's schema when there is one; a tag that repeats collects
    its values in a list."""
    out: dict[str, Any] = {}
    repeated: set[str] = set()
    for e in elements:
        t = vtype.field(e.name) if vtype is not None else None
        v = convert(e.value, t)
        if e.name not in out:
            out[e.name] = v
        elif e.name in repeated:
            out[e.name].append(v)
        else:
            out[e.name] = [out[e.name], v]
            repeated.add(e.name)
    return out
