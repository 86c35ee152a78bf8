"""Engine output -> the OpenAI API's response bodies: the choices of a finished request, token usage, logprobs in
the two OpenAI formats (completions: parallel lists; chat: one entry per token) and vLLM's prompt_logprobs. The
streamed chunks (events.py) build their choices from the same functions, and the Responses and Messages APIs take
their usage and logprobs from here.

A token in logprobs is named by its text - in the completions format a token that is only part of a character by
its bytes ("bytes:\\xe2\\x80", as OpenAI's completions API names it; ServerState.completion_token), so that no two
keys of top_logprobs collide - or 'token_id:N' with return_tokens_as_token_ids. With echo, a
completion's text starts with the prompt and its logprobs with the prompt's (the first prompt token's are null:
nothing predicts it)."""

from __future__ import annotations

from typing import Any

from nanoserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from nanoserve.server.openai import schema as P
from nanoserve.server.prepare import ChatSetup, Prepared
from nanoserve.server.state import ServerState


# -- whole responses ----------------------------------------------------------------------------------------
def completion_response(server: ServerState, request_id: str, req: P.CompletionRequest, prepared: Prepared,
                        outputs: list[RequestOutput]) -> P.CompletionResponse:
    choices = [completion_choice(server, req, prepared, i, out, c) for i, out in enumerate(outputs)
               for c in out.outputs]
    return P.CompletionResponse(id=request_id, model=prepared.model, choices=choices,
                                usage=usage(outputs, generated=not req.echo_only),
                                kv_transfer_params=outputs[0].kv_transfer_params if outputs else None)


def completion_choice(server: ServerState, req: P.CompletionRequest, prepared: Prepared, i: int,
                      out: RequestOutput, c: CompletionOutput) -> P.CompletionChoice:
    as_ids = server.tokens_as_ids(req)
    end = 0 if req.echo_only else len(c.token_ids)
    text = c.text if end else ""
    logprobs = completion_logprobs(server, c, 0, end, 0, as_ids) if req.logprobs is not None else None
    if req.echo:
        prompt_text = prepared.prompts[i][0] or ""
        text = prompt_text + text
        if req.logprobs is not None:
            logprobs = echo_logprobs(server, out, as_ids, logprobs)
    return P.CompletionChoice(
        index=i * req.n + c.index, text=text, logprobs=logprobs,
        finish_reason="length" if req.echo_only else c.finish_reason, stop_reason=c.stop_reason,
        token_ids=list(c.token_ids[:end]) if req.return_token_ids else None,
        prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None,
        prompt_logprobs=prompt_logprobs(out) if req.prompt_logprobs is not None else None)


def chat_response(server: ServerState, request_id: str, req: P.ChatCompletionRequest, prepared: Prepared,
                  out: RequestOutput) -> P.ChatCompletionResponse:
    as_ids = server.tokens_as_ids(req)
    choices = []
    for c in out.outputs:
        message = chat_message(prepared.chat, c.text)
        choices.append(P.ChatChoice(
            index=c.index, message=message,
            logprobs=chat_logprobs(server, c, 0, len(c.token_ids), req.top_logprobs or 0, as_ids),
            finish_reason=chat_finish_reason(c.finish_reason, bool(message.tool_calls)), stop_reason=c.stop_reason,
            token_ids=list(c.token_ids) if req.return_token_ids else None))
    return P.ChatCompletionResponse(
        id=request_id, model=prepared.model, choices=choices,
        usage=usage([out], image_tokens=image_tokens(prepared)),
        prompt_logprobs=prompt_logprobs(out) if req.prompt_logprobs is not None else None,
        prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None,
        kv_transfer_params=out.kv_transfer_params)


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


def usage(outputs: list[RequestOutput], generated: bool = True, image_tokens: int = 0) -> P.UsageInfo:
    """Token counts. `generated` False: the completion tokens are not part of the answer (echo, max_tokens 0).
    `image_tokens`: the prompt's image placeholders (a chat with images), shown beside the cached tokens."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs) if generated else 0
    cached = sum(o.num_cached_tokens for o in outputs)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached,
                                                                   image_tokens=image_tokens or None))


def image_tokens(prepared: Prepared) -> int:
    """The placeholder tokens of a prepared chat's images."""
    return sum(f.num_tokens for f in prepared.mm_features if f.modality == "image")


def cache_write_tokens(server: ServerState, out: RequestOutput) -> int:
    """The prompt's tokens in full KV blocks that were not cached and now are: the prefix cache registers every
    full block of a prompt once it is computed."""
    engine = server.engine.engine
    if not engine.config.optimizations.prefix_caching:
        return 0
    full = len(out.prompt_token_ids) // engine.block_size * engine.block_size
    return max(0, full - out.num_cached_tokens)


# -- logprobs of tokens [start, end) in the two OpenAI formats ---------------------------------------------------
MIN_LOGPROB = -9999.0
"""What a -inf logprob (a token masked out, e.g. by a structured-output grammar) is sent as: JSON has no infinity
(vLLM sends the same floor)."""


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


# -- logprobs ----------------------------------------------------------------------------------------------------
def completion_logprobs(server: ServerState, c: CompletionOutput, start: int, end: int, text_offset: int,
                        as_ids: bool = False) -> P.CompletionLogProbs | None:
    """Tokens [start, end) of a completion in the completions format; text_offset: where the first one starts in
    the choice's text."""
    if c.logprobs is None:
        return None
    out = P.CompletionLogProbs()
    for tid, lps in zip(c.token_ids[start:end], c.logprobs[start:end]):
        token = server.token_name(tid, as_ids, completions=True)
        out.tokens.append(token)
        out.token_logprobs.append(_finite(lps[tid]))
        out.top_logprobs.append({server.token_name(t, as_ids, completions=True): _finite(lp) for t, lp in lps.items()})
        out.text_offset.append(text_offset)
        text_offset += len(server.token_text(tid))
    return out


def echo_logprobs(server: ServerState, out: RequestOutput, as_ids: bool,
                  generated: P.CompletionLogProbs | None) -> P.CompletionLogProbs:
    """The prompt's tokens and logprobs (the engine's prompt_logprobs; the first token's null), then the
    generated ones shifted past the prompt's text."""
    lp = P.CompletionLogProbs()
    offset = 0
    for tid, entry in zip(out.prompt_token_ids, out.prompt_logprobs or [None] * len(out.prompt_token_ids)):
        lp.tokens.append(server.token_name(tid, as_ids, completions=True))
        lp.token_logprobs.append(entry[tid].logprob if entry is not None else None)
        lp.top_logprobs.append({server.token_name(t, as_ids, completions=True): e.logprob for t, e in entry.items()}
                               if entry is not None else None)
        lp.text_offset.append(offset)
        offset += len(server.token_text(tid))
    if generated is not None:
        lp.tokens += generated.tokens
        lp.token_logprobs += generated.token_logprobs
        lp.top_logprobs += generated.top_logprobs
        lp.text_offset += [offset + o for o in generated.text_offset]
    return lp


def chat_logprobs(server: ServerState, c: CompletionOutput, start: int, end: int, num: int, as_ids: bool = False
                  ) -> P.ChatLogProbs | None:
    if c.logprobs is None:
        return None
    content = []
    for tid, lps in zip(c.token_ids[start:end], c.logprobs[start:end]):
        top = sorted(lps.items(), key=lambda kv: -kv[1])[:num]
        content.append(P.ChatLogProb(**_chat_token(server, tid, lps[tid], as_ids),
                                     top_logprobs=[P.ChatTopLogProb(**_chat_token(server, t, lp, as_ids))
                                                   for t, lp in top]))
    return P.ChatLogProbs(content=content)


def _chat_token(server: ServerState, token_id: int, logprob: float, as_ids: bool) -> dict[str, Any]:
    text = server.token_name(token_id, as_ids)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def prompt_logprobs(out: RequestOutput) -> list[dict[int, P.PromptLogprob] | None] | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
    if out.prompt_logprobs is None:
        return None
    return [None if entry is None else {t: _prompt_logprob(e) for t, e in entry.items()}
            for entry in out.prompt_logprobs]


def _prompt_logprob(e: Logprob) -> P.PromptLogprob:
    return P.PromptLogprob(logprob=e.logprob, rank=e.rank, decoded_token=e.decoded_token)
