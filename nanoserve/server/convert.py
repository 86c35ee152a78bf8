"""Request -> engine input: the model-name check, SamplingParams, the chat template, tokenization and the length
checks. Each endpoint has one `prepare_*` function returning a Prepared; every failure is a 400 (or 404) that
names the field."""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.engine.tokenizer import apply_chat_template
from nanoserve.sampling import SamplingParams
from nanoserve.server import protocol as P
from nanoserve.server.errors import APIError, engine_errors
from nanoserve.server.state import OpenAIServer


@dataclass
class Prepared:
    """A request ready for the engine: one (text, token ids) per prompt, the sampling parameters, and the served
    model name the request asked for (what the response names)."""

    prompts: list[tuple[str | None, list[int]]]
    params: SamplingParams
    model: str
    structured_field: str | None = None
    """The request field its output constraint came from (response_format / structured_outputs), if any."""


# -- the endpoints ------------------------------------------------------------------------------------------
def prepare_completion(server: OpenAIServer, req: P.CompletionRequest) -> Prepared:
    model = check_model(server, req.model)
    params = sampling_params(server, req, req.max_new_tokens, req.logprobs, "prompt", req.engine_prompt_logprobs)
    prompts = [tokenize(server, p, req.add_special_tokens) for p in req.prompts()]
    for _, ids in prompts:
        check_length(server, ids, params, req, "prompt")
    if req.echo:  # the echoed text of a token-id prompt is its decoding
        prompts = [(text if text is not None else server.tokenizer.decode(ids), ids) for text, ids in prompts]
    return Prepared(prompts, params, model, structured_field(req))


def prepare_chat(server: OpenAIServer, req: P.ChatCompletionRequest) -> Prepared:
    model = check_model(server, req.model)
    params = sampling_params(server, req, req.max_new_tokens, req.num_logprobs, "messages")
    text = render_chat(server, [m.to_template_dict() for m in req.messages], req.add_generation_prompt,
                       req.chat_template_kwargs)
    ids = server.tokenizer.encode(text, add_special_tokens=False)
    check_length(server, ids, params, req, "messages")
    return Prepared([(text, ids)], params, model, structured_field(req))


# -- the steps ------------------------------------------------------------------------------------------------
def check_model(server: OpenAIServer, name: str | None) -> str:
    """The served name a request asked for (None: the first one); 404 for a name this server does not serve."""
    if name is None:
        return server.model_name
    if name not in server.model_names:
        served = ", ".join(f"`{n}`" for n in server.model_names)
        raise APIError(404, f"the model `{name}` does not exist; this server serves {served}", param="model")
    return name


def sampling_params(server: OpenAIServer, req: P.SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    prompt_field: str, prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's SamplingParams, range-checked against the engine's limits and vocabulary (a 400 naming the
    request's field)."""
    try:
        req.structured_outputs_params()
    except ValueError as exc:
        field = str(exc).split(":", 1)[0].split(" ", 1)[0]
        raise APIError(400, str(exc), param=field.split(".", 1)[0]) from exc
    with engine_errors(req, prompt_field):
        params = req.sampling_params(max_tokens, logprobs, prompt_logprobs)
        params.validate(server.engine.config.max_logprobs, server.vocab_size)
    return params


def structured_field(req: P.SamplingRequest) -> str | None:
    return req.structured_outputs_params()[1]


async def compile_structured_outputs(server: OpenAIServer, prepared: Prepared) -> None:
    """Compile the request's output constraint now, off the engine thread, so that a schema, regex or grammar
    that xgrammar rejects is a 400 naming the field (the engine's add_request then finds it compiled)."""
    so = prepared.params.structured_outputs
    if so is None:
        return
    try:
        await server.engine.compile_structured_outputs(so)
    except ValueError as exc:
        message, field = str(exc), prepared.structured_field or "structured_outputs"
        if message.startswith("structured_outputs.") and field != "structured_outputs":
            message = field + message[message.index(" "):]  # name the field the client set
        raise APIError(400, message, param=field.split(".", 1)[0]) from exc


def render_chat(server: OpenAIServer, messages: list[dict], add_generation_prompt: bool,
                chat_template_kwargs: dict | None) -> str:
    """The messages rendered with the model's chat template (a 400 if the template fails on them)."""
    try:
        return apply_chat_template(server.tokenizer, messages, add_generation_prompt, chat_template_kwargs)
    except Exception as exc:  # jinja2 errors, bad chat_template_kwargs: the request's fault
        raise APIError(400, f"messages: could not render the chat template: {exc}", param="messages") from exc


def tokenize(server: OpenAIServer, prompt: str | list[int], add_special_tokens: bool = True
             ) -> tuple[str | None, list[int]]:
    """A text prompt's ids (add_special_tokens: the tokenizer's BOS etc., as vLLM's completions default);
    token ids pass through as sent."""
    if isinstance(prompt, str):
        return prompt, server.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    return None, prompt


def check_length(server: OpenAIServer, ids: list[int], params: SamplingParams, req: P.SamplingRequest,
                 prompt_field: str) -> None:
    n, limit = len(ids), server.max_model_len
    what = "prompt" if prompt_field == "prompt" else f"{prompt_field} (rendered with the chat template)"
    if n == 0:
        raise APIError(400, f"{what} is empty: it must contain at least one token", param=prompt_field)
    if n >= limit:
        raise APIError(400, f"{what} is too long: {n} tokens, but max_model_len is {limit} (the prompt and "
                            f"at least one generated token must fit)", param=prompt_field)
    if params.max_tokens is not None and n + params.max_tokens > limit:
        field = req.request_field("max_tokens")
        raise APIError(400, f"{field}={params.max_tokens} does not fit: the prompt has {n} tokens and "
                            f"max_model_len is {limit}, so at most {limit - n} tokens can be generated",
                       param=field)
