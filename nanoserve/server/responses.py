"""Engine output -> response bodies: the choices of a finished request, token usage, and logprobs in the two
OpenAI formats (completions: parallel lists; chat: one entry per token). The streaming chunks (streaming.py)
build their choices from the same logprobs and usage functions."""

from __future__ import annotations

from typing import Any

from nanoserve.engine.outputs import CompletionOutput, RequestOutput
from nanoserve.server import protocol as P
from nanoserve.server.convert import ChatSetup
from nanoserve.server.state import OpenAIServer


# -- whole responses ----------------------------------------------------------------------------------------
def completion_response(server: OpenAIServer, request_id: str, req: P.CompletionRequest,
                        outputs: list[RequestOutput]) -> P.CompletionResponse:
    choices = []
    for i, out in enumerate(outputs):
        for c in out.outputs:
            choices.append(P.CompletionChoice(
                index=i * req.n + c.index, text=c.text,
                logprobs=completion_logprobs(server, c, 0, len(c.token_ids), 0),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return P.CompletionResponse(id=request_id, model=server.model_name, choices=choices, usage=usage(outputs))


def chat_response(server: OpenAIServer, request_id: str, req: P.ChatCompletionRequest,
                  out: RequestOutput, setup: ChatSetup) -> P.ChatCompletionResponse:
    choices = []
    for c in out.outputs:
        message = chat_message(setup, c.text)
        choices.append(P.ChatChoice(index=c.index, message=message,
                                    logprobs=chat_logprobs(server, c, 0, len(c.token_ids), req.top_logprobs or 0),
                                    finish_reason=chat_finish_reason(c.finish_reason, bool(message.tool_calls)),
                                    stop_reason=c.stop_reason))
    return P.ChatCompletionResponse(id=request_id, model=server.model_name, choices=choices, usage=usage([out]))


def chat_message(setup: ChatSetup, text: str) -> P.ChatResponseMessage:
    """One choice's text as the assistant message: reasoning and tool calls split out by the server's parsers."""
    parser = setup.choice_parser()
    if parser is None:
        return P.ChatResponseMessage(content=setup.echo + text)
    parsed = parser.parse(text)
    calls = parsed.tool_calls if setup.parallel_tool_calls else parsed.tool_calls[:1]
    content = parsed.content
    if setup.echo:
        content = setup.echo + (content or "")
    reasoning = parsed.reasoning if setup.include_reasoning else None
    return P.ChatResponseMessage(
        content=content, reasoning_content=reasoning, reasoning=reasoning,
        tool_calls=[P.ResponseToolCall(id=call.id, function=P.ResponseFunctionCall(name=call.name,
                                                                                  arguments=call.arguments))
                    for call in calls])


def chat_finish_reason(finish_reason: str | None, called_tools: bool) -> str | None:
    """"tool_calls" when the model stopped after calling tools; a call cut off by max_tokens stays "length", so a
    client can tell that its arguments may be incomplete."""
    return "tool_calls" if called_tools and finish_reason == "stop" else finish_reason


def usage(outputs: list[RequestOutput]) -> P.UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))


# -- logprobs of tokens [start, end) in the two OpenAI formats ---------------------------------------------------
MIN_LOGPROB = -9999.0
"""What a -inf logprob (a token masked out, e.g. by a structured-output grammar) is sent as: JSON has no infinity
(vLLM sends the same floor)."""


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def completion_logprobs(server: OpenAIServer, c: CompletionOutput, start: int, end: int, text_offset: int
                        ) -> P.CompletionLogProbs | None:
    if c.logprobs is None:
        return None
    out = P.CompletionLogProbs()
    for tid, lps in zip(c.token_ids[start:end], c.logprobs[start:end]):
        token = server.token_text(tid)
        out.tokens.append(token)
        out.token_logprobs.append(_finite(lps[tid]))
        out.top_logprobs.append({server.token_text(t): _finite(lp) for t, lp in lps.items()})
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out


def chat_logprobs(server: OpenAIServer, c: CompletionOutput, start: int, end: int, num: int
                  ) -> P.ChatLogProbs | None:
    if c.logprobs is None:
        return None
    content = []
    for tid, lps in zip(c.token_ids[start:end], c.logprobs[start:end]):
        top = sorted(lps.items(), key=lambda kv: -kv[1])[:num]
        content.append(P.ChatLogProb(**_chat_token(server, tid, lps[tid]),
                                     top_logprobs=[P.ChatTopLogProb(**_chat_token(server, t, lp)) for t, lp in top]))
    return P.ChatLogProbs(content=content)


def _chat_token(server: OpenAIServer, token_id: int, logprob: float) -> dict[str, Any]:
    text = server.token_text(token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
