"""What POST /v1/completions and POST /v1/chat/completions share: the sampling fields and the SamplingParams
they make, the output format (response_format), the fields refused by name, and the answer's usage and
prompt_logprobs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_serializer, model_validator

from nanoserve.kv_transfer import params as kv_params
from nanoserve.sampling import MAX_SEED, MIN_SEED, SamplingParams, StructuredOutputsParams
from nanoserve.server.schema_base import Int, RequestBody, RequestModel, ResponseModel

REMOVED_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                         "guided_whitespace_pattern")
"""vLLM's old structured-output fields, which it no longer has (structured_outputs replaced them): a 400 names them."""


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    """Send one more chunk before [DONE], with no choices and the request's token usage."""
    continuous_usage_stats: bool | None = False
    """With include_usage: every chunk also carries the usage so far (its choice's completion tokens)."""


# Fields of OpenAI's or vLLM's API that this server knows but cannot honour: a request that uses one (with a value
# other than its neutral one) gets a 400 naming it, rather than an answer that silently ignored it.
UNSUPPORTED_FIELDS: dict[str, tuple[object, str]] = {
    "logits_processors": (None, "not supported by this server"),
    "truncate_prompt_tokens": (None, "prompts are never truncated: a prompt that does not fit is a 400"),
    "spaces_between_special_tokens": (True, "not supported by this server"),
    "mm_processor_kwargs": (None, "this server serves text only"),
    "audio": (None, "this server serves text only"),
    "prediction": (None, "predicted outputs are not supported"),
    "web_search_options": (None, "web search is not available"),
    "functions": (None, "the deprecated functions API is not supported: use tools"),
    "function_call": (None, "the deprecated functions API is not supported: use tool_choice"),
    "documents": (None, "not supported by this server"),
}


# Fields beam search cannot honour (it ranks beams by their raw logprobs, and a beam ends at EOS or max_tokens):
# with use_beam_search, a value other than these neutral ones is a 400 naming the field.
BEAM_SEARCH_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,), "seed": (), "stop": ([], ""), "stop_token_ids": ([],), "logit_bias": ({},),
    "min_tokens": (0,), "allowed_token_ids": (), "bad_words": ([],), "prompt_logprobs": (),
    "response_format": (), "structured_outputs": (),
}


class JsonSchemaFormat(RequestModel):
    """response_format.json_schema (OpenAI's shape). The schema is always enforced, whatever `strict` says."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """response_format: "text" (no constraint), "json_object" (any JSON object), "json_schema" (the output follows
    json_schema.schema), or "structural_tag" (an xgrammar structural tag: its `format`)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _parts(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format.json_schema.schema: this field is required for type json_schema")
        if self.type == "structural_tag" and self.format is None:
            raise ValueError("response_format.format: this field is required for type structural_tag")
        return self

    def constraint(self) -> dict[str, Any]:
        """The StructuredOutputsParams constraint it stands for ({} for text)."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            return {"json": self.json_schema.schema_}
        if self.type == "structural_tag":
            return {"structural_tag": {"type": "structural_tag", "format": self.format}}
        return {}


class SamplingRequest(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions: the model and how to sample."""

    model: str | None = None
    """One of the served model names; left out, the first one (as vLLM)."""
    n: Int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    """Any int64 (vLLM's range, checked as vLLM does, by the request model): the same seed gives the same tokens
    whatever else is in the batch."""
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    """Token id (as a string) -> value in [-100, 100] added to its logit: -100 bans the token, +100 forces it."""
    # vLLM extensions
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    """vLLM's structured outputs: exactly one of json, regex, choice, grammar, json_object, structural_tag, plus
    the options disable_any_whitespace, disable_additional_properties (sampling.StructuredOutputsParams)."""
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    allowed_token_ids: list[Int] | None = None
    """Only these tokens may be generated."""
    bad_words: list[str] | None = None
    """Words never to generate (their last token is banned after the tokens before it)."""
    prompt_logprobs: Int | None = None
    """Logprobs of every prompt token (None for the first) and this many alternatives; not with stream."""
    prompt_logprobs_temperature: float | None = None
    """The prompt logprobs are of the logits divided by this (vLLM's; > 0, default 1)."""
    return_token_ids: bool | None = None
    """Put the prompt's and each choice's token ids in the response (streamed: the prompt's in the first chunk,
    then each chunk's new ids)."""
    return_tokens_as_token_ids: bool | None = None
    """In logprobs, name tokens as 'token_id:N' instead of their text."""
    use_beam_search: bool = False
    """Beam search instead of sampling (vLLM's): `n` is the beam width, the choices are the best n beams, best
    first (nanoserve/entrypoints/beam_search.py). Fields that change how tokens are drawn or when they stop
    (BEAM_SEARCH_UNSUPPORTED) are refused with it, by name."""
    length_penalty: float = 1.0
    """With use_beam_search: beams are ranked by cumulative logprob / length ** length_penalty (vLLM's)."""
    priority: Int = 0
    """With --scheduling-policy priority: lower is served sooner (vLLM's); under first come, first served any
    other value than 0 is a 400."""
    cache_salt: str | None = None
    """Only requests with the same salt share prefix-cache blocks (vLLM's field: for several tenants on one
    server, so that none can learn another's prompts from how fast its own come back)."""
    kv_transfer_params: dict[str, Any] | None = None
    """Prefill/decode disaggregation, vLLM's request-level protocol (what vllm-router --vllm-pd-disaggregation
    sends; nanoserve/kv_transfer/params.py): do_remote_decode on a prefill server, do_remote_prefill with the
    prefill answer's fields on a decode server. Needs a server started with --kv-transfer-config."""

    @model_validator(mode="before")
    @classmethod
    def _known_but_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, (neutral, why) in UNSUPPORTED_FIELDS.items():
                if name in data and data[name] != neutral and data[name] is not None:
                    raise ValueError(f"{name}: {why}")
            modalities = data.get("modalities")
            if modalities is not None and modalities != ["text"]:
                raise ValueError("modalities: this server answers in text only")
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, v: Any) -> Any:
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            return v
        raise ValueError("must be a string or a list of strings")

    @field_validator("cache_salt", mode="after")
    @classmethod
    def _salt(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("must be a non-empty string")
        return v

    @field_validator("kv_transfer_params", mode="after")
    @classmethod
    def _kv_transfer(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            kv_params.parse(v)
        except ValueError as e:  # its message names the field: kv_transfer_params.<field> ...
            raise ValueError(str(e).removeprefix("kv_transfer_params").lstrip(".: ")) from None
        return v

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _token_id_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        bad = [k for k in v or () if not k.strip().isdigit()]
        if bad:
            raise ValueError(f"keys must be token ids (non-negative integers as strings), got "
                             f"{', '.join(map(repr, bad))}")
        return v

    @model_validator(mode="after")
    def _combinations(self) -> "SamplingRequest":
        # as vLLM: an empty stream_options object is allowed without stream, any option is not
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.use_beam_search:
            for name, neutral in BEAM_SEARCH_UNSUPPORTED.items():
                value = getattr(self, name)
                if value is not None and value not in neutral and not (name == "response_format"
                                                                       and value.type == "text"):
                    raise ValueError(f"{name}: not supported with use_beam_search (beams are ranked by their "
                                     f"logprobs and end at EOS or max_tokens)")
        elif self.length_penalty != 1.0:
            raise ValueError("length_penalty: only used with use_beam_search")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available when stream is true")
        transfer = kv_params.parse(self.kv_transfer_params)
        if transfer is not None:
            if self.n != 1 or self.use_beam_search:
                raise ValueError("kv_transfer_params: only with n 1 and without use_beam_search (the KV blocks of "
                                 "one sequence move between the servers)")
            if isinstance(transfer, kv_params.RemoteDecode) and self.stream:
                raise ValueError("kv_transfer_params: do_remote_decode needs stream false (the answer's "
                                 "kv_transfer_params name the blocks kept for the decode server)")
        for name in REMOVED_GUIDED_FIELDS:
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: not supported; vLLM replaced the guided_* fields with structured_outputs "
                                 f"(e.g. \"structured_outputs\": {{\"json\": ...}}) and response_format")
        return self

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's output constraint and the request field it came from (for error messages): from
        response_format and/or structured_outputs (as vLLM, response_format's constraint joins the options of
        structured_outputs; two constraints are an error). Raises ValueError naming the field."""
        fmt = self.response_format.constraint() if self.response_format is not None else {}
        if self.structured_outputs is None and not fmt:
            return None, None
        fields = dict(self.structured_outputs or {})
        if fmt:
            clash = [k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                     if fields.get(k) is not None]
            if clash:
                raise ValueError(f"response_format: cannot be combined with structured_outputs.{clash[0]} (set one "
                                 f"constraint)")
            fields.update(fmt)
        where = "response_format" if fmt else "structured_outputs"
        if self.response_format is not None and self.response_format.type == "json_schema":
            where = "response_format.json_schema.schema"
        try:
            return StructuredOutputsParams.from_dict(fields), where
        except (TypeError, ValueError) as e:
            raise ValueError(str(e) if str(e).startswith("structured_outputs") else f"structured_outputs: {e}") \
                from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any] | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams for this request; `defaults` (the model's generation config) fill the fields it leaves
        unset. Raises ValueError naming the parameter if a value is out of range."""
        base = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                **(defaults or {})}

        def given(name: str) -> Any:
            value = getattr(self, name)
            return base[name] if value is None else value

        return SamplingParams(
            n=self.n, temperature=given("temperature"), top_p=given("top_p"), top_k=given("top_k"),
            min_p=given("min_p"), repetition_penalty=given("repetition_penalty"),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            prompt_logprobs_temperature=self.prompt_logprobs_temperature,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words or None,
            skip_special_tokens=self.skip_special_tokens, structured_outputs=self.structured_outputs_params()[0])

    def request_field(self, sampling_field: str) -> str:
        """The request's name for a SamplingParams field (for error messages)."""
        return sampling_field

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: include_usage and continuous_usage_stats both set."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


# -- the answer's parts both endpoints share -------------------------------------------------------------------
class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0
    image_tokens: int | None = None
    """With images: the prompt's image placeholder tokens (counted in prompt_tokens too)."""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class PromptLogprob(ResponseModel):
    """One entry of prompt_logprobs (vLLM's Logprob)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


