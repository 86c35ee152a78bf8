"""POST /tokenize and POST /detokenize (vLLM's extensions): text or messages -> token ids exactly as the
generation endpoints would tokenize them, and token ids -> text. A large body is handled in the server's thread
pool, off the event loop (offload.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from nanoserve.server.convert import check_model, render_messages, tokenize
from nanoserve.server.errors import APIError
from nanoserve.server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from nanoserve.server.routes.common import Server, json_body, request_body
from nanoserve.server.state import OpenAIServer

router = APIRouter()


@router.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
async def tokenize_route(request: Request, server: Server,
                         req: Annotated[TokenizeRequest, json_body(TokenizeRequest)]) -> JSONResponse:
    return await server.offload.run(len(await request.body()), tokenize_request, server, req)


def tokenize_request(server: OpenAIServer, req: TokenizeRequest) -> JSONResponse:
    check_model(server, req.model)
    if req.prompt is not None:  # as /v1/completions: special tokens added unless turned off
        _, ids = tokenize(server, req.prompt, req.add_special_tokens is not False)
    else:  # as /v1/chat/completions: the template's text, no special tokens on top unless asked
        _, text = render_messages(server, req)
        _, ids = tokenize(server, text, bool(req.add_special_tokens))
    strs = server.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=server.max_model_len, tokens=ids,
                                         token_strs=strs).model_dump())


@router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
async def detokenize_route(request: Request, server: Server,
                           req: Annotated[DetokenizeRequest, json_body(DetokenizeRequest)]) -> JSONResponse:
    return await server.offload.run(len(await request.body()), detokenize_request, server, req)


def detokenize_request(server: OpenAIServer, req: DetokenizeRequest) -> JSONResponse:
    check_model(server, req.model)
    outside = sorted({t for t in req.tokens if not 0 <= t < server.vocab_size})
    if outside:
        raise APIError(400, f"tokens: ids outside the vocabulary: {outside} (the vocabulary has "
                            f"{server.vocab_size} tokens)", param="tokens")
    return JSONResponse(DetokenizeResponse(prompt=server.tokenizer.decode(req.tokens)).model_dump())
