"""Request -> engine input: the model-name check, SamplingParams (with the model's generation defaults), the
tools and tool_choice, the chat template, tokenization and the length checks (the prompt count and characters
before tokenizing, limits.py; the tokens after). Each endpoint has one `prepare_*` function returning a Prepared;
every failure is a 400 (or 404) that names the field.

A chat's images and videos (image_url / video_url parts): the template renders each as M3's marker, then
`media_prompt` loads them (nanoserve/multimodal/loader.py: data URLs, allowed http(s) hosts and local paths),
decodes and processes them, expands each marker into the item's placeholder tokens and makes the engine's
features (nanoserve/multimodal/features.py); a corrupt, oversized or refused item is a 400 naming its field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from nanoserve.chat_template import MediaPart, message_text, render_chat, template_messages
from nanoserve.engine.llm_engine import DEFAULT_MM_LIMIT
from nanoserve.engine.structured_output import format_element
from nanoserve.multimodal.features import process_prompt
from nanoserve.multimodal.loader import load_parts
from nanoserve.parsers.chat_output import ChoiceText
from nanoserve.parsers.reasoning import ReasoningParser
from nanoserve.parsers.tool_calls import ToolCallParser, format_tokens
from nanoserve.parsers.tools import ToolChoice, ToolError, check_tools, resolve_tool_choice
from nanoserve.sampling import SamplingParams, StructuredOutputsParams
from nanoserve.server.errors import APIError, describe_validation_error, engine_errors
from nanoserve.server.limits import check_prompt_chars, check_prompt_count
from nanoserve.server.openai import schema as P
from nanoserve.server.schema_base import ElidedText
from nanoserve.server.state import ServerState
from nanoserve.step import MultiModalFeature


@dataclass
class ChatSetup:
    """How to read a chat request's output: which parsers run over each choice, and what else the answer holds."""

    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    tools: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    parallel_tool_calls: bool = True
    tool_parser: type[ToolCallParser] | None = None
    reasoning_parser: type[ReasoningParser] | None = None
    reasoning_state: str = "none"  # how the prompt leaves thinking: open / closed / none (ReasoningParser)
    include_reasoning: bool = True
    echo: str = ""  # the text the answer starts with (echo of the final assistant message)
    structured_field: str | None = None  # "tool_choice" when a forced call holds the output to its format

    def choice_parser(self) -> ChoiceText | None:
        """A fresh parser chain for one choice (None: the text is the content as generated)."""
        reasoning = self.reasoning_parser(self.reasoning_state == "open") if self.reasoning_parser else None
        tools = self.tool_parser(self.tools) if self.tool_parser and self.tool_choice.parses_calls else None
        return ChoiceText(reasoning, tools) if reasoning or tools else None


@dataclass
class Prepared:
    """A request ready for the engine: one (text, token ids) per prompt, the sampling parameters, the served
    model name the request asked for (what the response names), and for chat how to read the output."""

    prompts: list[tuple[str | None, list[int]]]
    params: SamplingParams
    model: str
    structured_field: str | None = None
    """The request field its output constraint came from (response_format / structured_outputs), if any."""
    chat: ChatSetup = field(default_factory=ChatSetup)
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    """A chat's images and videos, as the engine takes them (its one prompt's)."""


# -- the endpoints ------------------------------------------------------------------------------------------
def prepare_completion(server: ServerState, req: P.CompletionRequest) -> Prepared:
    model = check_model(server, req.model)
    params = sampling_params(server, req, req.max_new_tokens, req.logprobs, "prompt", req.engine_prompt_logprobs)
    raw = req.prompts()
    check_prompt_count(server.limits, len(raw), "prompt")
    prompts = [tokenize(server, p, req.add_special_tokens) for p in raw]
    for _, ids in prompts:
        check_length(server, ids, params, req, "prompt")
    # a raw prompt that leaves a thinking block open: the format holds what follows the thinking. One that does
    # not is not a chat turn the model may think in, so the format holds from the first token.
    if server.reasoning_parser and all(
            server.reasoning_parser.prompt_state(text if text is not None else server.tokenizer.decode(ids)) == "open"
            for text, ids in prompts):
        hold_format_after_reasoning(server, params)
    if req.echo:  # the echoed text of a token-id prompt is its decoding
        prompts = [(text if text is not None else server.tokenizer.decode(ids), ids) for text, ids in prompts]
    return Prepared(prompts, params, model, structured_field(req))


def prepare_chat(server: ServerState, req: P.ChatCompletionRequest) -> Prepared:
    model = check_model(server, req.model)
    params = sampling_params(server, req, req.max_new_tokens, req.num_logprobs, "messages")
    setup = chat_setup(server, req)
    if server.parsers_need_special_tokens and (setup.reasoning_parser or setup.tool_choice.parses_calls):
        params.skip_special_tokens = False  # the parsers read markers the tokenizer calls special
    media: list[MediaPart] = []
    messages, text = render_messages(server, req, media)
    if media and req.use_beam_search:
        raise APIError(400, "use_beam_search: not supported with images or videos", param="use_beam_search")
    ids, features = chat_prompt_ids(server, text, media, req.add_special_tokens)
    check_length(server, ids, params, req, "messages")
    default_max = server.generation_defaults.sampling.get("max_tokens")
    if req.max_new_tokens is None and default_max is not None:  # vLLM: the model's default, if it fits
        params.max_tokens = max(1, min(default_max, server.max_model_len - len(ids)))
    if setup.reasoning_parser:
        setup.reasoning_state = setup.reasoning_parser.prompt_state(text)
    budget = req.thinking_token_budget
    if budget is not None and setup.reasoning_parser is None:
        raise APIError(400, "thinking_token_budget: needs the server started with --reasoning-parser (it finds the "
                            "thinking)", param="thinking_token_budget")
    room = server.max_model_len - len(ids) if params.max_tokens is None else params.max_tokens
    if setup.tool_choice.forced:
        apply_forced_tool_choice(server, params, setup, min(room, server.max_model_len - len(ids)), budget)
    elif constrains_calls(server, req, setup):
        apply_auto_tool_format(server, req, params, setup, room, budget)
    elif budget is not None and setup.reasoning_state != "closed":
        apply_thinking_budget(server, req, params, setup, budget)
    elif setup.reasoning_parser and setup.reasoning_state == "none" and params.structured_outputs is not None \
            and setup.reasoning_parser.end in server.token_markers:
        # the model decides whether to think: the format spells out the thinking the parser reads as reasoning (a
        # block, a bare closer or none), bounded so that the answer in the format has room
        apply_thinking_budget(server, req, params, setup, format_thinking_budget(room))
    elif setup.reasoning_state != "closed":  # the model is thinking (open): the format holds after it
        hold_format_after_reasoning(server, params)
    # echo (vLLM): the answer starts with the final message's content when that message has the answer's role
    last = messages[-1]
    if req.echo and last.get("role") == ("assistant" if req.add_generation_prompt else last.get("role")):
        setup.echo = message_text(last.get("content"))
    return Prepared([(text, ids)], params, model, structured_field(req) or setup.structured_field, setup, features)


def as_chat_request(body: dict[str, Any]) -> P.ChatCompletionRequest:
    """The chat request another API served as a chat builds from its own (Responses, Anthropic Messages): a value
    the chat request refuses (a logit_bias key that is no token id, ...) is a 400 naming the chat's field, which
    the caller renames to its own (errors.fields_renamed). Unset fields (None) are left out."""
    try:
        return P.ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        raise describe_validation_error(exc) from exc


def render_messages(server: ServerState, req: P.ChatCompletionRequest | P.TokenizeRequest,
                    media: list[MediaPart] | None = None) -> tuple[list[dict[str, Any]], str]:
    """A request's messages (as the template reads them) and their rendering with the chat template - the
    request's own, else the server's - with its tools and template variables (a 400 naming the field). Image and
    video parts are rendered as their markers and their sources appended to `media` (None: they are refused)."""
    try:
        messages = template_messages([m.to_template_dict() for m in req.messages], media)
        kwargs = dict(req.chat_template_kwargs or {})
        reasoning_effort = getattr(req, "reasoning_effort", None)
        if reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", reasoning_effort)
        text = render_chat(server.tokenizer, messages,
                           tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
                           add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message,
                           chat_template=req.chat_template or server.chat_template, chat_template_kwargs=kwargs)
    except ValueError as exc:
        raise request_error(exc, "messages") from exc
    check_prompt_chars(server.limits, server.max_model_len, text, "messages")
    return messages, text


def chat_prompt_ids(server: ServerState, text: str, media: list[MediaPart], add_special_tokens: bool
                    ) -> tuple[list[int], list[MultiModalFeature]]:
    """A rendered chat's token ids, and with images or videos (`media`, in prompt order) its markers expanded into
    their placeholders and the engine's features of them."""
    if not media:
        return server.tokenizer.encode(text, add_special_tokens=add_special_tokens), []
    return media_prompt(server, text, media, add_special_tokens)


def media_prompt(server: ServerState, text: str, media: list[MediaPart], add_special_tokens: bool
                 ) -> tuple[list[int], list[MultiModalFeature]]:
    """See chat_prompt_ids: the limits first (a model that sees, --limit-mm-per-prompt), then each item loaded,
    decoded and processed (400s naming its field), then the prompt expanded and tokenized."""
    if server.processor is None:
        raise APIError(400, f"{media[0].where}: this model ({server.model_name}) takes no images or videos",
                       param="messages")
    limits = server.engine.config.limit_mm_per_prompt or {}
    for modality in ("image", "video"):
        count, limit = sum(m.modality == modality for m in media), limits.get(modality, DEFAULT_MM_LIMIT)
        if count > limit:
            raise APIError(400, f"messages: At most {limit} {modality}(s) may be provided in one prompt, got {count} "
                                f"(--limit-mm-per-prompt)", param="messages")
    try:
        images, videos = load_parts(server.media_loader, media, server.processor.max_image_pixels)
    except ValueError as exc:
        raise request_error(exc, "messages") from exc
    try:
        return process_prompt(server.processor, server.tokenizer, text, server.vision_config, images, videos,
                              add_special_tokens)
    except ValueError as exc:
        raise APIError(400, f"messages: {exc}", param="messages") from exc


def chat_setup(server: ServerState, req: P.ChatCompletionRequest) -> ChatSetup:
    """The request's tools and tool_choice checked (vLLM's rules), and the parsers its output goes through."""
    try:
        tools = check_tools([t.model_dump(exclude_none=True) for t in req.tools]) if req.tools is not None else None
        auto = server.chat.enable_auto_tool_choice and server.tool_parser is not None
        choice = resolve_tool_choice(req.tool_choice, tools, auto)
    except ToolError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    if choice.forced and server.tool_parser is None:
        raise APIError(400, f"tool_choice: {choice.mode!r} needs the server started with --tool-call-parser",
                       param="tool_choice")
    return ChatSetup(tool_choice=choice, tools=tools or {}, parallel_tool_calls=req.parallel_tool_calls,
                     tool_parser=server.tool_parser, reasoning_parser=server.reasoning_parser,
                     include_reasoning=req.include_reasoning)


FORMAT_ROOM = 1024
"""Tokens of an output format's max_tokens kept for the answer (at most half of them) when the model decides
whether to think first: the thinking may take the rest, then the grammar closes it."""


def format_thinking_budget(room: int) -> int:
    """The thinking an answer in a format leaves room for, of `room` tokens (FORMAT_ROOM)."""
    return room - min(room // 2, FORMAT_ROOM)


def forced_call_format(setup: ChatSetup, max_tokens: int | None = None,
                       token_markers: frozenset[str] = frozenset(), thinking_budget: int | None = None
                       ) -> dict[str, Any]:
    """The xgrammar structural tag a forced tool_choice ("required", a named function) holds the output to: the
    tool parser's markup for the call, after the thinking the prompt allows (the reasoning parser's part). The
    thinking may take `max_tokens` less the room the call needs (format_tokens: the most tokens the call's format
    can take, with a fixed allowance for its unbounded parts, plus the end-of-thinking marker and EOS), and at most
    `thinking_budget` (the request's thinking_token_budget); past that the only way on is the end of thinking.
    Without the bound a model that thinks on would reach max_tokens before or inside its call.
    `token_markers`: the parsers' markers that are single tokens, matched as those tokens."""
    tag = setup.tool_parser.structural_tag(setup.tools, setup.tool_choice, setup.parallel_tool_calls,
                                           token_markers)
    if setup.reasoning_parser:
        budget = None if max_tokens is None else max(0, max_tokens - format_tokens(tag["format"]) - 3)
        if thinking_budget is not None:
            budget = thinking_budget if budget is None else min(budget, thinking_budget)
        tag = setup.reasoning_parser.wrap_structural_tag(tag, setup.reasoning_state, budget, token_markers)
    return tag


def hold_format_after_reasoning(server: ServerState, params: SamplingParams) -> None:
    """With --reasoning-parser, a request's output format (response_format / structured_outputs) holds the answer,
    not the thinking (vLLM's rule): the engine samples unconstrained until the end-of-thinking token."""
    if params.structured_outputs is not None and server.reasoning_end_id is not None:
        params.structured_outputs.reasoning_end_token_id = server.reasoning_end_id


def apply_forced_tool_choice(server: ServerState, params: SamplingParams, setup: ChatSetup,
                             room: int, thinking_budget: int | None = None) -> None:
    """Hold the output to forced_call_format(setup) by structured decoding, so that even a model that would not
    choose a tool emits a valid call. `room`: the tokens the output may take (max_tokens, or what fits);
    `thinking_budget`: the request's thinking_token_budget. A request that also sets its own output format cannot
    have both."""
    if params.structured_outputs is not None:
        raise APIError(400, f"tool_choice: {setup.tool_choice.mode!r} cannot be combined with response_format / "
                            f"structured_outputs (both constrain the output)", param="tool_choice")
    params.structured_outputs = StructuredOutputsParams(structural_tag=forced_call_format(
        setup, room, server.token_markers, thinking_budget))
    setup.structured_field = "tool_choice"


def apply_thinking_budget(server: ServerState, req: P.ChatCompletionRequest, params: SamplingParams,
                          setup: ChatSetup, budget: int) -> None:
    """thinking_token_budget (vLLM's field): the thinking may take at most `budget` tokens, then the only token
    allowed is the end-of-thinking marker. Enforced by the same structured decoding as a forced call's thinking
    bound: the reasoning parser's thinking, then the answer - free text, or the request's own output format
    (response_format / structured_outputs) as an element of the same structural tag."""
    answer = answer_format(req, params) if params.structured_outputs is not None else {"type": "any_text"}
    tag = {"type": "structural_tag", "format": answer}
    params.structured_outputs = StructuredOutputsParams(structural_tag=setup.reasoning_parser.wrap_structural_tag(
        tag, setup.reasoning_state, budget, server.token_markers))
    setup.structured_field = "thinking_token_budget" if req.thinking_token_budget is not None else None


def answer_format(req: P.ChatCompletionRequest, params: SamplingParams) -> dict[str, Any]:
    """The request's own output format (response_format / structured_outputs) as one element of a structural tag,
    so that a larger format can hold it; a 400 naming the field when xgrammar cannot take it."""
    try:
        return format_element(params.structured_outputs)
    except (ValueError, RuntimeError) as exc:  # xgrammar's error for a schema it cannot take
        field = structured_field(req) or "structured_outputs"
        raise APIError(400, f"{field}: {exc}", param=field.split(".")[0]) from exc


def constrains_calls(server: ServerState, req: P.ChatCompletionRequest, setup: ChatSetup) -> bool:
    """Whether the output's tool calls are held to the offered tools (switch constrained_tool_calls): tool_choice
    "auto" with tools offered, and not beam search (which ranks beams by their raw logprobs, without a grammar)."""
    return setup.tool_choice.mode == "auto" and bool(setup.tools) and not req.use_beam_search \
        and server.engine.config.optimizations.constrained_tool_calls


def apply_auto_tool_format(server: ServerState, req: P.ChatCompletionRequest, params: SamplingParams,
                           setup: ChatSetup, room: int, thinking_budget: int | None) -> None:
    """tool_choice "auto", held to the offered tools (constrained_tool_calls): the tool parser's auto format (free
    text, and a call the model opens takes an offered tool's name and its parameters), or the request's own format
    or a call when it sets one; after the thinking the prompt allows (the reasoning parser's part, unconstrained
    but for the markers, bounded by thinking_token_budget; with a format and the model deciding whether to think,
    bounded so that the answer has room, as for a format alone)."""
    content = answer_format(req, params) if params.structured_outputs is not None else None
    tag = setup.tool_parser.auto_structural_tag(setup.tools, setup.parallel_tool_calls, server.token_markers,
                                                content)
    if setup.reasoning_parser and setup.reasoning_state != "closed":
        budget = thinking_budget
        if budget is None and content is not None and setup.reasoning_state == "none":
            budget = format_thinking_budget(room)
        tag = setup.reasoning_parser.wrap_structural_tag(tag, setup.reasoning_state, budget, server.token_markers)
    params.structured_outputs = StructuredOutputsParams(structural_tag=tag)
    setup.structured_field = "tools"


# -- the steps ------------------------------------------------------------------------------------------------
def check_model(server: ServerState, name: str | None) -> str:
    """The served name a request asked for (None: the first one); 404 for a name this server does not serve."""
    if name is None:
        return server.model_name
    if name not in server.model_names:
        served = ", ".join(f"`{n}`" for n in server.model_names)
        raise APIError(404, f"the model `{name}` does not exist; this server serves {served}", param="model")
    return name


def sampling_params(server: ServerState, req: P.SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    prompt_field: str, prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's SamplingParams, range-checked against the engine's limits and vocabulary (a 400 naming the
    request's field). The model's generation config supplies what the request leaves unset, and its extra EOS
    ids stop generation too."""
    try:
        req.structured_outputs_params()
    except ValueError as exc:
        field = str(exc).split(":", 1)[0].split(" ", 1)[0]
        raise APIError(400, str(exc), param=field.split(".", 1)[0]) from exc
    defaults = server.generation_defaults
    with engine_errors(req, prompt_field):
        params = req.sampling_params(max_tokens, logprobs, defaults.sampling, prompt_logprobs)
        params.validate(server.engine.config.max_logprobs, server.vocab_size)
    if defaults.eos_token_ids and not params.ignore_eos:
        params.stop_token_ids = list(dict.fromkeys(params.stop_token_ids + defaults.eos_token_ids))
    return params


def structured_field(req: P.SamplingRequest) -> str | None:
    return req.structured_outputs_params()[1]


async def compile_structured_outputs(server: ServerState, prepared: Prepared) -> None:
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


def request_error(exc: ValueError, default_param: str) -> APIError:
    """A 400 for a ValueError whose message starts with the request field at fault ("messages[1].content: ...")."""
    message = str(exc)
    head = message.split(": ", 1)[0]
    param = head if head and " " not in head else default_param
    return APIError(400, message, param=param.split(".")[0].split("[")[0])


def tokenize(server: ServerState, prompt: str | ElidedText | list[int], add_special_tokens: bool = True
             ) -> tuple[str | None, list[int]]:
    """A text prompt's ids (add_special_tokens: the tokenizer's BOS etc., as vLLM's completions default);
    token ids pass through as sent. A prompt elided at parse time (too long to tokenize) is refused here, where
    the character check has always stood, so errors keep their order (model, sampling, prompt count, length)."""
    if isinstance(prompt, (str, ElidedText)):
        check_prompt_chars(server.limits, server.max_model_len, prompt, "prompt")
        if isinstance(prompt, ElidedText):  # elided with the same limit, so the check above has refused it
            raise RuntimeError(f"{prompt!r} passed the character limit it was elided by")
        return prompt, server.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    outside = next((t for t in prompt if not 0 <= t < server.vocab_size), None)
    if outside is not None:  # before anything reads the ids (decoding one past the vocabulary overflows)
        raise APIError(400, f"prompt: Token id {outside} is out of vocabulary (the vocabulary has "
                            f"{server.vocab_size} tokens)", param="prompt")
    return None, prompt


def check_length(server: ServerState, ids: list[int], params: SamplingParams, req: P.SamplingRequest,
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
