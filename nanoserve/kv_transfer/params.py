"""The request-level P/D protocol: `kv_transfer_params`, as vLLM's NixlConnector reads and writes it.

vllm-router's `--vllm-pd-disaggregation` drives a request through two servers:

1. To a prefill server: the client's request with `max_tokens` 1, `stream` false and

       "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                              "remote_block_ids": null, "remote_host": null, "remote_port": null}

   It computes the prompt's KV and one token, keeps the blocks, and its answer (finish_reason "length") carries

       "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[3, 7, 1]],
                              "remote_engine_id": "<its engine_id>", "remote_request_id": "<its request id>",
                              "remote_host": "<side channel host>", "remote_port": <side channel port>,
                              "tp_size": 1}

   (`remote_block_ids` holds one list per KV cache group; nanoserve has one, K/V and MSA index keys sharing block
   ids.) A prefill that ends otherwise (a stop, an abort) answers no kv_transfer_params and frees its blocks.
2. To a decode server: the client's original request with those kv_transfer_params. It pulls the blocks its own
   prefix cache lacks from the prefill server, tells it they were read (so it frees them), and decodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RemoteDecode:
    """On a prefill server: compute the prompt, then keep its blocks until a decode server pulls them."""


@dataclass(frozen=True)
class RemotePrefill:
    """On a decode server: the prompt's KV is on `engine_id`'s blocks `block_ids`; pull, then decode."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    tp_size: int = 1


def _fail(field: str, what: str) -> ValueError:
    return ValueError(f"kv_transfer_params.{field} {what}")


def parse(params: Any) -> RemoteDecode | RemotePrefill | None:
    """A request's `kv_transfer_params` -> what this server must do for it (None: nothing). A ValueError names
    the field that is wrong (the server answers 400 with it)."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be a JSON object")
    remote_decode, remote_prefill = params.get("do_remote_decode"), params.get("do_remote_prefill")
    for name, value in (("do_remote_decode", remote_decode), ("do_remote_prefill", remote_prefill)):
        if value is not None and not isinstance(value, bool):
            raise _fail(name, f"must be true or false, got {value!r}")
    if remote_decode and remote_prefill:
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true")
    if remote_decode:
        return RemoteDecode()
    if not remote_prefill:
        return None
    engine_id, request_id = params.get("remote_engine_id"), params.get("remote_request_id")
    host, port = params.get("remote_host"), params.get("remote_port")
    for name, value in (("remote_engine_id", engine_id), ("remote_request_id", request_id), ("remote_host", host)):
        if not isinstance(value, str) or not value:
            raise _fail(name, f"must be a non-empty string with do_remote_prefill, got {value!r}")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise _fail("remote_port", f"must be a port number with do_remote_prefill, got {port!r}")
    tp_size = params.get("tp_size", 1)
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise _fail("tp_size", f"must be an integer >= 1, got {tp_size!r}")
    return RemotePrefill(engine_id, request_id, host, port, block_ids(params.get("remote_block_ids")), tp_size)


def block_ids(value: Any) -> tuple[int, ...]:
    """remote_block_ids: one list per KV cache group ([[3, 7, 1]], vLLM's current form) or a flat list (its
    earlier form) -> the block ids of the one group nanoserve has."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]
    elif isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        raise _fail("remote_block_ids", f"has {len(value)} KV cache groups; this engine has one")
    if not isinstance(value, list) or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                                              for b in value):
        raise _fail("remote_block_ids", f"must be a list of block ids with do_remote_prefill, got {value!r}")
    return tuple(value)


def prefill_answer(engine_id: str, request_id: str, block_ids: list[int], host: str, port: int,
                   tp_size: int = 1) -> dict[str, Any]:
    """The kv_transfer_params a prefill server's answer carries (vLLM's NixlConnector.request_finished)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(block_ids)],
            "remote_engine_id": engine_id, "remote_request_id": request_id, "remote_host": host,
            "remote_port": port, "tp_size": tp_size}


def pull_plan(remote: tuple[int, ...] | list[int], local_new: list[int]) -> list[tuple[int, int]]:
    """(remote block, local block) pairs to read. The decode server's own prefix cache may already hold the
    prompt's first blocks: it allocates blocks only for the rest (`local_new`) and reads the matching tail of the
    remote blocks (vLLM's rule); none when its cache holds the whole prompt."""
    if len(local_new) > len(remote):
        raise ValueError(f"{len(local_new)} local blocks to fill from {len(remote)} remote blocks")
    tail = list(remote[len(remote) - len(local_new):]) if local_new else []
    return list(zip(tail, local_new))
