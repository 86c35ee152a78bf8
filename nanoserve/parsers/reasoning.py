"""Reasoning parsers (`--reasoning-parser NAME`): the thinking block -> the message's reasoning fields.

A parser reads one choice's generated text incrementally and splits it into (reasoning, content) pieces; the
content goes on to the tool-call parser. Text that may be the start of a marker is held back until it is decided,
so a split marker never leaks into either field.

MiniMax M3 (`minimax_m3`) thinks inside `<mm:think>` ... `</mm:think>`. Where the answer starts depends on the
prompt, so the parser is told whether the prompt left a thinking block open (the chat template's
`thinking_mode: enabled` ends the prompt with `<mm:think>`):

    prompt left it open       everything up to `</mm:think>` is reasoning, the rest content;
                              an output that never closes it is all reasoning
    otherwise                 text before a `<mm:think>` is content, the block is reasoning, text after it content;
                              a block that never closes is reasoning to the end

A marker is never text of either part, wherever the model writes it: a `</mm:think>` outside a block (the bare
leading closer of a model declining to think, as M3 does in `adaptive` mode and after tool results; a stray or
repeated one later) is dropped, a `<mm:think>` inside a block (a repeated opener at the start of a reply) is
dropped, and a later block is reasoning too. When the output is read for tool calls, a call block opened inside
the thinking ends the thinking: the call is content, parsed as a call (M3 sometimes opens its call before
closing its thinking), and the closer that may follow it is dropped.
"""

from __future__ import annotations

from nanoserve.parsers.markers import is_proper_prefix, partial_prefix


class ReasoningParser:
    """One choice's incremental reasoning parser."""

    name = ""
    start = ""
    end = ""
    turn_start = ""  # the marker that opens every turn in the prompt (bounds the search for an open block)
    markers: tuple[str, ...] = ()

    @classmethod
    def prompt_state(cls, prompt: str) -> str:
        """How the prompt's last turn leaves thinking: "open" (it ends inside a thinking block), "closed" (it
        closed one: thinking is over, the answer comes next) or "none" (the model decides)."""
        turn = prompt[prompt.rfind(cls.turn_start) + len(cls.turn_start):] if cls.turn_start in prompt else prompt
        start, end = turn.rfind(cls.start), turn.rfind(cls.end)
        if start > end:
            return "open"
        return "closed" if end != -1 else "none"

    @classmethod
    def prompt_opens_reasoning(cls, prompt: str) -> bool:
        """Whether the prompt (the last turn of it) ends inside an open thinking block."""
        return cls.prompt_state(prompt) == "open"

    @classmethod
    def wrap_structural_tag(cls, tag: dict, prompt_state: str, max_reasoning_tokens: int | None = None,
                            token_markers: frozenset[str] = frozenset()) -> dict:
        """An xgrammar structural tag for the answer, preceded by the thinking the prompt allows: to the end of
        the open block ("open"), nothing ("closed"), or a whole block, a bare closer or nothing ("none").
        `max_reasoning_tokens` bounds the thinking: past it the only way on is the end marker, then the answer
        (so that an answer the request cannot do without, a forced tool call, still has room).
        `token_markers`: the parsers' markers that are single tokens; each is then matched as its token (the
        thinking ends at that token, as the engine's reasoning end is found on token ids), and the thinking
        holds none of the others."""
        answer = tag["format"]

        def marker(text: str) -> dict | str:
            return {"type": "token", "token": text} if text in token_markers else text

        end = marker(cls.end)
        # the thinking holds no other marker: a tool call opened inside it, or a second block, is not the call
        if isinstance(end, dict):
            thinking: dict = {"type": "any_tokens", "exclude_tokens": sorted(token_markers - {cls.end})}
        else:
            thinking = {"type": "any_text", "excludes": [cls.start]}
        if max_reasoning_tokens is not None:
            thinking["max_tokens"] = max(0, max_reasoning_tokens)
        block = {"type": "tag", "begin": "", "content": thinking, "end": end}
        if prompt_state == "open":
            fmt = {"type": "sequence", "elements": [block, answer]}
        elif prompt_state == "none":
            start = marker(cls.start)
            start = start if isinstance(start, dict) else {"type": "const_string", "value": start}
            closer = end if isinstance(end, dict) else {"type": "const_string", "value": end}
            fmt = {"type": "or", "elements": [
                {"type": "sequence", "elements": [start, block, answer]},
                {"type": "sequence", "elements": [closer, answer]},
                answer]}
        else:
            fmt = answer
        return {**tag, "format": fmt}

    def __init__(self, starts_in_reasoning: bool, call_start: str | None = None):
        """`starts_in_reasoning`: the prompt left a thinking block open. `call_start`: the tool-call parser's
        block opener, when the request's output is read for tool calls: a call opened inside the thinking ends
        the thinking there (the block goes on to the tool parser as content)."""
        self.state = "reasoning" if starts_in_reasoning else "content"
        self.buf = ""
        self.saw_reasoning = starts_in_reasoning
        self.call_start = call_start
        self.drop: tuple[str, ...] = ()  # the tool parser's markers: never text of the reasoning either

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) added by this piece of text."""
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, str]:
        """The whole text at once: (reasoning or None when there was none, content)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return (r1 + r2) if self.saw_reasoning else None, c1 + c2


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {}


def register(cls: type[ReasoningParser]) -> type[ReasoningParser]:
    REASONING_PARSERS[cls.name] = cls
    return cls


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


@register
class MiniMaxM3ReasoningParser(ReasoningParser):
    """`<mm:think>` ... `</mm:think>`, the prompt possibly having opened the block (see the module docstring)."""

    name = "minimax_m3"
    start = "<mm:think>"
    end = "</mm:think>"
    turn_start = "]~b]"
    markers = (start, end)

    # states: content, reasoning. A `<mm:think>` opens a block (one inside a block is dropped), a `</mm:think>`
    # closes one (one outside a block is dropped), a tool-call block opened inside the thinking closes it
    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self.buf:
            markers = (self.start, self.end)
            if self.state == "reasoning" and self.call_start:
                markers += (self.call_start, *self.drop)
            out = reasoning if self.state == "reasoning" else content
            hits = [(self.buf.find(m), -len(m), m) for m in markers if m in self.buf]
            if not hits:
                keep = max(partial_prefix(self.buf, m) for m in markers)
                out.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            i, _, marker = min(hits)
            out.append(self.buf[:i])
            if is_proper_prefix(self.buf[i:], *markers):  # NS, so far: maybe the start of a call block
                self.buf = self.buf[i:]
                break
            if marker == self.call_start:  # the call goes to the content, marker and all
                self.buf = self.buf[i:]
                self.state = "content"
                continue
            self.buf = self.buf[i + len(marker):]  # the marker is never text (a tool marker here is dropped)
            if marker == self.start and self.state == "content":
                self.state, self.saw_reasoning = "reasoning", True
            elif marker == self.end and self.state == "reasoning":
                self.state = "content"
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back: a marker that never completed is ordinary text of its part."""
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":  # a tool marker held back (the start of a call that never came) is dropped
            for marker in sorted(self.drop, key=len, reverse=True):
                rest = rest.replace(marker, "")
            return rest, ""
        return "", rest  # the tool parser drops its own markers
