"""Tool-call parsers (`--tool-call-parser NAME`): the model's tool-call markup -> OpenAI `tool_calls`.

A parser reads the content part of one choice (after the reasoning parser took the thinking out) incrementally
and turns it into events:

    Text(text)                       ordinary content
    CallStart(index, name)           a call's header is complete: its name is known
    CallArguments(index, fragment)   the next piece of its `arguments` JSON string
    CallEnd(index)                   the call is complete (its arguments are a complete JSON object)

Concatenating a call's fragments gives its `arguments`, a JSON object typed by the tool's schema
(tool_values.py). The stream layer sends CallStart as the delta that carries the call's index, id, type and
name, and every fragment as a delta appending to `arguments`; the non-streaming answer is the same events
collected. Text that might still become a marker is held back until it is decided, so half a tag never reaches
the client as content.

MiniMax M3's format (`minimax_m3`). Every tag is prefixed by the namespace token NS = `]<]minimax[>[`; a block
holds one or more invokes, each parameter is an element named by the parameter, a nested object is its fields as
child elements, an array one `<item>` element per item:

    ]<]minimax[>[<tool_call>
    ]<]minimax[>[<invoke name="get_weather">]<]minimax[>[<city>Paris]<]minimax[>[</city>]<]minimax[>[</invoke>
    ]<]minimax[>[</tool_call>

What this parser does with output that strays from that (each case has a test):
- text before a block, and after it, is content (whitespace-only content is no content);
- whitespace between invokes and between parameters is skipped, as is stray text between parameters;
- a block that stops making sense (an unknown tag where an invoke should start, a closing tag that closes
  nothing) ends there: calls completed so far stay calls, the rest of the text from that point is content;
- output that ends inside a call (max_tokens) ends the call: its arguments hold the parameters that were complete;
  an unfinished header or marker at the very end is dropped, any other leftover is content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Union

from nanoserve.parsers.markers import is_proper_prefix, partial_prefix
from nanoserve.parsers.tool_values import Element, ValueType, convert, parameter_types, resolve_ref, value_type

if TYPE_CHECKING:
    from nanoserve.parsers.tools import ToolChoice


# -- events ---------------------------------------------------------------------------------------------------
@dataclass
class Text:
    text: str


@dataclass
class CallStart:
    index: int
    name: str


@dataclass
class CallArguments:
    index: int
    fragment: str


@dataclass
class CallEnd:
    index: int


Event = Union[Text, CallStart, CallArguments, CallEnd]


@dataclass
class ToolCall:
    """A complete call, as the non-streaming response carries it."""

    id: str
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's shape)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def collect(events: list[Event]) -> tuple[str, list[ToolCall]]:
    """Events -> (content, calls), as a non-streaming response needs them."""
    content, calls = [], {}
    for ev in events:
        if isinstance(ev, Text):
            content.append(ev.text)
        elif isinstance(ev, CallStart):
            calls[ev.index] = ToolCall(new_call_id(), ev.name, "")
        elif isinstance(ev, CallArguments):
            calls[ev.index].arguments += ev.fragment
    return "".join(content), [calls[i] for i in sorted(calls)]


# -- the parser interface and the registry ------------------------------------------------------------------
class ToolCallParser:
    """One choice's incremental tool-call parser. `tools` is the request's function list: name -> parameters
    schema (a call to a name not in it is still returned, its values untyped, as vLLM does)."""

    name = ""
    markers: tuple[str, ...] = ()
    """Strings the parser needs to see in the text: a tokenizer that treats one of them as a special token must
    decode with skip_special_tokens=False for this parser to work."""

    def __init__(self, tools: dict[str, dict[str, Any] | None]):
        self.types = {name: parameter_types(params) for name, params in tools.items()}

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole text at once (non-streaming): (content, calls)."""
        return collect(self.feed(text) + self.finish())

    @classmethod
    def structural_tag(cls, tools: dict[str, dict[str, Any] | None], choice: "ToolChoice",
                       parallel_tool_calls: bool = True) -> dict[str, Any]:
        """What the output must look like for a forced tool_choice (`required`, or `named` with choice.name), as an
        xgrammar structural tag ({"type": "structural_tag", "format": ...}). It describes the text after any
        reasoning: enforcement starts where the reasoning parser's content starts."""
        raise NotImplementedError(f"the {cls.name} parser cannot describe a forced call")


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {}


def register(cls: type[ToolCallParser]) -> type[ToolCallParser]:
    TOOL_CALL_PARSERS[cls.name] = cls
    return cls


def get_tool_call_parser(name: str) -> type[ToolCallParser]:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[name]


# -- MiniMax M3 -----------------------------------------------------------------------------------------------
NS = "]<]minimax[>["
BLOCK_START = NS + "<tool_call>"
BLOCK_END = NS + "</tool_call>"
INVOKE_START = NS + "<invoke"
INVOKE_END = NS + "</invoke>"
INVOKE_HEADER = re.compile(re.escape(INVOKE_START) + r"\s+name=(?:\"([^\"<>]*)\"|'([^'<>]*)'|([^\s\"'<>]+))\s*>")
MAX_NESTING = 64  # deeper element nesting is malformed (the parser recurses)
MAX_HEADER = 512  # an invoke header longer than this without its '>' is malformed


class Incomplete(Exception):
    """More text is needed to decide."""


class Malformed(Exception):
    """The text is not the format."""


def parse_element(s: str, pos: int, depth: int = 0) -> tuple[Element, int]:
    """The element starting at s[pos] (which starts with NS + '<'): (element, end position). Raises Incomplete
    when s ends before the element does, Malformed when it is not an element."""
    if depth > MAX_NESTING:
        raise Malformed("elements nested too deeply")
    start = pos + len(NS) + 1
    close = s.find(">", start)
    name = s[start:close] if close != -1 else s[start:]
    if name.startswith("/") or "<" in name or "\n" in name or (close != -1 and not name.strip()):
        raise Malformed(f"not an opening tag: {s[pos:close + 1] if close != -1 else s[pos:]!r}")
    if close == -1:
        raise Incomplete
    end_tag = f"{NS}</{name}>"
    pos = close + 1
    text: list[str] = []
    children: list[Element] = []
    while True:
        j = s.find(NS, pos)
        if j == -1:
            raise Incomplete
        text.append(s[pos:j])
        rest = s[j:j + len(end_tag)]
        if s.startswith(end_tag, j):
            pos = j + len(end_tag)
            break
        if len(rest) < len(end_tag) and end_tag.startswith(rest):
            raise Incomplete  # maybe our closing tag, not all here yet
        if s.startswith(NS + "</", j):
            raise Malformed(f"{s[j:s.find('>', j) + 1] or s[j:]!r} does not close <{name}>")
        if s.startswith(NS + "<", j):
            child, pos = parse_element(s, j, depth + 1)
            children.append(child)
            continue
        if is_proper_prefix(s[j:], NS + "<"):
            raise Incomplete
        raise Malformed("the namespace token outside a tag")
    body = "".join(text)
    if not children:
        return Element(name, body), pos
    if body.strip():  # text beside child elements is kept, under a key no child uses (vLLM's convention)
        key = "$text"
        while any(c.name == key for c in children):
            key = "$" + key
        children.append(Element(key, body))
    return Element(name, children), pos


@register
class MiniMaxM3ToolCallParser(ToolCallParser):
    """MiniMax M3's namespace-prefixed tool-call markup (see the module docstring)."""

    name = "minimax_m3"
    markers = (NS, "<tool_call>", "</tool_call>")

    def __init__(self, tools: dict[str, dict[str, Any] | None]):
        super().__init__(tools)
        self.buf = ""
        self.mode = "text"  # text | block | invoke
        self.index = -1  # the current (or last) call
        self.call_types: dict[str, ValueType] = {}
        self.args_open = False  # the current call has sent its "{"

    # each step looks at self.buf and returns (events, consumed?) - False means: wait for more text
    def feed(self, text: str) -> list[Event]:
        self.buf += text
        events: list[Event] = []
        step: dict[str, Callable[[list[Event]], bool]] = {
            "text": self._text, "block": self._block, "invoke": self._invoke}
        while self.buf and step[self.mode](events):
            pass
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self.mode == "invoke":  # the output ended inside a call: close it with the parameters that were whole
            self._end_call(events)
        elif self.mode == "text" and self.buf:  # the start of a marker that never came: it was content
            events.append(Text(self.buf))
        # in a block, what is left is an unfinished marker (anything else would have ended the block): dropped
        self.buf, self.mode = "", "text"
        return events

    # -- the three modes ------------------------------------------------------------------------------------
    def _text(self, events: list[Event]) -> bool:
        i = self.buf.find(BLOCK_START)
        if i == -1:
            keep = partial_prefix(self.buf, BLOCK_START)
            if len(self.buf) > keep:
                events.append(Text(self.buf[:len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
            return False
        if i:
            events.append(Text(self.buf[:i]))
        self.buf = self.buf[i + len(BLOCK_START):]
        self.mode = "block"
        return True

    def _block(self, events: list[Event]) -> bool:
        """Between invokes: whitespace, then an invoke or the end of the block."""
        rest = self.buf.lstrip()
        if not rest:
            return False
        if rest.startswith(BLOCK_END):
            self.buf = rest[len(BLOCK_END):]
            self.mode = "text"
            return True
        if rest.startswith(INVOKE_START):
            close = rest.find(">", len(INVOKE_START), MAX_HEADER)
            if close == -1:
                if len(rest) < MAX_HEADER:
                    return False
            else:
                m = INVOKE_HEADER.fullmatch(rest[:close + 1])
                name = next((g for g in m.groups() if g is not None), "").strip() if m else ""
                if name:
                    self.index += 1
                    self.call_types = self.types.get(name, {})
                    self.args_open = False
                    events.append(CallStart(self.index, name))
                    self.buf = rest[close + 1:]
                    self.mode = "invoke"
                    return True
        elif is_proper_prefix(rest, BLOCK_END, INVOKE_START):
            return False
        self._malformed(events)
        return True

    def _invoke(self, events: list[Event]) -> bool:
        """Inside an invoke: parameters (anything between them skipped) until its end tag."""
        j = self.buf.find(NS)
        if j == -1:
            self.buf = self.buf[len(self.buf) - partial_prefix(self.buf, NS):]  # stray text between parameters
            return False
        rest = self.buf[j:]
        if rest.startswith(INVOKE_END):
            self._end_call(events)
            self.buf = rest[len(INVOKE_END):]
            self.mode = "block"
            return True
        if is_proper_prefix(rest, INVOKE_END, NS + "<"):
            self.buf = rest
            return False
        if rest.startswith(NS + "</") or not rest.startswith(NS + "<"):
            self.buf = rest
            self._end_call(events)
            self._malformed(events)
            return True
        try:
            element, end = parse_element(rest, 0)
        except Incomplete:
            self.buf = rest
            return False
        except Malformed:
            self.buf = rest
            self._end_call(events)
            self._malformed(events)
            return True
        value = convert(element.value, self.call_types.get(element.name))
        sep = "," if self.args_open else "{"
        events.append(CallArguments(self.index, sep + json.dumps(element.name, ensure_ascii=False) + ":" +
                                    json.dumps(value, ensure_ascii=False, separators=(",", ":"))))
        self.args_open = True
        self.buf = rest[end:]
        return True

    def _end_call(self, events: list[Event]) -> None:
        events.append(CallArguments(self.index, "}" if self.args_open else "{}"))
        events.append(CallEnd(self.index))
        self.args_open = False

    def _malformed(self, events: list[Event]) -> None:
        """Not the format after all: the calls already complete stand; the text from here on is content (read
        in text mode again, so a later block is still found)."""
        self.mode = "text"

    # -- forced calls (structured decoding) -------------------------------------------------------------------
    @classmethod
    def structural_tag(cls, tools: dict[str, dict[str, Any] | None], choice: "ToolChoice",
                       parallel_tool_calls: bool = True, token_markers: frozenset[str] = frozenset()
                       ) -> dict[str, Any]:
        """M3's markup for a forced call, and nothing else (vLLM's rule: the answer is the call(s), then EOS):
        `required` is one block of one or more invokes of the declared tools (exactly one when
        parallel_tool_calls is false), `named` one block with one invoke of that tool. Parameters follow the
        declared order, required ones always, optional ones maybe; a string value is raw text, a
        number/boolean/enum JSON, an object its fields as elements, an array `<item>` elements.

        `token_markers`: the markers (NS, `<tool_call>`, `</tool_call>`) that are single tokens of the
        tokenizer the format is compiled for. Each is then that token, never spelled from smaller pieces: the
        text the parser reads is the same, but a model cannot take a dozen tokens to write one NS (what a
        near-uniform model does when every spelling is allowed, running out of max_tokens inside its call)."""
        if choice.mode == "named":
            names = [choice.name]
        elif choice.mode == "required":
            names = list(tools)
        else:
            raise ValueError(f"tool_choice {choice.mode!r} does not force a call")
        fmt = M3CallFormat(token_markers)
        invokes = [fmt.invoke(name, tools[name]) for name in names]
        one = invokes[0] if len(invokes) == 1 else {"type": "or", "elements": invokes}
        single = choice.mode == "named" or not parallel_tool_calls
        return {"type": "structural_tag", "format": fmt.seq(
            fmt.lit(BLOCK_START + "\n"), one if single else {"type": "plus", "content": one}, fmt.lit(BLOCK_END))}


ANY_TEXT = {"type": "any_text"}  # inside a tag: any text up to the tag's end


class M3CallFormat:
    """Builds the xgrammar structural tag of M3 tool calls as the chat template writes them (its to_xml macro).
    `token_markers`: markers to match as their single token (see MiniMaxM3ToolCallParser.structural_tag)."""

    def __init__(self, token_markers: frozenset[str] = frozenset()):
        self.markers = sorted(token_markers, key=len, reverse=True)  # longest first: `NS` vs `NS<tool_call>`

    @staticmethod
    def seq(*elements: dict[str, Any]) -> dict[str, Any]:
        return {"type": "sequence", "elements": list(elements)}

    def lit(self, text: str) -> dict[str, Any]:
        """Literal text, its token markers as tokens."""
        parts: list[dict[str, Any]] = []
        while text:
            hits = [(text.find(m), m) for m in self.markers if m in text]
            if not hits:
                parts.append({"type": "const_string", "value": text})
                break
            i, marker = min(hits, key=lambda h: (h[0], -len(h[1])))
            if i:
                parts.append({"type": "const_string", "value": text[:i]})
            parts.append({"type": "token", "token": marker})
            text = text[i + len(marker):]
        return parts[0] if len(parts) == 1 else self.seq(*parts) if parts else {"type": "const_string", "value": ""}

    def element(self, name: str, value: dict[str, Any]) -> dict[str, Any]:
        """`NS<name>` value `NS</name>`. A string's text ends at the NS token when NS is a token marker (it
        cannot hold one); other free text, which may hold nested elements, ends at the closing tag's text."""
        begin, end = f"{NS}<{name}>", f"{NS}</{name}>"
        if value is ANY_TEXT_STRING and NS in self.markers:
            return self.seq(self.lit(begin), {"type": "tag", "begin": "", "content": {"type": "any_tokens"},
                                              "end": {"type": "token", "token": NS}}, self.lit(f"</{name}>"))
        if value is ANY_TEXT or value is ANY_TEXT_STRING:
            return {"type": "tag", "begin": begin, "content": ANY_TEXT, "end": end}
        return self.seq(self.lit(begin), value, self.lit(end))

    def invoke(self, name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
        root = parameters or {}
        return self.seq(self.lit(f'{INVOKE_START} name="{name}">'), self.fields(root, root, 0),
                        self.lit(INVOKE_END + "\n"))

    def fields(self, schema: dict[str, Any], root: dict[str, Any], depth: int) -> dict[str, Any]:
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = set(schema.get("required", []))
        args = []
        for key, sub in props.items():
            element = self.element(key, self.value(sub, root, depth))
            args.append(element if key in required else {"type": "optional", "content": element})
        return self.seq(*args) if args else {"type": "const_string", "value": ""}

    def value(self, schema: Any, root: dict[str, Any], depth: int) -> dict[str, Any]:
        """A value: free text where the schema does not pin the shape down."""
        for _ in range(8):
            if isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
                schema = resolve_ref(schema["$ref"], root)
        vtype = value_type(schema, root, depth) if isinstance(schema, dict) else None
        if vtype is None or depth > 8 or vtype.kind == "any_of":
            return ANY_TEXT
        if vtype.kind == "string":
            values = schema.get("enum")
            if isinstance(values, list) and values and all(isinstance(v, str) and v for v in values):
                return {"type": "or", "elements": [{"type": "const_string", "value": v} for v in values]}
            return ANY_TEXT_STRING
        if vtype.kind == "object":
            if not isinstance(schema.get("properties"), dict) or not schema["properties"] \
                    or vtype.additional is not None:
                return ANY_TEXT  # undeclared keys: free text up to the closing tag
            return self.fields(schema, root, depth + 1)
        if vtype.kind == "array":
            return {"type": "star", "content": self.element("item", self.value(schema.get("items"), root, depth + 1))}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if k != "description"}}


ANY_TEXT_STRING = {"type": "any_text"}  # a string value: free text (a distinct object, so `element` can tell)
