"""One choice's generated text -> its chat message fields: reasoning, content, tool calls.

The reasoning parser runs first; its content goes through the tool-call parser (when the request parses tools), and a
call block opened inside the thinking ends the thinking, so the call is parsed as one.
`feed` takes each new piece of text as it is generated and returns what the stream should send for it; `finish`
flushes what was held back. A non-streaming response is the same pieces joined (`ChoiceText.parse`), so both
answers agree for any split of the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.parsers.reasoning import ReasoningParser
from nanoserve.parsers.tool_calls import CallArguments, CallStart, Event, Text, ToolCall, ToolCallParser, collect


@dataclass
class Piece:
    """What one stream step adds: reasoning text, content text and tool-call events (any may be empty)."""

    reasoning: str = ""
    content: str = ""
    calls: list[Event] = field(default_factory=list)  # CallStart / CallArguments events

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass
class Parsed:
    """A whole choice: reasoning (None if the model did not think), content (None if empty), calls."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


class ChoiceText:
    """The output parsers of one choice, chained."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None):
        self.reasoning = reasoning
        self.tools = tools
        if reasoning is not None and tools is not None:  # a call opened inside the thinking is still a call
            reasoning.call_start, reasoning.drop = tools.call_start, tools.markers

    def feed(self, text: str) -> Piece:
        return self._piece(*self.reasoning.feed(text) if self.reasoning else ("", text), final=False)

    def finish(self) -> Piece:
        return self._piece(*self.reasoning.finish() if self.reasoning else ("", ""), final=True)

    def _piece(self, reasoning: str, content: str, final: bool) -> Piece:
        if self.tools is None:
            return Piece(reasoning, content)
        events = self.tools.feed(content) if content else []
        if final:
            events += self.tools.finish()
        text = "".join(ev.text for ev in events if isinstance(ev, Text))
        return Piece(reasoning, text, [ev for ev in events if isinstance(ev, (CallStart, CallArguments))])

    @property
    def saw_reasoning(self) -> bool:
        return self.reasoning is not None and self.reasoning.saw_reasoning

    def take(self, text: str, finished: bool) -> Piece:
        """What a stream step adds for this piece of text, and when `finished` also what was held back."""
        piece = self.feed(text) if text else Piece()
        if not finished:
            return piece
        end = self.finish()
        return Piece(piece.reasoning + end.reasoning, piece.content + end.content, piece.calls + end.calls)

    def parse(self, text: str) -> Parsed:
        """The whole text at once (the non-streaming response)."""
        a, b = self.feed(text), self.finish()
        content, calls = collect([Text(a.content), *a.calls, Text(b.content), *b.calls])
        if calls and not content.strip():
            content = ""
        reasoning = a.reasoning + b.reasoning if self.saw_reasoning else None
        # no text beside reasoning or calls is no content (null), as vLLM answers; a plain answer keeps its ""
        return Parsed(reasoning, content if content or not (calls or reasoning is not None) else None, calls)
