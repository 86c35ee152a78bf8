"""GET /v1/models: the served models."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nanoserve.server.schema_base import ResponseModel, now


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "nanoserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
