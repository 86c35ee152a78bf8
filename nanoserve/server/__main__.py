"""python -m nanoserve.server: serve a model over an OpenAI-compatible HTTP API.

    python -m nanoserve.server                            # the embedded m3-tiny (random weights, made on first use)
    python -m nanoserve.server --model DIR --tensor-parallel-size 8 --max-model-len 32768 --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "m3-tiny", "prompt": "Hello", "max_tokens": 16}'

Routes (docs/server_api.md has every field and what is refused): POST /v1/completions, POST /v1/chat/completions,
GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET|POST /ping, POST /invocations, GET /load,
GET /version, GET /metrics, GET /openapi.json.

Engine flags use vLLM's names. Every optimization switch also has its own --<switch> / --no-<switch> pair,
generated from the switch declarations in nanoserve.config.Optimizations, so a new switch appears here by
itself. SIGINT / SIGTERM shut down gracefully: stop accepting connections, let in-flight requests finish (up to
--shutdown-timeout seconds), abort what is left, release the device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal

from nanoserve.config import DEVICES, DTYPES, LOGPROBS_MODES, SWITCH_ALIASES, EngineConfig, Optimizations
from nanoserve.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

logger = logging.getLogger("nanoserve.server")

DEFAULT_SHUTDOWN_TIMEOUT = 30.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nanoserve.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    bool_flag = argparse.BooleanOptionalAction

    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) clients send; the first is the default and the metrics' model_name "
                        "label (default: --model)")
    s.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $NANOSERVE_API_KEY, else none)")
    s.add_argument("--allowed-origins", type=json.loads, default=["*"], metavar="JSON",
                   help='CORS: the origins allowed, a JSON list (default ["*"])')
    s.add_argument("--allowed-methods", type=json.loads, default=["*"], metavar="JSON",
                   help='CORS: the methods allowed, a JSON list (default ["*"])')
    s.add_argument("--allowed-headers", type=json.loads, default=["*"], metavar="JSON",
                   help='CORS: the request headers allowed, a JSON list (default ["*"])')
    s.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, auth)")
    s.add_argument("--enable-server-load-tracking", action="store_true",
                   help="GET /load counts the generation requests in flight (otherwise it answers 0)")
    s.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                   help="seconds in-flight requests may take to finish after SIGINT/SIGTERM before being aborted")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    e = p.add_argument_group("engine (vLLM's names)")
    e.add_argument("--model", default="m3-tiny",
                   help="a checkpoint directory, or a preset: m3-tiny (default, generated on first use), m3-slice")
    e.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    e.add_argument("--dtype", default="auto", choices=DTYPES)
    e.add_argument("--device", default="auto", choices=DEVICES, help="auto = the GPU if there is one, else the CPU")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    e.add_argument("--enable-expert-parallel", action="store_true",
                   help="split whole experts across ranks instead of each expert's matrices")
    e.add_argument("--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings")
    e.add_argument("--block-size", type=int, default=None, help="KV block size; must equal the model's MSA block")
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--num-gpu-blocks-override", type=int, default=None, help="fix the KV pool size (blocks)")
    e.add_argument("--kv-cache-tokens", type=int, default=None, help="CPU only: the KV pool size in tokens")
    e.add_argument("--enable-prefix-caching", action=bool_flag, default=None)
    e.add_argument("--enable-chunked-prefill", action=bool_flag, default=None)
    e.add_argument("--enforce-eager", action=bool_flag, default=None, help="no CUDA/HIP graphs")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--max-waiting-requests", type=int, default=EngineConfig.max_waiting_requests,
                   help="queued sequences beyond which requests get 503 + Retry-After")
    e.add_argument("--max-logprobs", type=int, default=EngineConfig.max_logprobs,
                   help="the most logprobs / top_logprobs / prompt_logprobs a request may ask for")
    e.add_argument("--logprobs-mode", default=EngineConfig.logprobs_mode, choices=LOGPROBS_MODES,
                   help="what logprobs report: raw_* of the model's logits (default), processed_* of the logits "
                        "the draw used (after bias, penalties, temperature, top-k/p); *_logits as logits")

    c = p.add_argument_group("chat: tools, reasoning, template, sampling defaults (vLLM's names)")
    c.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    c.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                   help="read the model's tool-call markup into OpenAI tool_calls")
    c.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split the model's thinking into reasoning_content / reasoning")
    c.add_argument("--chat-template", default=None,
                   help="a jinja chat template (a file, or the template itself) instead of the tokenizer's")
    c.add_argument("--generation-config", default="auto",
                   help="default sampling parameters: auto = the model's generation_config.json, vllm = none, "
                        "or a directory holding a generation_config.json")
    c.add_argument("--override-generation-config", type=json.loads, default=None,
                   help='JSON fields that replace or extend the generation config, e.g. \'{"temperature": 0.7}\'')

    o = p.add_argument_group("optimization switches (Optimizations in nanoserve/config.py)")
    for sw in Optimizations.switches():
        o.add_argument(sw.flag, dest=f"switch_{sw.name}", action=bool_flag, default=None,
                       help=f"{sw.doc} (default: {'on' if sw.default else 'off'})".replace("%", "%%"))
    return p


def engine_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> EngineConfig:
    """EngineConfig from the flags; a switch flag and its vLLM alias must not contradict each other."""
    switches = {name: getattr(args, f"switch_{name}") for name in Optimizations.names()
                if getattr(args, f"switch_{name}") is not None}
    aliases = {alias: getattr(args, alias) for alias in SWITCH_ALIASES if getattr(args, alias) is not None}
    for alias, value in aliases.items():
        switch, on_value = SWITCH_ALIASES[alias]
        if switch in switches and switches[switch] != (value == on_value):
            parser.error(f"--{alias.replace('_', '-')} contradicts --{'' if switches[switch] else 'no-'}"
                         f"{switch.replace('_', '-')}")
    try:
        return EngineConfig.from_kwargs(
            model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
            tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
            max_model_len=args.max_model_len, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
            num_gpu_blocks_override=args.num_gpu_blocks_override, kv_cache_tokens=args.kv_cache_tokens,
            seed=args.seed, max_waiting_requests=args.max_waiting_requests, max_logprobs=args.max_logprobs,
            logprobs_mode=args.logprobs_mode,
            served_model_name=args.served_model_name[0] if args.served_model_name else None, optimizations=Optimizations().replace(**switches),
            **aliases)
    except ValueError as exc:
        parser.error(str(exc))


def chat_options(args: argparse.Namespace):
    from nanoserve.server.state import ChatOptions

    return ChatOptions(enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                       reasoning_parser=args.reasoning_parser, chat_template=args.chat_template,
                       generation_config=args.generation_config,
                       override_generation_config=args.override_generation_config)


def log_configuration(config: EngineConfig) -> None:
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "optimizations"}
    logger.info("configuration: %s", ", ".join(f"{k}={v}" for k, v in fields.items()))
    logger.info("switches: %s", config.optimizations.describe())


def _log_signal_after_shutdown(signum: int, frame) -> None:
    """uvicorn re-raises the signal that stopped it once it has shut down; by then everything is released, so a
    log line is all that is left to do (and the process exits 0)."""
    logger.info("stopped by %s", signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config(args, parser)
    chat = chat_options(args)
    try:
        chat.check()
    except ValueError as exc:
        parser.error(str(exc))
    log_configuration(config)

    import uvicorn

    from nanoserve.entrypoints.async_engine import AsyncLLMEngine
    from nanoserve.server.app import build_app

    try:
        engine = AsyncLLMEngine.from_config(config)  # loads the model (generating a preset the first time)
    except ValueError as exc:
        parser.exit(2, f"error: {exc}\n")
    names = args.served_model_name or [args.model]
    try:
        app = build_app(engine, names, api_key=args.api_key, shutdown_timeout=args.shutdown_timeout, chat=chat,
                        allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                        allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                        enable_server_load_tracking=args.enable_server_load_tracking)
    except ValueError as exc:
        engine.engine.shutdown()
        parser.exit(2, f"error: {exc}\n")
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=max(1, round(args.shutdown_timeout))))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _log_signal_after_shutdown)
    logger.info("serving %s on http://%s:%d (OpenAI API under /v1; /tokenize, /detokenize, /health, /metrics, "
                "/version, /load, /ping, /invocations)", ", ".join(f"`{n}`" for n in names), args.host, args.port)
    server.run()


if __name__ == "__main__":
    main()
