"""The minimax_m3 tool-call parser on M3 outputs written by hand from the format (namespace token before every tag,
parameters named by tag, nested values as elements): whole and streamed at every split, typed by the schema,
malformed markup kept as content, never an exception."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.parsers.tool_calls import (
    MARKER,
    CallArguments,
    CallStart,
    MiniMaxM3ToolCallParser,
    Text,
    collect,
    get_tool_call_parser,
)

NS = "]<]minimax[>["
START, END = f"{NS}<tool_call>", f"{NS}</tool_call>"

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "user_id": {"type": "integer"},
        "urgent": {"type": "boolean"},
        "note": {"type": "string"},
        "weight": {"type": "number"},
        "shipping": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}}},
        "items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"},
                                                                           "qty": {"type": "integer"}}}},
        "tags": {"type": "array", "items": {"type": "string"}},
        "scores": {"type": "array", "items": {"type": "number"}},
        "metadata": {"type": "object", "additionalProperties": {"type": "integer"}},
        "payload": {"type": "object"},
        "priority": {"anyOf": [{"type": "integer"}, {"enum": ["low", "high"]}]},
        "maybe": {"type": ["integer", "null"]},
        "node": {"$ref": "#/$defs/node"},
    },
    "$defs": {"node": {"type": "object", "properties": {"id": {"type": "integer"}}}},
}
TOOLS = {"create_order": ORDER_SCHEMA,
         "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
         "ping": None}


def el(name: str, body: str) -> str:
    return f"{NS}<{name}>{body}{NS}</{name}>"


def invoke(name: str, *params: str) -> str:
    return f'{NS}<invoke name="{name}">' + "".join(params) + f"{NS}</invoke>"


def block(*invokes: str) -> str:
    return f"{START}\n" + "\n".join(invokes) + f"\n{END}"


def parse(text: str, tools=TOOLS):
    content, calls = MiniMaxM3ToolCallParser(tools).parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls], [c.arguments for c in calls]


def stream(text: str, cuts: list[int], tools=TOOLS):
    """Feed text cut at the given positions; return the events."""
    p = MiniMaxM3ToolCallParser(tools)
    events, prev = [], 0
    for cut in cuts + [len(text)]:
        events += p.feed(text[prev:cut])
        prev = cut
    return events + p.finish()


ORDER = invoke("create_order", el("user_id", "42"), el("urgent", "true"), el("note", "Leave at the desk.\n"),
               el("weight", "2.50"),
               el("shipping", el("city", "Singapore") + el("zip", "018956")),
               el("items", el("item", el("sku", "book-001") + el("qty", "2")) +
                  el("item", el("sku", "pen-007") + el("qty", "5"))),
               el("tags", el("item", "a") + el("item", "7")),
               el("scores", el("item", "1") + el("item", "0.5")),
               el("metadata", el("score", "42") + el("rank", "7")),
               el("payload", '{"nested": {"deep": [1, true, null]}}'),
               el("priority", "high"), el("maybe", "null"), el("node", el("id", "9")))
ORDER_ARGS = {"user_id": 42, "urgent": True, "note": "Leave at the desk.\n", "weight": 2.5,
              "shipping": {"city": "Singapore", "zip": 18956},
              "items": [{"sku": "book-001", "qty": 2}, {"sku": "pen-007", "qty": 5}],
              "tags": ["a", "7"], "scores": [1, 0.5], "metadata": {"score": 42, "rank": 7},
              "payload": {"nested": {"deep": [1, True, None]}}, "priority": "high", "maybe": None, "node": {"id": 9}}

FIXTURES = {
    "nested, typed by the schema": ("I will create it.\n" + block(ORDER),
                                    "I will create it.\n", [("create_order", ORDER_ARGS)]),
    "several calls in one block": (block(invoke("get_weather", el("city", "Paris"), el("days", "3")),
                                         invoke("get_weather", el("city", "Oslo")), invoke("ping")),
                                   "", [("get_weather", {"city": "Paris", "days": 3}),
                                          ("get_weather", {"city": "Oslo"}), ("ping", {})]),
    "text before and after, two blocks": ("Checking. " + block(invoke("get_weather", el("city", "Rome"))) +
                                          " and " + block(invoke("ping")) + " done.",
                                          "Checking.  and  done.",
                                          [("get_weather", {"city": "Rome"}), ("ping", {})]),
    "no call": ("Plain answer with <b>markup</b> and ] brackets [.", "Plain answer with <b>markup</b> and ] "
                                                                      "brackets [.", []),
}


@pytest.mark.parametrize("name", FIXTURES)
def test_whole_output(name):
    text, content, calls = FIXTURES[name]
    got_content, got_calls, raw = parse(text)
    assert got_calls == calls
    assert got_content == content
    for args in raw:  # compact JSON, keys in the order the model wrote them
        assert args == json.dumps(json.loads(args), ensure_ascii=False, separators=(",", ":"))


@pytest.mark.parametrize("name", FIXTURES)
def test_every_split_streams_the_same(name):
    """Cut the text at every position (and feed it character by character): the same content and calls, and
    no piece of a marker ever reaches the content."""
    text = FIXTURES[name][0]
    ref_content, ref_calls, ref_raw = parse(text)
    for cut in range(len(text) + 1):
        events = stream(text, [cut])
        content, calls = collect(events)
        assert content == ref_content, cut
        assert [c.arguments for c in calls] == ref_raw, cut
    events = stream(text, list(range(1, len(text))))
    assert [c.arguments for c in collect(events)[1]] == ref_raw
    for ev in events:
        if isinstance(ev, Text) and ref_calls:
            assert NS not in ev.text and "<tool_call>" not in ev.text and "invoke" not in ev.text


def test_streamed_call_deltas():
    """A call's name comes first (as soon as its header is complete), then one fragment per parameter, then
    the closing brace; the fragments join to the non-streaming arguments."""
    text = "Sure. " + block(invoke("get_weather", el("city", "Paris"), el("days", "3")))
    p = MiniMaxM3ToolCallParser(TOOLS)
    header_end = text.index('">') + 2
    assert [type(e) for e in p.feed(text[:header_end])] == [Text, CallStart]
    events = p.feed(text[header_end:]) + p.finish()
    frags = [e.fragment for e in events if isinstance(e, CallArguments)]
    assert frags == ['{"city":"Paris"', ',"days":3', "}"]
    assert "".join(frags) == parse(text)[2][0]


def test_values_typed_by_schema():
    args = {k: v for k, v in parse(block(ORDER))[1][0][1].items()}
    assert args == ORDER_ARGS
    # the same text for a tool whose parameters declare no keys: every value stays text, nested values objects
    untyped = parse(block(invoke("free", el("user_id", "42"), el("flag", "true"),
                                 el("pair", el("a", "1") + el("a", "2")))), {"free": {"type": "object"}})[1]
    assert untyped == [("free", {"user_id": "42", "flag": "true", "pair": {"a": ["1", "2"]}})]
    # strings are kept exactly; the text "null" is a string for a string parameter
    assert parse(block(invoke("get_weather", el("city", "  null  "))))[1] == [("get_weather", {"city": "  null  "})]
    # a value that does not fit its type passes through as text (enforcement is structured decoding's job)
    assert parse(block(invoke("get_weather", el("days", "three"))))[1] == [("get_weather", {"days": "three"})]
    # an array given as JSON text, booleans as 1/0, a number with a sign, an empty object
    schema = {"type": "object", "properties": {"xs": {"type": "array"}, "b": {"type": "boolean"},
                                               "n": {"type": "number"}, "o": {"type": "object"}}}
    got = parse(block(invoke("t", el("xs", "[1, 2]"), el("b", "0"), el("n", "-3"), el("o", ""))), {"t": schema})
    assert got[1] == [("t", {"xs": [1, 2], "b": False, "n": -3, "o": {}})]


def test_mixed_text_beside_elements_is_kept():
    got = parse(block(invoke("t", el("payload", "before " + el("child", "v") + " after"))),
                {"t": {"type": "object"}})[1]
    assert got == [("t", {"payload": {"child": "v", "$text": "before  after"}})]


def test_whitespace_and_stray_text_between_parameters():
    text = block(f'{NS}<invoke name="get_weather">\n  ' + el("city", "Lima") + "\nI need the days too.\n" +
                 el("days", "2") + f"\n{NS}</invoke>")
    assert parse(text)[1] == [("get_weather", {"city": "Lima", "days": 2})]


@pytest.mark.parametrize("text, content, calls", [
    # an unfinished start marker at the end was content
    (f"plain {NS}<tool_ca", "plain <tool_ca", []),
    # a closing tag that closes nothing ends the block: the rest is content
    (f"{START}\n{NS}</user_id> after error", f"\n{NS}</user_id> after error", []),
    # an unknown tag where an invoke should start
    (f"A {START}{NS}<bad>{END} tail", f"A {NS}<bad>{END} tail", []),
    # a completed call stands when the block goes wrong after it
    (f"x {START}\n" + invoke("ping") + f"\n{NS}<oops>", "x \n" + f"{NS}<oops>", [("ping", {})]),
    # a mismatched closing tag inside a parameter ends the call with what was complete
    (START + f'{NS}<invoke name="get_weather">' + el("city", "Paris") + f"{NS}<days>3{NS}</city>{NS}</invoke>{END}",
     f"{NS}<days>3{NS}</city>{NS}</invoke>{END}", [("get_weather", {"city": "Paris"})]),
    # output cut off inside a call (max_tokens): the call closes with its complete parameters
    (START + f'{NS}<invoke name="get_weather">' + el("city", "Paris") + f"{NS}<days>3", "",
     [("get_weather", {"city": "Paris"})]),
    # cut off inside the header, or inside the end marker: the unfinished marker is dropped
    (f"Hi {START}\n{NS}<invoke name=\"get_wea", "Hi ", []),
    (f"Hi {START}\n" + invoke("ping") + f"\n{NS}</tool_", "Hi ", [("ping", {})]),
    # an invoke without a name
    (f"{START}{NS}<invoke name=\"\">{NS}</invoke>{END}", f"{NS}<invoke name=\"\">{NS}</invoke>{END}", []),
])
def test_malformed_markup_is_content(text, content, calls):
    content = MARKER.sub("", content)  # the text is content, but a marker is never text
    got_content, got_calls, _ = parse(text)
    assert (got_content, got_calls) == (content, calls)
    for cut in range(len(text) + 1):  # and the same streamed, whatever the split
        c, cl = collect(stream(text, [cut]))
        assert (c, [(x.name, json.loads(x.arguments)) for x in cl]) == (content, calls), cut


def test_calls_and_keys_the_request_did_not_offer_are_dropped(caplog):
    """A call to a function not in the request's tools never reaches the client, nor does an argument under a key
    the tool's parameters do not declare (vLLM returns both); each is logged. The calls around them keep their
    places and indexes, whole and streamed at every split."""
    text = "Sure. " + block(invoke("edit_game", el("level", "3")),
                            invoke("get_weather", el("city", "Oslo"), el("town", "x"), el("days", "2")),
                            invoke("ping", el("extra", "1"))) + " Done."
    with caplog.at_level("WARNING", logger="nanoserve.parsers.tool_calls"):
        content, calls, raw = parse(text)
    assert content == "Sure.  Done." and calls == [("get_weather", {"city": "Oslo", "days": 2}), ("ping", {})]
    assert raw == ['{"city":"Oslo","days":2}', "{}"]
    logged = [r.getMessage() for r in caplog.records]
    assert any("'edit_game'" in m for m in logged) and any("'town'" in m for m in logged) \
        and any("'extra'" in m for m in logged)
    for cut in range(len(text) + 1):
        events = stream(text, [cut])
        assert [(e.index, e.name) for e in events if isinstance(e, CallStart)] == [(0, "get_weather"), (1, "ping")]
        c, cl = collect(events)
        assert (c, [x.arguments for x in cl]) == (content, raw), cut
    # a tool whose parameters admit other keys keeps them, typed by additionalProperties
    tools = {"tag": {"type": "object", "properties": {"id": {"type": "integer"}},
                     "additionalProperties": {"type": "integer"}}}
    assert parse(block(invoke("tag", el("id", "1"), el("n", "2"))), tools)[1] == [("tag", {"id": 1, "n": 2})]


PIECES = [NS, "<tool_call>", "</tool_call>", '<invoke name="get_weather">', "</invoke>", "<city>", "</city>",
          "<days>", "</days>", "<item>", "</item>", "Paris", "3", "\n", " ", "<", ">", "/", '"', "]", "x"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=40), st.data())
def test_any_text_parses_without_error_and_split_invariant(pieces, data):
    """Arbitrary mixes of marker fragments: never an exception, every call's arguments a JSON object, and the
    result independent of how the text is split."""
    text = "".join(pieces)
    ref_content, _, ref_raw = parse(text)
    for args in ref_raw:
        assert isinstance(json.loads(args), dict)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    content, calls = collect(stream(text, cuts))
    assert content == ref_content and [c.arguments for c in calls] == ref_raw


def test_registry_and_call_ids():
    assert get_tool_call_parser("minimax_m3") is MiniMaxM3ToolCallParser
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        get_tool_call_parser("nope")
    _, calls = MiniMaxM3ToolCallParser(TOOLS).parse(block(invoke("ping"), invoke("ping")))
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
