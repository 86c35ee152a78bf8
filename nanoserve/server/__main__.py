"""python -m nanoserve.server: serve a model over an OpenAI-compatible HTTP API.

    python -m nanoserve.server                            # m3-mini, the small trained M3 in the package
    python -m nanoserve.server --model DIR --tensor-parallel-size 8 --max-model-len 32768 --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "m3-mini", "prompt": "Hello", "max_tokens": 16}'

Routes (docs/server_api.md has every field and what is refused): POST /v1/completions, POST /v1/chat/completions,
POST /v1/responses, GET|DELETE /v1/responses/{response_id}, POST /v1/responses/{response_id}/cancel
(docs/responses_api.md), POST /v1/messages, POST /v1/messages/count_tokens (Anthropic's Messages API,
docs/anthropic_api.md), GET /v1/models, POST /tokenize, POST /detokenize, POST /v1/chat/completions/render,
POST /v1/completions/render (what a router asks a worker, docs/scale_out.md), GET /health, GET|POST /ping,
POST /invocations, GET /load, GET /version, GET /metrics, GET /openapi.json.

Engine flags use vLLM's names. Every optimization switch also has its own --<switch> / --no-<switch> pair,
generated from the switch declarations in nanoserve.config.Optimizations, so a new switch appears here by
itself. SIGINT / SIGTERM shut down gracefully: new requests get 503, in-flight requests finish (up to
--shutdown-timeout seconds), what is left is aborted (an error event and [DONE] for a stream, a JSON error
otherwise), the engine and its workers stop, exit 0; a second signal exits at once. If the engine dies the process
exits 1 (server/shutdown.py, docs/operating.md). Before the socket opens, the engine builds the kernels and captures
the decode graphs of the shapes it will meet, within --warmup-budget-s (engine/warmup.py; on the CPU: none).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys

from nanoserve.config import (
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    LOGPROBS_MODES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    SWITCH_ALIASES,
    EngineConfig,
    Optimizations,
)
from nanoserve.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from nanoserve.server.body_parser import DEFAULT_PARSE_PROCESSES, PARSE_PROCESS_MIN_BYTES
from nanoserve.server.http_connection import HTTP_PARSERS, resolve_http
from nanoserve.server.limits import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_REQUEST_BODY_TIMEOUT_S,
    DEFAULT_REQUEST_HEADER_TIMEOUT_S,
    ServerLimits,
)
from nanoserve.server.offload import OFFLOAD_MIN_BYTES
from nanoserve.server.responses.store import DEFAULT_STORE_SIZE

logger = logging.getLogger("nanoserve.server")

DEFAULT_SHUTDOWN_TIMEOUT = 30.0
GIL_SWITCH_INTERVAL_S = 0.0005
"""How long a thread may hold the GIL while another waits for it (Python's default: 5 ms). The engine thread and
the event loop share one process: with async scheduling the engine thread works while the device runs, and at
the default a loop that streams 64 responses gets the GIL in 5 ms slices - new requests then waited seconds for
their first token (W3 at C = 64: 6,295 output tok/s, TTFT p99 3.8 s; at 0.5 ms: 10,023 tok/s, p99 186 ms;
docs/operating.md)."""


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
    s.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info: the tokenizer's configuration and the chat template")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens 'token_id:N' instead of their text, unless a request sets "
                        "return_tokens_as_token_ids itself")
    s.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                   help="seconds in-flight requests may take to finish after SIGINT/SIGTERM before being aborted")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument("--uvicorn-log-level", default=None, choices=["debug", "info", "warning", "error", "critical"],
                   help="uvicorn's own log level (default: --log-level)")
    s.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each generation request as it is queued: its id, prompt size and sampling parameters "
                        "(the prompt text too, up to --max-log-len characters)")
    s.add_argument("--disable-log-requests", action="store_true",
                   help="vLLM's older flag: requests are not logged (the default; --enable-log-requests logs them)")
    s.add_argument("--max-log-len", type=int, default=0, metavar="CHARS",
                   help="with --enable-log-requests, log the first CHARS characters of each prompt (default 0: none)")
    s.add_argument("--disable-log-stats", action="store_true",
                   help="accepted as vLLM takes it: this server logs no periodic statistics (GET /metrics has them)")
    s.add_argument("--http", choices=HTTP_PARSERS, default="auto",
                   help="uvicorn's HTTP/1.1 parser: httptools (C; the default when installed, as uvicorn's auto) "
                        "or h11 (pure Python; copies large bodies several times on the event loop)")
    s.add_argument("--request-header-timeout", type=float, default=DEFAULT_REQUEST_HEADER_TIMEOUT_S,
                   help="seconds a request's line and headers may take to arrive before the client gets 408 and "
                        "its connection is closed (0: no limit)")
    s.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="larger request bodies get 413 (0: no limit)")
    s.add_argument("--request-body-timeout", type=float, default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
                   help="seconds a request body may pause before the request gets 408 and its connection is "
                        "closed (0: no limit)")
    s.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
                   help="a completions request with more prompts gets 400 (0: no limit)")
    s.add_argument("--max-prompt-chars", type=int, default=None,
                   help="a prompt (or rendered chat) with more characters gets 400 before it is tokenized "
                        "(default: 16 x max_model_len; 0: no limit)")
    s.add_argument("--offload-min-bytes", type=int, default=OFFLOAD_MIN_BYTES,
                   help="request bodies this large or larger are parsed, rendered and tokenized in a thread pool, "
                        "smaller ones on the event loop (0: every request in the pool)")
    s.add_argument("--parse-processes", type=int, default=DEFAULT_PARSE_PROCESSES,
                   help="worker processes that parse large request bodies, so that their parse does not hold "
                        "the server's GIL (at most the CPU count; 0: every body is parsed in the server process)")
    s.add_argument("--parse-process-min-bytes", type=int, default=PARSE_PROCESS_MIN_BYTES,
                   help="request bodies this large or larger are parsed in the worker processes (0: every body)")
    s.add_argument("--responses-store-size", type=int, default=DEFAULT_STORE_SIZE, metavar="N",
                   help="POST /v1/responses keeps the N most recent responses sent with store true, for GET "
                        "/v1/responses/{id} and previous_response_id (0: none are kept)")
    s.add_argument("--warmup-budget-s", type=float, default=None, metavar="SECONDS",
                   help="before the socket opens, build the kernels and capture the decode graphs of the shapes the "
                        "engine will meet, for at most this long (default: 120 on a GPU, 0 on the CPU; 0 skips; "
                        "docs/operating.md)")
    s.add_argument("--no-warmup", action="store_true", help="no warm-up: the same as --warmup-budget-s 0")
    s.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="image and video URLs (http, https) are fetched only from these hosts (default: none, only "
                        "data URLs are read; docs/vision.md)")
    s.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="file:// image and video URLs are read only under this directory (default: none; a "
                        "security risk: only in trusted environments)")
    s.add_argument("--max-media-bytes", type=int, default=None,
                   help="the largest image or video file fetched or read from a URL (default: 20 MiB)")
    s.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads when the model runs on the CPU (default: $NANOSERVE_CPU_THREADS, "
                        "else every physical core)")

    e = p.add_argument_group("engine (vLLM's names)")
    e.add_argument("--model", default="m3-mini",
                   help="a checkpoint directory, m3-mini (default: a small trained M3 that ships in the package), "
                        "or a preset with random weights: m3-tiny (generated on first use), m3-slice")
    e.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    e.add_argument("--trust-remote-code", action="store_true",
                   help="accepted as vLLM takes it: nanoserve implements M3 itself and runs no code from the "
                        "checkpoint, so there is nothing to trust")
    e.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto: the KV cache in the model's dtype; fp8 (= fp8_e4m3): e4m3 with per-tensor scales "
                        "(the checkpoint's k_scale / v_scale, else 1), twice the tokens in the same memory; "
                        "fp8_e5m2 is not supported")
    e.add_argument("--dtype", default="auto", choices=DTYPES)
    e.add_argument("--quantization", "-q", default=None, choices=[q for q in QUANTIZATIONS if q],
                   help="weight format (default: the checkpoint's, from config.json's quantization_config): mxfp8 "
                        "quantizes a bf16 checkpoint at load; bf16 dequantizes an MXFP8 checkpoint at load "
                        "(docs/mxfp8.md)")
    e.add_argument("--device", default="auto", choices=DEVICES, help="auto = the GPU if there is one, else the CPU")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    e.add_argument("--enable-expert-parallel", action="store_true",
                   help="split whole experts across ranks instead of each expert's matrices")
    e.add_argument("--worker-timeout", type=float, default=None, metavar="SECONDS",
                   help="tensor parallelism: a worker that does not answer this long (no heartbeat, or a step's "
                        "peers silent) fails the engine (default: $NANOSERVE_WORKER_TIMEOUT, else 30; 0: never)")
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
    e.add_argument("--scheduling-policy", default=EngineConfig.scheduling_policy, choices=SCHEDULING_POLICIES,
                   help="fcfs: first come, first served; priority: by each request's `priority` (lower first), "
                        "then arrival; preemption takes the worst first")
    e.add_argument("--max-logprobs", type=int, default=EngineConfig.max_logprobs,
                   help="the most logprobs / top_logprobs / prompt_logprobs a request may ask for")
    e.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'; method mtp, or eagle3 with "model": '
                        'DRAFT_DIR (docs/speculative_decoding.md)')
    e.add_argument("--spec-steps-per-launch", type=int, default=EngineConfig.spec_steps_per_launch, metavar="N",
                   help="with switch spec_multi_step (off by default): the most speculative steps one launch runs on "
                        "the device (docs/speculative_decoding.md)")
    e.add_argument("--kv-events-config", type=kv_events_config, default=None, metavar="JSON",
                   help='publish KV-cache events for KV-aware routers, vLLM\'s format over ZMQ, e.g. '
                        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5558"}\' (docs/scale_out.md)')
    e.add_argument("--kv-transfer-config", type=kv_transfer_config, default=None, metavar="JSON",
                   help='prefill/decode disaggregation, vLLM\'s shape: \'{"kv_connector": "NixlConnector", '
                        '"kv_role": "kv_producer"}\' on a prefill server, "kv_consumer" on a decode server '
                        '(side channel: VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT; docs/scale_out.md)')
    e.add_argument("--limit-mm-per-prompt", type=json.loads, default=None, metavar="JSON",
                   help='the most images and videos one prompt may carry, e.g. \'{"image": 4, "video": 1}\' '
                        '(default: 999 each; 0 refuses a modality)')
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
            model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, quantization=args.quantization,
            device=args.device,
            tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
            worker_timeout=args.worker_timeout,
            max_model_len=args.max_model_len, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
            num_gpu_blocks_override=args.num_gpu_blocks_override, kv_cache_tokens=args.kv_cache_tokens,
            kv_cache_dtype=args.kv_cache_dtype,
            seed=args.seed, max_waiting_requests=args.max_waiting_requests, max_logprobs=args.max_logprobs,
            scheduling_policy=args.scheduling_policy,
            logprobs_mode=args.logprobs_mode, speculative_config=args.speculative_config,
            spec_steps_per_launch=args.spec_steps_per_launch,
            kv_events_config=args.kv_events_config, kv_transfer_config=args.kv_transfer_config,
            limit_mm_per_prompt=args.limit_mm_per_prompt,
            served_model_name=args.served_model_name[0] if args.served_model_name else None,
            optimizations=Optimizations().replace(**switches), **aliases)
    except ValueError as exc:
        parser.error(str(exc))


def json_config(module: str, name: str):
    """An argparse type for a flag that takes a JSON object in the shape of config class `name` of `module`
    (imported when the flag is used): the object is checked by the class's from_dict, so that a bad one stops the
    start at once with its reason; the flag's value is the dict."""
    def convert(text: str) -> dict:
        import importlib

        try:
            value = json.loads(text)
            getattr(importlib.import_module(module), name).from_dict(value)
        except ValueError as exc:  # json.JSONDecodeError is one
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value
    return convert


speculative_config = json_config("nanoserve.spec_decode.config", "SpeculativeConfig")
kv_events_config = json_config("nanoserve.engine.kv_events", "KVEventsConfig")
kv_transfer_config = json_config("nanoserve.kv_transfer.config", "KVTransferConfig")


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


def server_limits(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ServerLimits:
    try:
        return ServerLimits(request_header_timeout=args.request_header_timeout,
                            max_request_body_bytes=args.max_request_body_bytes,
                            request_body_timeout=args.request_body_timeout,
                            max_prompts_per_request=args.max_prompts_per_request,
                            max_prompt_chars=args.max_prompt_chars)
    except ValueError as exc:
        parser.error(str(exc))


def media_rules(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """--allowed-media-domains, --allowed-local-media-path, --max-media-bytes -> what an image URL may name
    (multimodal/loader.py MediaRules)."""
    from nanoserve.multimodal.loader import MAX_MEDIA_BYTES, MediaRules

    max_bytes = MAX_MEDIA_BYTES if args.max_media_bytes is None else args.max_media_bytes
    if max_bytes < 1:
        parser.error(f"--max-media-bytes must be >= 1, got {max_bytes}")
    path = args.allowed_local_media_path
    if path is not None and not os.path.isdir(path):
        parser.error(f"--allowed-local-media-path: {path!r} is not a directory")
    return MediaRules(tuple(d.lower() for d in args.allowed_media_domains or ()), path, max_bytes)


def warmup_budget(args: argparse.Namespace, parser: argparse.ArgumentParser) -> float | None:
    """--warmup-budget-s / --no-warmup -> seconds (0: no warm-up), or None for the device's default; checked
    before the model loads."""
    budget = args.warmup_budget_s
    if budget is not None and budget < 0:
        parser.error(f"--warmup-budget-s must be >= 0, got {budget:g}")
    if args.no_warmup:
        if budget:
            parser.error(f"--no-warmup contradicts --warmup-budget-s {budget:g}")
        return 0.0
    return budget


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # the engine thread and the event loop share the GIL
    config = engine_config(args, parser)
    chat = chat_options(args)
    try:
        chat.check()
    except ValueError as exc:
        parser.error(str(exc))
    limits = server_limits(args, parser)
    if args.enable_log_requests and args.disable_log_requests:
        parser.error("--enable-log-requests contradicts --disable-log-requests")
    if args.max_log_len < 0:
        parser.error(f"--max-log-len must be >= 0, got {args.max_log_len}")
    if args.responses_store_size < 0:
        parser.error(f"--responses-store-size must be >= 0, got {args.responses_store_size}")
    try:
        http_parser = resolve_http(args.http)
    except ValueError as exc:
        parser.error(str(exc))
    warmup_s = warmup_budget(args, parser)
    log_configuration(config)

    import torch
    import uvicorn

    from nanoserve.cpu_threads import configure_cpu_threads
    from nanoserve.engine.warmup import DEFAULT_GPU_BUDGET_S, warm_up
    from nanoserve.entrypoints.async_engine import AsyncLLMEngine
    from nanoserve.server.app import build_app
    from nanoserve.server.http_connection import http_protocol
    from nanoserve.server.shutdown import GracefulServer

    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        try:
            logger.info("torch intra-op threads: %d", configure_cpu_threads(args.cpu_threads))
        except ValueError as exc:
            parser.error(str(exc))

    try:
        engine = AsyncLLMEngine.from_config(config)  # loads the model (generating a preset the first time)
    except ValueError as exc:
        parser.exit(2, f"error: {exc}\n")
    if warmup_s is None:  # nothing takes the Triton path on the CPU: start at once there
        warmup_s = DEFAULT_GPU_BUDGET_S if engine.engine.executor.device.type == "cuda" else 0.0
    try:  # before the socket opens, as vLLM: /health is unreachable until the engine is warm
        warm_up(engine.engine, warmup_s)
    except BaseException:
        engine.engine.shutdown()
        raise
    names = args.served_model_name or [args.model]
    try:
        app = build_app(engine, names, api_key=args.api_key, shutdown_timeout=args.shutdown_timeout, chat=chat,
                        allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                        allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                        enable_server_load_tracking=args.enable_server_load_tracking, limits=limits,
                        offload_min_bytes=args.offload_min_bytes, parse_processes=args.parse_processes,
                        parse_process_min_bytes=args.parse_process_min_bytes,
                        responses_store_size=args.responses_store_size,
                        log_requests=args.max_log_len if args.enable_log_requests else None,
                        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                        media_rules=media_rules(args, parser))
    except ValueError as exc:
        engine.engine.shutdown()
        parser.exit(2, f"error: {exc}\n")
    # GracefulServer drains before uvicorn's own shutdown starts, which then only closes idle connections
    http = http_protocol(http_parser, limits.request_header_timeout)
    server = GracefulServer(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.uvicorn_log_level or args.log_level,
                                           timeout_graceful_shutdown=5, http=http), app.state.lifecycle)
    logger.info("serving %s on http://%s:%d (OpenAI API under /v1: completions, chat/completions, responses, "
                "models; Anthropic's /v1/messages; /tokenize, /detokenize, /health, /metrics, "
                "/version, /load, /ping, /invocations)", ", ".join(f"`{n}`" for n in names), args.host, args.port)
    server.run()
    if engine.engine.kv_events is not None:  # (the engine's KV events publisher, --kv-events-config)
        engine.engine.kv_events.shutdown()
    if app.state.lifecycle.signal is not None:
        logger.info("stopped by %s", signal.Signals(app.state.lifecycle.signal).name)
    sys.exit(server.exit_code)


if __name__ == "__main__":
    main()
