"""The OpenAI API's routes, and vLLM's tokenizer routes beside them.

    router                 POST /v1/completions, POST /v1/chat/completions: parse -> prepare (server/prepare.py:
                           the chat template, tokenize) -> the engine (server/submit.py) -> one JSON body
                           (convert.py) or an event stream (events.py)
    tokenize_router        POST /tokenize and POST /detokenize (vLLM's extensions): text or messages -> token ids
                           exactly as the generation routes would tokenize them, and token ids -> text
    tokenizer_info_router  GET /tokenizer_info (--enable-tokenizer-info-endpoint): the tokenizer's configuration and
                           the chat template, as vLLM answers it

Large requests are rendered and tokenized in the server's thread pool, off the event loop (server/offload.py).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from nanoserve.server.errors import APIError
from nanoserve.server.openai.convert import chat_response, completion_response
from nanoserve.server.openai.events import chat_events, completion_events
from nanoserve.server.openai.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from nanoserve.server.prepare import (
    chat_prompt_ids,
    check_model,
    prepare_chat,
    prepare_completion,
    render_messages,
    tokenize,
)
from nanoserve.server.routing import Server, json_body, request_body, v1_router
from nanoserve.server.state import ServerState
from nanoserve.server.streaming import EventStreamResponse
from nanoserve.server.submit import add_requests, wait_for_outputs

router = v1_router()
tokenize_router = APIRouter()
tokenizer_info_router = APIRouter()  # included only with --enable-tokenizer-info-endpoint


# -- POST /v1/completions --------------------------------------------------------------------------------------------
@router.post("/completions", openapi_extra=request_body(CompletionRequest))
async def create_completion(request: Request, server: Server,
                            req: Annotated[CompletionRequest, json_body(CompletionRequest)]) -> Response:
    return await complete(request, server, req)


async def complete(request: Request, server: ServerState, req: CompletionRequest) -> Response:
    """A parsed completion request -> its response (also what POST /invocations runs for a completion body)."""
    # large requests are rendered and tokenized in the server's thread pool, off the event loop (offload.py)
    prepared = await server.offload.run(await request.body(), prepare_completion, server, req)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await add_requests(server, request_id, prepared, req, "prompt")
    if req.stream:
        return EventStreamResponse(completion_events(server, request_id, req, prepared, streams), streams)
    outputs = await wait_for_outputs(request, streams, req, "prompt")
    return JSONResponse(completion_response(server, request_id, req, prepared, outputs).model_dump())


# -- POST /v1/chat/completions ---------------------------------------------------------------------------------------
@router.post("/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
async def create_chat_completion(request: Request, server: Server,
                                 req: Annotated[ChatCompletionRequest, json_body(ChatCompletionRequest)]
                                 ) -> Response:
    return await chat(request, server, req)


async def chat(request: Request, server: ServerState, req: ChatCompletionRequest) -> Response:
    """A parsed chat request -> its response (also what POST /invocations runs for a chat body)."""
    # large requests are rendered and tokenized in the server's thread pool, off the event loop (offload.py)
    prepared = await server.offload.run(await request.body(), prepare_chat, server, req)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await add_requests(server, request_id, prepared, req, "messages")
    if req.stream:
        return EventStreamResponse(chat_events(server, request_id, req, prepared, streams[0]), streams)
    [output] = await wait_for_outputs(request, streams, req, "messages")
    return JSONResponse(chat_response(server, request_id, req, prepared, output).model_dump())


# -- POST /tokenize, POST /detokenize, GET /tokenizer_info -----------------------------------------------------------
@tokenize_router.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
async def tokenize_route(request: Request, server: Server,
                         req: Annotated[TokenizeRequest, json_body(TokenizeRequest)]) -> JSONResponse:
    return await server.offload.run(await request.body(), tokenize_request, server, req)


def tokenize_request(server: ServerState, req: TokenizeRequest) -> JSONResponse:
    check_model(server, req.model)
    if req.prompt is not None:  # as /v1/completions: special tokens added unless turned off
        _, ids = tokenize(server, req.prompt, req.add_special_tokens is not False)
    else:  # as /v1/chat/completions: the template's text, no special tokens on top unless asked
        media: list = []
        _, text = render_messages(server, req, media)
        if media:  # images and videos count their placeholder tokens
            ids, _ = chat_prompt_ids(server, text, media, bool(req.add_special_tokens))
        else:
            _, ids = tokenize(server, text, bool(req.add_special_tokens))
    strs = server.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=server.max_model_len, tokens=ids,
                                         token_strs=strs).model_dump())


@tokenize_router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
async def detokenize_route(request: Request, server: Server,
                           req: Annotated[DetokenizeRequest, json_body(DetokenizeRequest)]) -> JSONResponse:
    return await server.offload.run(await request.body(), detokenize_request, server, req)


def detokenize_request(server: ServerState, req: DetokenizeRequest) -> JSONResponse:
    check_model(server, req.model)
    outside = sorted({t for t in req.tokens if not 0 <= t < server.vocab_size})
    if outside:
        raise APIError(400, f"tokens: ids outside the vocabulary: {outside} (the vocabulary has "
                            f"{server.vocab_size} tokens)", param="tokens")
    return JSONResponse(DetokenizeResponse(prompt=server.tokenizer.decode(req.tokens)).model_dump())


@tokenizer_info_router.get("/tokenizer_info")
async def tokenizer_info_route(server: Server) -> JSONResponse:
    return JSONResponse(tokenizer_info(server.tokenizer, server.chat_template))


def tokenizer_info(tokenizer, chat_template: str | None) -> dict[str, Any]:
    """vLLM's answer: the tokenizer's init kwargs (its tokenizer_config.json: special tokens, model_max_length,
    ...), its class, the added tokens by id and the chat template in use (the server's --chat-template, else the
    tokenizer's), made JSON."""
    config = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if k not in ("tokenizer_object", "tokenizer_file", "name_or_path", "vocab_file", "merges_file")}
    config["tokenizer_class"] = type(tokenizer).__name__
    config["added_tokens_decoder"] = {
        str(i): {"content": t.content, "special": bool(t.special), "single_word": bool(t.single_word),
                 "lstrip": bool(t.lstrip), "rstrip": bool(t.rstrip), "normalized": bool(t.normalized)}
        for i, t in sorted((getattr(tokenizer, "added_tokens_decoder", None) or {}).items())}
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template.strip():
        config["chat_template"] = template
    return json_safe(config)


def json_safe(value: Any) -> Any:
    """A tokenizer config value as JSON: added tokens as their text, containers element by element, anything else
    that JSON has no type for as its string."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    content = getattr(value, "content", None)  # an AddedToken
    return content if isinstance(content, str) else str(value)
