"""The OpenAI API's streamed answers, as Server-Sent Events (the pieces: server/streaming.py).

    completion_events     the completion stream: a chunk per engine step, usage, [DONE]
    chat_events           the chat stream: the role first, then content / reasoning / tool-call deltas, usage,
                          [DONE] (ChatDeltas: one choice's pieces through the output parsers)
"""

from __future__ import annotations

from typing import AsyncIterator

from nanoserve.engine.outputs import RequestOutput
from nanoserve.entrypoints.async_engine import EngineDeadError, EngineShutdownError, RequestStream
from nanoserve.parsers.tool_calls import CallStart, new_call_id
from nanoserve.server.openai import schema as P
from nanoserve.server.openai.convert import (
    chat_finish_reason,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    image_tokens,
    usage,
)
from nanoserve.server.prepare import ChatSetup, Prepared
from nanoserve.server.state import ServerState
from nanoserve.server.streaming import SSE_DONE, StreamedChoice, merge_streams, sse, sse_error, stop_holdback


# -- the event generators -------------------------------------------------------------------------------------
# Every chunk carries one choice, with its index (as OpenAI and vLLM send them): with n > 1 or several prompts,
# the choices' chunks interleave.
async def completion_events(server: ServerState, request_id: str, req: P.CompletionRequest, prepared: Prepared,
                            streams: list[RequestStream]) -> AsyncIterator[str]:
    """The SSE body of a streaming completion: per engine step, a chunk for each choice with new text."""
    sent = [[StreamedChoice() for _ in range(req.n)] for _ in streams]
    finals: dict[int, RequestOutput] = {}
    holdback = stop_holdback(prepared.params)
    as_ids = server.tokens_as_ids(req)

    def chunk(choice: P.CompletionChoice, total: P.UsageInfo | None = None) -> str:
        return sse(P.CompletionChunk(id=request_id, model=prepared.model, choices=[choice], usage=total))

    try:
        async for i, out in merge_streams(streams):
            for c in out.outputs:
                state = sent[i][c.index]
                if state.done:
                    continue
                first = state.tokens_sent == 0 and state.text_sent == 0
                offset = state.text_sent
                text, t0, t1 = state.next_piece(c, holdback)
                if req.echo_only:
                    text, t0, t1 = "", 0, 0
                if not (text or t1 > t0 or state.done or (first and req.echo)):
                    continue
                logprobs = completion_logprobs(server, c, t0, t1, offset, as_ids) if req.logprobs is not None \
                    else None
                if first and req.echo:  # the prompt (and its logprobs) lead the choice's first chunk
                    text = (prepared.prompts[i][0] or "") + text
                    if req.logprobs is not None:
                        logprobs = echo_logprobs(server, out, as_ids, logprobs)
                choice = P.CompletionChoice(
                    index=i * req.n + c.index, text=text, logprobs=logprobs,
                    finish_reason=("length" if req.echo_only else c.finish_reason) if state.done else None,
                    stop_reason=c.stop_reason if state.done else None,
                    token_ids=list(c.token_ids[t0:t1]) if req.return_token_ids else None,
                    prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids and first else None)
                running = None
                if req.continuous_usage:
                    done = 0 if req.echo_only else t1
                    running = P.UsageInfo(prompt_tokens=len(out.prompt_token_ids), completion_tokens=done,
                                          total_tokens=len(out.prompt_token_ids) + done)
                yield chunk(choice, running)
            if out.finished:
                finals[i] = out
        if req.include_usage:
            total = usage([finals[i] for i in sorted(finals)], generated=not req.echo_only)
            yield sse(P.CompletionChunk(id=request_id, model=prepared.model, choices=[], usage=total))
    except (EngineDeadError, EngineShutdownError) as exc:
        yield sse_error(exc)
    yield SSE_DONE


async def chat_events(server: ServerState, request_id: str, req: P.ChatCompletionRequest, prepared: Prepared,
                      stream: RequestStream) -> AsyncIterator[str]:
    """The SSE body of a streaming chat completion: each choice's role first, then content, reasoning and
    tool-call deltas as the output parsers release them."""
    [(_, prompt_ids)] = prepared.prompts
    setup = prepared.chat
    as_ids = server.tokens_as_ids(req)

    def running(completion_tokens: int) -> P.UsageInfo | None:
        if not req.continuous_usage:
            return None
        return P.UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=completion_tokens,
                           total_tokens=len(prompt_ids) + completion_tokens)

    def chunk(choices: list[P.ChatStreamChoice], total: P.UsageInfo | None = None,
              prompt_token_ids: list[int] | None = None) -> str:
        return sse(P.ChatCompletionChunk(id=request_id, model=prepared.model, choices=choices, usage=total,
                                         prompt_token_ids=prompt_token_ids))

    sent = [StreamedChoice() for _ in range(req.n)]
    deltas = [ChatDeltas(setup) for _ in range(req.n)]
    holdback, final = stop_holdback(prepared.params), None
    try:
        for i in range(req.n):  # the prompt's token ids ride on the very first chunk
            first_ids = list(prompt_ids) if req.return_token_ids and i == 0 else None
            yield chunk([P.ChatStreamChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))],
                        running(0), first_ids)
        if setup.echo:
            for i in range(req.n):
                yield chunk([P.ChatStreamChoice(index=i, delta=P.DeltaMessage(content=setup.echo))], running(0))
        async for out in stream:
            for c in out.outputs:
                state = sent[c.index]
                if state.done:
                    continue
                text, t0, t1 = state.next_piece(c, holdback)
                delta = deltas[c.index].next(text, state.done)
                logprobs = chat_logprobs(server, c, t0, t1, req.top_logprobs or 0, as_ids)
                # new tokens whose text is held back (a parser's marker, a character's first bytes, a stop string
                # maybe) still send their logprobs / token ids; the delta then holds no content, never "" (only the
                # role chunk carries an empty content, as OpenAI's first chunk does)
                if delta is not None or state.done or (t1 > t0 and (logprobs is not None or req.return_token_ids)):
                    yield chunk([P.ChatStreamChoice(
                        index=c.index, delta=delta or P.DeltaMessage(),
                        logprobs=logprobs,
                        finish_reason=chat_finish_reason(c.finish_reason, deltas[c.index].called_tools)
                        if state.done else None,
                        stop_reason=c.stop_reason if state.done else None,
                        token_ids=list(c.token_ids[t0:t1]) if req.return_token_ids else None)], running(t1))
            final = out if out.finished else final
        if req.include_usage and final is not None:
            yield chunk([], usage([final], image_tokens=image_tokens(prepared)))
    except (EngineDeadError, EngineShutdownError) as exc:
        yield sse_error(exc)
    yield SSE_DONE


class ChatDeltas:
    """One choice's text pieces -> DeltaMessages, through the server's output parsers (parsers/chat_output.py):
    a tool call's first delta carries its index, id, type and name, the later ones append to its arguments."""

    def __init__(self, setup: ChatSetup):
        self.setup = setup
        self.parser = setup.choice_parser()
        self.ids: dict[int, str] = {}
        self.called_tools = False

    def next(self, text: str, finished: bool) -> P.DeltaMessage | None:
        if self.parser is None:
            return P.DeltaMessage(content=text) if text else None
        piece = self.parser.take(text, finished)
        calls = []
        for ev in piece.calls:
            if not self.setup.parallel_tool_calls and ev.index > 0:
                continue  # parallel_tool_calls false: the first call only
            if isinstance(ev, CallStart):
                self.ids[ev.index] = new_call_id()
                self.called_tools = True
                calls.append(P.DeltaToolCall(index=ev.index, id=self.ids[ev.index], type="function",
                                             function=P.DeltaFunctionCall(name=ev.name, arguments="")))
            else:
                calls.append(P.DeltaToolCall(index=ev.index, function=P.DeltaFunctionCall(arguments=ev.fragment)))
        reasoning = piece.reasoning if self.setup.include_reasoning and piece.reasoning else None
        delta = P.DeltaMessage(content=piece.content or None, reasoning_content=reasoning, reasoning=reasoning,
                               tool_calls=calls or None)
        return delta if (delta.content or reasoning or calls) else None
