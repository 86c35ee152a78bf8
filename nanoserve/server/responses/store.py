"""The Responses API's store: the most recent finished responses, for GET /v1/responses/{id} and for
previous_response_id, bounded so that clients cannot grow the server's memory without limit."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from nanoserve.server.errors import APIError
from nanoserve.server.responses import schema as R

DEFAULT_STORE_SIZE = 256
"""Responses kept for GET /v1/responses/{id} and previous_response_id (--responses-store-size): the oldest goes
when a new one comes, so a client cannot grow the server's memory without bound."""


@dataclass
class StoredResponse:
    response: R.Response
    conversation: list[dict[str, Any]]
    """The turn's chat messages without its instructions, the answer last: what previous_response_id continues."""


class ResponseStore:
    """The most recent `capacity` stored responses, by id (0: none are kept, as vLLM without its store)."""

    def __init__(self, capacity: int = DEFAULT_STORE_SIZE):
        if capacity < 0:
            raise ValueError(f"--responses-store-size must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        if not self.capacity:
            return
        self._items[stored.response.id] = stored
        self._items.move_to_end(stored.response.id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The stored response, or a 404 naming `param`."""
        if response_id not in self._items:
            raise APIError(404, f"{param}: no stored response has the id {response_id!r} (the server keeps the "
                                f"{self.capacity} most recent responses sent with store true)", param=param)
        return self._items[response_id]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]
