"""ServerState: what every route shares - the engine, the tokenizers of the server's own (one per thread, see
offload.py), the body parser (body_parser.py), the served model names, the per-request limits, the metrics, the
API key, the count of requests in flight (/load), the Responses API's store and the chat options (ChatOptions:
tool calling, reasoning, the chat template, the generation defaults). build_app makes one and keeps it in
`app.state.server`; routes get it through the `Server` dependency (routing.py)."""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from typing import Any

from nanoserve.chat_template import load_chat_template
from nanoserve.entrypoints.async_engine import AsyncLLMEngine
from nanoserve.generation_config import load_generation_defaults
from nanoserve.multimodal.loader import MediaLoader, MediaRules
from nanoserve.multimodal.processor import MultiModalProcessor
from nanoserve.parsers import get_reasoning_parser, get_tool_call_parser
from nanoserve.server.body_parser import BodyParser
from nanoserve.server.limits import ServerLimits
from nanoserve.server.metrics import ServerMetrics
from nanoserve.server.offload import Offloader
from nanoserve.server.responses.store import DEFAULT_STORE_SIZE, ResponseStore

logger = logging.getLogger(__name__)


@dataclass
class ChatOptions:
    """The server's chat flags (vLLM's names): --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser,
    --chat-template, --generation-config, --override-generation-config."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None

    def check(self) -> None:
        """ValueError naming the flag for a combination vLLM refuses too."""
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")


class ServerState:
    """The server's shared state. Holds no per-request state: a request's data lives in its route call."""

    def __init__(self, engine: AsyncLLMEngine, served_model_names: str | list[str], api_key: str | None = None,
                 chat: ChatOptions | None = None, enable_server_load_tracking: bool = False,
                 limits: ServerLimits | None = None, offloader: Offloader | None = None,
                 parser: BodyParser | None = None, responses_store_size: int = DEFAULT_STORE_SIZE,
                 log_requests: int | None = None, return_tokens_as_token_ids: bool = False,
                 media_rules: MediaRules | None = None):
        self.engine = engine
        self.model_names = [served_model_names] if isinstance(served_model_names, str) else list(served_model_names)
        if not self.model_names or not all(isinstance(n, str) and n for n in self.model_names):
            raise ValueError(f"served model names must be non-empty strings, got {served_model_names!r}")
        self.model_name = self.model_names[0]  # the default, and the metrics' model_name label (as vLLM)
        self.api_key = api_key
        self.limits = limits or ServerLimits()
        self.offload = offloader or Offloader(engine.get_tokenizer)
        self.offload.tokenizer()  # the event loop thread's, loaded now rather than by the first request
        self.parser = parser or BodyParser(self.offload)  # request bodies -> request models (body_parser.py)
        self.lifecycle: Any = None  # shutdown.Lifecycle, set by build_app: is the server draining?
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.engine.model_config.vocab_size
        self.metrics = ServerMetrics(self.model_name, engine)
        self.track_load = enable_server_load_tracking
        self.server_load = 0  # generation requests in flight, counted when track_load (GET /load)
        self.responses = ResponseStore(responses_store_size)  # POST /v1/responses with store: true
        self.log_requests = log_requests  # None, or how many prompt characters a request's log line shows
        self.return_tokens_as_token_ids = return_tokens_as_token_ids  # --return-tokens-as-token-ids
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)
        self.completion_token = functools.lru_cache(maxsize=1 << 16)(self._completion_token)

        # images and videos: what a request may point at, and the processor (None: the model takes none)
        self.media_loader = MediaLoader(media_rules)
        self.vision_config = engine.engine.vision_config
        self.processor = MultiModalProcessor.from_model_dir(engine.engine.executor.model_dir) \
            if self.vision_config is not None else None

        self.chat = chat = chat or ChatOptions()
        chat.check()
        self.tool_parser = get_tool_call_parser(chat.tool_call_parser) if chat.tool_call_parser else None
        self.reasoning_parser = get_reasoning_parser(chat.reasoning_parser) if chat.reasoning_parser else None
        self.chat_template = load_chat_template(chat.chat_template)
        model_dir = engine.engine.executor.model_dir
        self.generation_defaults = load_generation_defaults(
            chat.generation_config, model_dir, engine.engine.eos_token_id, chat.override_generation_config)
        if self.generation_defaults.sampling or self.generation_defaults.eos_token_ids:
            logger.info("default sampling parameters from the model's generation config (requests that set them "
                        "override them; --generation-config vllm turns this off): %s",
                        self.generation_defaults.describe())
        # a tokenizer that marks a parser's markers as special tokens would drop them from the decoded text
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        special = {t.content for t in decoder.values() if getattr(t, "special", False)}
        markers = [m for p in (self.tool_parser, self.reasoning_parser) if p for m in p.markers]
        self.parsers_need_special_tokens = any(m in special for m in markers)
        # markers the tokenizer has as one token: a forced call's format matches each as that token
        self.token_markers = frozenset(m for m in markers
                                       if len(self.tokenizer.encode(m, add_special_tokens=False)) == 1)
        self.reasoning_end_id = self._reasoning_end_id()
        # the start marker's token (None if it is not one): where a generated thinking block begins (reasoning
        # token counts, responses/convert.py)
        start = self.reasoning_parser.start if self.reasoning_parser else None
        self.reasoning_start_id = self.tokenizer.convert_tokens_to_ids(start) if start in self.token_markers \
            else None

    def _reasoning_end_id(self) -> int | None:
        """The token of the reasoning parser's end-of-thinking marker: structured outputs apply after it (vLLM's
        rule with a reasoning parser). None without a parser, or when the marker is not one token (the format then
        holds the whole output, as before this rule, and the log says so)."""
        if self.reasoning_parser is None:
            return None
        ids = self.tokenizer.encode(self.reasoning_parser.end, add_special_tokens=False)
        if len(ids) == 1:
            return ids[0]
        logger.warning("the reasoning parser's end marker %r is %d tokens in this tokenizer, not one: structured "
                       "outputs will hold the thinking too", self.reasoning_parser.end, len(ids))
        return None

    @property
    def prompt_chars_limit(self) -> int:
        """--max-prompt-chars in effect (0: no limit): prompts longer than this are refused before tokenizing."""
        return self.limits.prompt_chars_limit(self.max_model_len)

    @property
    def tokenizer(self):
        """The calling thread's tokenizer (fast tokenizers must not be shared between threads)."""
        return self.offload.tokenizer()

    def _token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (what logprobs show); cached in `token_text`."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_token(self, token_id: int) -> str:
        """A token as the completions logprobs name it: its text, or - for a token that is part of a character
        (its bytes are no UTF-8 text alone, so its text is U+FFFD, like a hundred other tokens') - its bytes, as
        OpenAI's completions API writes them ("bytes:\\xe2\\x80"). top_logprobs is an object keyed by these
        names: byte tokens named by their text would overwrite one another and leave fewer than `logprobs`
        entries. Cached in `completion_token`."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return text
        raw = token_bytes(self.tokenizer, token_id)
        try:
            raw.decode("utf-8") if raw is not None else None
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text

    def tokens_as_ids(self, req) -> bool:
        """Whether a request's logprobs name tokens 'token_id:N': its return_tokens_as_token_ids when it sets it,
        else the server's --return-tokens-as-token-ids (vLLM's rule)."""
        own = getattr(req, "return_tokens_as_token_ids", None)
        return self.return_tokens_as_token_ids if own is None else bool(own)

    def token_name(self, token_id: int, as_id: bool, completions: bool = False) -> str:
        """A token as logprobs name it: its text (`completions`: as the completions format names it,
        completion_token), or 'token_id:N' (return_tokens_as_token_ids)."""
        if as_id:
            return f"token_id:{token_id}"
        return self.completion_token(token_id) if completions else self.token_text(token_id)


BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
"""A byte-fallback token of a SentencePiece vocabulary."""


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: the character a byte-level vocabulary writes for a byte -> the
    byte (printable Latin-1 bytes stand for themselves, the others for characters from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def token_bytes(tokenizer, token_id: int) -> bytes | None:
    """A token's bytes, from its vocabulary entry: a byte-level BPE entry or a SentencePiece byte token (None for
    a vocabulary of neither kind)."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return None
    byte = BYTE_TOKEN.fullmatch(piece)
    if byte:
        return bytes([int(byte.group(1), 16)])
    alphabet = byte_level_alphabet()
    if all(ch in alphabet for ch in piece):
        return bytes(alphabet[ch] for ch in piece)
    return None
