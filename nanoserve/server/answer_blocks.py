"""One choice's generated text -> the blocks of an answer, in order: thinking, text, function calls.

The Responses API (responses/convert.py: output items) and the Anthropic Messages API (anthropic/convert.py: content
blocks) both answer in such blocks and stream each one as open / delta / close. This is the one place that
decides where a block starts and ends, from the output parsers' pieces (parsers/chat_output.py): a change of kind
closes the open block and opens the next; text that is only whitespace is not a block of its own (a model often
writes a newline before its calls), and joins the text that follows it; calls past `max_calls` are dropped.
Fed the whole text at once or piece by piece as it streams, it builds the same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nanoserve.parsers.chat_output import Piece
from nanoserve.parsers.tool_calls import CallStart, new_call_id
from nanoserve.server.prepare import ChatSetup


@dataclass
class Block:
    kind: Literal["reasoning", "text", "call"]
    index: int
    """Its position in the answer."""
    text: str = ""
    """The thinking, the text, or a call's arguments (a JSON object, as text)."""
    name: str = ""
    """A call's function name."""
    call_id: str = ""
    """A call's id (`call_...`): what the client's result names."""


@dataclass
class Change:
    """What a piece of text did to the answer: opened a block, added `delta` to it, or closed it."""

    op: Literal["open", "delta", "close"]
    block: Block
    delta: str = ""


class AnswerBlocks:
    """The blocks of one choice's answer, built from its text as it arrives."""

    def __init__(self, setup: ChatSetup, max_calls: int | None = None):
        self.parser = setup.choice_parser()
        self.include_reasoning = setup.include_reasoning
        self.max_calls = max_calls
        self.blocks: list[Block] = []
        self.open: Block | None = None
        self.whitespace = ""  # text that is only whitespace so far, held back
        self.skipped_call: int | None = None  # the parser's index of a call past max_calls: its pieces are dropped

    @property
    def calls(self) -> list[Block]:
        return [b for b in self.blocks if b.kind == "call"]

    def feed(self, text: str, finished: bool) -> list[Change]:
        """The changes this piece of text makes (and, when `finished`, the close of the last block)."""
        piece = Piece(content=text) if self.parser is None else self.parser.take(text, finished)
        changes: list[Change] = []
        if piece.reasoning and self.include_reasoning:
            changes += self._add("reasoning", piece.reasoning)
        if piece.content:
            changes += self._text(piece.content)
        for ev in piece.calls:
            changes += self._call(ev)
        if finished:
            changes += self.close()
        return changes

    def close(self) -> list[Change]:
        block, self.open = self.open, None
        return [Change("close", block)] if block is not None else []

    def _add(self, kind: str, text: str, **fields) -> list[Change]:
        changes = []
        if self.open is None or self.open.kind != kind:
            changes += self.close()
            self.open = Block(kind, len(self.blocks), **fields)
            self.blocks.append(self.open)
            changes.append(Change("open", self.open))
        if text:
            self.open.text += text
            changes.append(Change("delta", self.open, text))
        return changes

    def _text(self, text: str) -> list[Change]:
        if self.open is None or self.open.kind != "text":
            if (self.whitespace + text).isspace():
                self.whitespace += text
                return []
            text, self.whitespace = self.whitespace + text, ""
        return self._add("text", text)

    def _call(self, ev) -> list[Change]:
        if isinstance(ev, CallStart):
            if self.max_calls is not None and len(self.calls) >= self.max_calls:
                self.skipped_call = ev.index
                return self.close()
            self.skipped_call = None
            changes = self.close()  # a call always opens a block of its own, even after another call
            return changes + self._add("call", "", name=ev.name, call_id=new_call_id())
        if ev.index == self.skipped_call or self.open is None or self.open.kind != "call":
            return []
        return self._add("call", ev.fragment)

    def answer_message(self) -> dict:
        """The answer as the chat message a later turn's prompt shows."""
        message: dict = {"role": "assistant", "content": None}
        for b in self.blocks:
            if b.kind == "reasoning":
                message["reasoning_content"] = b.text
            elif b.kind == "text":
                message["content"] = (message["content"] or "") + b.text
            else:
                message.setdefault("tool_calls", []).append(
                    {"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}})
        return message
