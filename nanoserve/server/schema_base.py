"""What every API's request and response bodies build on - OpenAI's (openai/schema/), the Responses API's
(responses/schema.py) and Anthropic's Messages API's (anthropic/schema.py): the strict request base, the integer
that takes 1.0, the response base, and the error body the server answers with on every route but Anthropic's.

Requests are parsed strictly - "10" is not an integer, 1.5 is not an integer, true is not a number - so a wrong
type is a 400 that names the field instead of a silent conversion (one exception, as in vLLM's models: an integer
field takes an integral float, n=1.0). Unknown fields are ignored (clients send fields such as `store` or
`service_tier`) and logged (RequestBody.ignored_fields)."""

from __future__ import annotations

import time
from functools import cache
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, PrivateAttr, ValidatorFunctionWrapHandler, model_validator


def _integral(v: Any) -> Any:
    """1.0 -> 1: vLLM's request models (pydantic in lax mode) take a float with no fractional part as an
    integer; 1.5, "1" and true stay errors here."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


Int = Annotated[int, BeforeValidator(_integral)]
"""An integer field that also takes an integral float (n=1.0), as vLLM's requests do."""


class RequestModel(BaseModel):
    """A request body: strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class RequestBody(RequestModel):
    """A whole request body (an endpoint's top-level model). It notes the top-level fields it ignored, which the
    server logs as vLLM does; reading them off the parsed input costs nothing, where parsing the body a second
    time to find them would cost as much as the first parse."""

    _ignored_fields: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored_fields(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, cls):
            known = _known_keys(cls)
            model._ignored_fields = tuple(sorted(k for k in data if k not in known))
        return model

    @property
    def ignored_fields(self) -> tuple[str, ...]:
        """The body's top-level keys that are not fields of this model (nor their aliases), sorted."""
        return self._ignored_fields

    def elide_long_prompts(self, max_chars: int) -> None:
        """Replace each text prompt of more than `max_chars` characters by an ElidedText of its length (the
        prompt would be refused by --max-prompt-chars anyway). A body parsed in a worker process comes back to
        the server without its huge prompt, so the server neither unpickles nor holds it. Endpoints without
        text prompts of their own keep this no-op."""


class ElidedText:
    """A text prompt dropped after parsing because it is longer than the server tokenizes: only its length,
    which the character-limit check (limits.check_prompt_chars) reads to refuse it with the usual 400."""

    __slots__ = ("chars",)

    def __init__(self, chars: int):
        self.chars = chars

    def __len__(self) -> int:
        return self.chars

    def __repr__(self) -> str:
        return f"ElidedText({self.chars} characters)"

    @classmethod
    def of(cls, value: Any, max_chars: int) -> Any:
        """`value` itself, or an ElidedText of its length when it is a text of more than `max_chars` characters."""
        return cls(len(value)) if isinstance(value, str) and len(value) > max_chars else value


@cache
def _known_keys(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


class ResponseModel(BaseModel):
    """A response body: exactly the fields declared."""

    model_config = ConfigDict(extra="forbid")


def now() -> int:
    """The time as bodies stamp it (`created`, `created_at`): whole seconds since the epoch."""
    return int(time.time())


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: int
    """The HTTP status, as vLLM sends it."""


class ErrorResponse(ResponseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}} - what every route but Anthropic's
    answers an error with (vLLM's shape; errors.py)."""

    error: ErrorInfo
