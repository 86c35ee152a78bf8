"""OpenAIServer: what every route shares - the engine, a tokenizer of the server's own, the served model names,
the metrics, the API key and the count of requests in flight (/load). build_app makes one and keeps it in
`app.state.server`; routes get it through the `Server` dependency (routes/common.py)."""

from __future__ import annotations

import functools

from nanoserve.entrypoints.async_engine import AsyncLLMEngine
from nanoserve.server.metrics import ServerMetrics


class OpenAIServer:
    """The server's shared state. Holds no per-request state: a request's data lives in its route call."""

    def __init__(self, engine: AsyncLLMEngine, served_model_names: str | list[str], api_key: str | None = None,
                 enable_server_load_tracking: bool = False):
        self.engine = engine
        self.model_names = [served_model_names] if isinstance(served_model_names, str) else list(served_model_names)
        if not self.model_names or not all(isinstance(n, str) and n for n in self.model_names):
            raise ValueError(f"served model names must be non-empty strings, got {served_model_names!r}")
        self.model_name = self.model_names[0]  # the default, and the metrics' model_name label (as vLLM)
        self.api_key = api_key
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.engine.model_config.vocab_size
        self.metrics = ServerMetrics(self.model_name, engine)
        self.track_load = enable_server_load_tracking
        self.server_load = 0  # generation requests in flight, counted when track_load (GET /load)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (what logprobs show); cached in `token_text`."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_name(self, token_id: int, as_id: bool) -> str:
        """A token as logprobs name it: its text, or 'token_id:N' (return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if as_id else self.token_text(token_id)
