"""OpenAIServer: what every route shares - the engine, a tokenizer of the server's own, the served model name,
the metrics and the API key. build_app makes one and keeps it in `app.state.server`; routes get it through the
`Server` dependency (routes/common.py)."""

from __future__ import annotations

import functools

from nanoserve.entrypoints.async_engine import AsyncLLMEngine
from nanoserve.server.metrics import ServerMetrics


class OpenAIServer:
    """The server's shared state. Holds no per-request state: a request's data lives in its route call."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None):
        self.engine = engine
        self.model_name = served_model_name
        self.api_key = api_key
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.max_model_len
        self.metrics = ServerMetrics(served_model_name)
        engine.finish_listeners.append(self.metrics.observe_finished)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (what logprobs show); cached in `token_text`."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
