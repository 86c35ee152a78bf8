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
import logging
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Union

from nanoserve.parsers.markers import is_proper_prefix, partial_prefix
from nanoserve.parsers.tool_values import Element, ValueType, arguments_type, convert, declared_keys, resolve_ref

if TYPE_CHECKING:
    from nanoserve.parsers.tools import ToolChoice

logger = logging.getLogger(__name__)


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
    schema. Only what was offered comes out: a call to a function not in `tools` is dropped, and so is an argument
    under a key its parameters do not declare, each with a logged warning (vLLM returns both; a client's agent loop
    would dispatch them). With the switch constrained_tool_calls on, the server's grammar keeps the model from
    writing either (structural_tag, auto_structural_tag)."""

    name = ""
    markers: tuple[str, ...] = ()
    """Strings the parser needs to see in the text: a tokenizer that treats one of them as a special token must
    decode with skip_special_tokens=False for this parser to work."""

    call_start = ""
    """The text that opens a call block: the reasoning parser ends the thinking where one opens."""

    def __init__(self, tools: dict[str, dict[str, Any] | None]):
        self.types = {name: arguments_type(params) for name, params in tools.items()}
        self.keys = {name: declared_keys(params) for name, params in tools.items()}

    def offered(self, name: str) -> bool:
        """Whether the request offered function `name` (a warning is logged when it did not)."""
        if name in self.types:
            return True
        logger.warning("dropped a call to %r: the request offers %s", name, ", ".join(sorted(self.types)) or "none")
        return False

    def declares(self, name: str, key: str) -> bool:
        """Whether offered function `name` takes an argument `key` (a warning is logged when it does not)."""
        keys = self.keys[name]
        if keys is None or key in keys:
            return True
        logger.warning("dropped the argument %r of a call to %r: its parameters declare %s", key, name,
                       ", ".join(sorted(keys)) or "none")
        return False

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

    @classmethod
    def auto_structural_tag(cls, tools: dict[str, dict[str, Any] | None], parallel_tool_calls: bool = True,
                            token_markers: frozenset[str] = frozenset(), content: dict[str, Any] | None = None
                            ) -> dict[str, Any]:
        """What the output may look like with tool_choice "auto" (switch constrained_tool_calls): free text, but a
        call, once the model opens one, names an offered tool and holds its arguments to the tool's parameters.
        `content`: a structural-tag element the text must follow instead (the request's response_format), the
        answer then being that or the calls."""
        raise NotImplementedError(f"the {cls.name} parser cannot describe a call in auto mode")


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
MARKER = re.compile("|".join(re.escape(m) for m in (NS, "<tool_call>", "</tool_call>")))
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
    call_start = BLOCK_START

    def __init__(self, tools: dict[str, dict[str, Any] | None]):
        super().__init__(tools)
        self.buf = ""
        self.mode = "text"  # text | block | invoke
        self.index = -1  # the current (or last) call
        self.call_type: ValueType | None = None  # the current call's arguments
        self.call_name: str | None = None  # the current call's function; None while a dropped call is read
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
        elif self.mode == "text" and self.buf:  # the start of a block that never came: it was content
            events.append(Text(self.without_markers(self.buf)))
        # in a block, what is left is an unfinished marker (anything else would have ended the block): dropped
        self.buf, self.mode = "", "text"
        return events

    # -- the three modes ------------------------------------------------------------------------------------
    def _text(self, events: list[Event]) -> bool:
        """Outside a block: content up to the next block. A marker outside a block (a stray NS, `</tool_call>`)
        is not content: it is dropped."""
        i = self.buf.find(BLOCK_START)
        if i == -1:
            keep = max(partial_prefix(self.buf, m) for m in (BLOCK_START, *self.markers))
            text = self.buf[:len(self.buf) - keep]
            self.buf = self.buf[len(self.buf) - keep:]
            if text:
                events.append(Text(self.without_markers(text)))
            return False
        if i:
            events.append(Text(self.without_markers(self.buf[:i])))
        self.buf = self.buf[i + len(BLOCK_START):]
        self.mode = "block"
        return True

    def without_markers(self, text: str) -> str:
        return MARKER.sub("", text)  # one pass: the text around a removed marker cannot form a new one

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
                    self.call_name = name if self.offered(name) else None  # an unoffered call is read, not sent
                    if self.call_name is not None:
                        self.index += 1
                        self.call_type = self.types.get(name)
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
        self.buf = rest[end:]
        if self.call_name is None or not self.declares(self.call_name, element.name):
            return True
        value = convert(element.value, self.call_type.field(element.name) if self.call_type else None)
        sep = "," if self.args_open else "{"
        events.append(CallArguments(self.index, sep + json.dumps(element.name, ensure_ascii=False) + ":" +
                                    json.dumps(value, ensure_ascii=False, separators=(",", ":"))))
        self.args_open = True
        return True

    def _end_call(self, events: list[Event]) -> None:
        if self.call_name is not None:
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
        declared order, required ones always, undeclared ones never; each value is held to its schema
        (M3CallFormat), so the arguments the parser reads back validate against the tool's parameters.

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
        calls = fmt.calls(tools, names, single=choice.mode == "named" or not parallel_tool_calls)
        return {"type": "structural_tag", "format": fmt.seq(fmt.lit(BLOCK_START + "\n"), calls, fmt.lit(BLOCK_END))}

    @classmethod
    def auto_structural_tag(cls, tools: dict[str, dict[str, Any] | None], parallel_tool_calls: bool = True,
                            token_markers: frozenset[str] = frozenset(), content: dict[str, Any] | None = None
                            ) -> dict[str, Any]:
        """tool_choice "auto" held to the offered tools (SGLang's constrained tool calls): the text is free until
        the model opens a call block - the trigger is the namespace token (or, where NS is no single token, the
        text of BLOCK_START) - and the block is then what a forced `required` call's is: invokes of the offered
        tools only, their arguments held to each tool's parameters, then the block's end; the text after it is free
        again (with parallel_tool_calls false the output ends after one block of one call). `content`: the format
        the answer's text must follow instead (response_format): the output is then that, or one call block."""
        fmt = M3CallFormat(token_markers)
        single = not parallel_tool_calls
        calls = fmt.calls(tools, list(tools), single)
        if NS in token_markers:  # the block is read from its first token on: NS, then `<tool_call>`
            close = "</tool_call>"
            block = {"type": "tag", "begin": {"type": "token", "token": NS},
                     "content": fmt.seq(fmt.lit("<tool_call>\n"), calls, fmt.lit(NS)),
                     "end": {"type": "token", "token": close} if close in token_markers else close}
            free = {"type": "token_triggered_tags", "trigger_tokens": [NS], "tags": [block],
                    "stop_after_first": single}
        else:
            block = {"type": "tag", "begin": BLOCK_START, "content": fmt.seq(fmt.lit("\n"), calls), "end": BLOCK_END}
            free = {"type": "triggered_tags", "triggers": [BLOCK_START], "tags": [block], "stop_after_first": single}
        if content is not None:
            return {"type": "structural_tag", "format": {"type": "or", "elements": [block, content]}}
        return {"type": "structural_tag", "format": free}


STRING_CHAR = r"[^<>\[\]\uD800-\uDFFF]"
"""What a string value of a forced call may hold: any character but the ones M3's markers are built of (every
marker - NS, the tool-call and thinking tags, the chat format's turn markers - has one), so no marker can be written
inside a value, as a token or spelled from smaller ones, and the value ends only at its closing tag. A regex over
characters (no surrogates), so the text is valid UTF-8 and its length is what maxLength counts."""
NUMBER_KEYS = ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
MAX_FORMAT_DEPTH = 8  # deeper (or recursive) schemas: their values are free strings


class M3CallFormat:
    """Builds the xgrammar structural tag of M3 tool calls as the chat template writes them (its to_xml macro),
    each argument held to its JSON schema so that what the parser reads back (tool_values.convert) validates:

        string           `pattern` as a regex; else STRING_CHAR{minLength,maxLength}
        enum / const     one of the values, as the template writes them (a boolean as true/false)
        integer/number   a JSON number within minimum/maximum (xgrammar's JSON schema)
        boolean / null   true or false / null
        object           its declared properties as elements, in order, required ones always, optional ones
                         maybe (undeclared ones never); one without declared properties: a JSON object
        array            minItems..maxItems `<item>` elements, each held to `items`
        type list, anyOf, oneOf   one of the alternatives
        anything else    a free string

    `token_markers`: markers to match as their single token (see MiniMaxM3ToolCallParser.structural_tag)."""

    def __init__(self, token_markers: frozenset[str] = frozenset()):
        self.markers = sorted(token_markers, key=len, reverse=True)  # longest first: `NS` vs `NS<tool_call>`

    @staticmethod
    def seq(*elements: dict[str, Any]) -> dict[str, Any]:
        return {"type": "sequence", "elements": list(elements)}

    @staticmethod
    def either(options: list[dict[str, Any]]) -> dict[str, Any]:
        return options[0] if len(options) == 1 else {"type": "or", "elements": options}

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
        """`NS<name>` value `NS</name>`."""
        return self.seq(self.lit(f"{NS}<{name}>"), value, self.lit(f"{NS}</{name}>"))

    def calls(self, tools: dict[str, dict[str, Any] | None], names: list[str], single: bool) -> dict[str, Any]:
        """The invokes a call block holds: one (`single`) or more, each of one of `names` (the tools' keys)."""
        one = self.either([self.invoke(name, tools[name]) for name in names])
        return one if single else {"type": "plus", "content": one}

    def invoke(self, name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
        root = parameters or {}
        return self.seq(self.lit(f'{INVOKE_START} name="{name}">'), self.fields(root, root, 0),
                        self.lit(INVOKE_END + "\n"))

    def fields(self, schema: dict[str, Any], root: dict[str, Any], depth: int) -> dict[str, Any]:
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = [r for r in schema.get("required", []) if isinstance(r, str)]
        extra = schema.get("additionalProperties")
        # a required key the properties do not declare still has to be there: its schema is additionalProperties'
        props = {**props, **{r: extra if isinstance(extra, dict) else {} for r in required if r not in props}}
        args = []
        for key, sub in props.items():
            element = self.element(key, self.value(sub, root, depth))
            args.append(element if key in required else {"type": "optional", "content": element})
        return self.seq(*args) if args else {"type": "const_string", "value": ""}

    def value(self, schema: Any, root: dict[str, Any], depth: int) -> dict[str, Any]:
        """One value held to `schema` (the table in the class docstring)."""
        for _ in range(MAX_FORMAT_DEPTH):
            if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
                break
            schema = resolve_ref(schema["$ref"], root)
        if not isinstance(schema, dict) or depth > MAX_FORMAT_DEPTH:
            return self.string({})
        if "const" in schema:
            return self.literal(schema["const"])
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return self.either([self.literal(v) for v in schema["enum"]])
        kind = schema.get("type")
        if isinstance(kind, list) and kind:
            return self.either([self.value({**schema, "type": k}, root, depth) for k in dict.fromkeys(kind)])
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return self.either([self.value(alt, root, depth + 1) for alt in schema[key]])
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
        if kind == "string":
            return self.string(schema)
        if kind in ("integer", "number"):
            return {"type": "json_schema", "json_schema": {k: schema[k] for k in NUMBER_KEYS if k in schema}}
        if kind == "boolean":
            return self.either([self.literal(True), self.literal(False)])
        if kind == "null":
            return self.literal(None)
        if kind == "object":
            if isinstance(schema.get("properties"), dict) and schema["properties"] or schema.get("required"):
                return self.fields(schema, root, depth + 1)
            # no declared keys: a JSON object (the parser reads a JSON text as the object); its strings are held
            # to STRING_CHAR like any other value, and its keys may not hold a marker
            return {"type": "json_schema", "json_schema": plain_json_strings(schema, root), "max_whitespace_cnt": 1}
        if kind == "array":
            low = schema.get("minItems", 0)
            high = schema.get("maxItems", -1)
            item = self.element("item", self.value(schema.get("items", {}), root, depth + 1))
            return {"type": "repeat", "min": low if isinstance(low, int) and low >= 0 else 0,
                    "max": high if isinstance(high, int) and high >= 0 else -1, "content": item}
        return self.string({})

    @staticmethod
    def literal(value: Any) -> dict[str, Any]:
        """A constant as the template writes it: a string as itself, anything else as JSON."""
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        return {"type": "const_string", "value": text}

    @staticmethod
    def string(schema: dict[str, Any]) -> dict[str, Any]:
        """A string value: its `pattern` (matched whole), else STRING_CHAR repeated within its length bounds."""
        pattern = schema.get("pattern")
        if isinstance(pattern, str) and pattern:
            return {"type": "regex", "pattern": whole_match(pattern)}
        return {"type": "regex", "pattern": STRING_CHAR + length_range(schema)}


def length_range(schema: dict[str, Any]) -> str:
    """A string schema's minLength/maxLength as a regex repetition."""
    low = schema.get("minLength", 0)
    low = low if isinstance(low, int) and low > 0 else 0
    high = schema.get("maxLength")
    if not isinstance(high, int) or high < 0:
        return "*" if low == 0 else f"{{{low},}}"
    return f"{{{low},{max(low, high)}}}"


def whole_match(pattern: str) -> str:
    """A JSON schema pattern (a search) as a regex for the whole value: the anchors dropped (a value matching the
    whole pattern also contains a match)."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1]
    return pattern


def plain_json_strings(schema: Any, root: dict[str, Any], depth: int = 0) -> Any:
    """`schema` with its $refs inlined and every string schema that has no pattern, enum, const or format given a
    pattern of STRING_CHAR within its length bounds (xgrammar's JSON grammar then keeps markers out of the
    strings)."""
    if not isinstance(schema, dict) or depth > MAX_FORMAT_DEPTH:
        return schema
    if isinstance(schema.get("$ref"), str):
        return plain_json_strings(resolve_ref(schema["$ref"], root), root, depth + 1)
    out = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    for key in ("properties", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {k: plain_json_strings(v, root, depth + 1) for k, v in out[key].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(out.get(key), dict):
            out[key] = plain_json_strings(out[key], root, depth + 1)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [plain_json_strings(v, root, depth + 1) for v in out[key]]
    if out.get("type") == "object" or "properties" in out or "additionalProperties" in out:  # its keys too
        names = out.get("propertyNames") if isinstance(out.get("propertyNames"), dict) else {}
        out["propertyNames"] = plain_json_strings({"type": "string", **names}, root, depth + 1)
    if out.get("type") == "string" and not ({"pattern", "enum", "const", "format"} & out.keys()):
        out["pattern"] = "^" + STRING_CHAR + length_range(out) + "$"
    return out


UNBOUNDED_ROOM = 64
"""Tokens counted for a part of a format with no bound of its own (an unbounded string or number, a pattern, a
free JSON object), and for each of the items an unbounded repetition is counted with (ROOM_ITEMS)."""
ROOM_ITEMS = 4


def format_tokens(fmt: dict[str, Any]) -> int:
    """The most tokens text of structural-tag format `fmt` can take (every token holds at least one byte, a token
    marker is one token), with UNBOUNDED_ROOM for each part that has no bound: the room a forced call needs."""
    kind = fmt.get("type")
    if kind == "const_string":
        return len(fmt["value"].encode())
    if kind == "token":
        return 1
    if kind == "sequence":
        return sum(format_tokens(e) for e in fmt["elements"])
    if kind == "or":
        return max(format_tokens(e) for e in fmt["elements"])
    if kind == "optional":
        return format_tokens(fmt["content"])
    if kind in ("repeat", "plus", "star"):
        high = fmt.get("max", -1)
        return format_tokens(fmt["content"]) * (high if high >= 0 else ROOM_ITEMS)
    if kind == "regex":
        m = re.fullmatch(re.escape(STRING_CHAR) + r"\{(\d+),(\d+)\}", fmt["pattern"])
        return 4 * int(m.group(2)) if m else UNBOUNDED_ROOM  # a character is at most 4 bytes
    if kind == "json_schema":
        schema = fmt["json_schema"]
        if schema.get("type") == "integer" and isinstance(schema.get("minimum"), int) \
                and isinstance(schema.get("maximum"), int):
            return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    return UNBOUNDED_ROOM
