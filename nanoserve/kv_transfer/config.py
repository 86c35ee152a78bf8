"""`--kv-transfer-config`: vLLM's KVTransferConfig, the same keys and defaults.

    {"kv_connector": "NixlConnector", "kv_role": "kv_both"}                      what vLLM's P/D examples pass
    {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": "prefill-0",
     "kv_connector_extra_config": {"backends": ["UCX"]}}

Only NixlConnector is served (the connector vllm-router's `--vllm-pd-disaggregation` drives by default). Its side
channel - where a decode server fetches a prefill server's pool layout and NIXL agent - is set as vLLM sets it, by
VLLM_NIXL_SIDE_CHANNEL_HOST (default localhost) and VLLM_NIXL_SIDE_CHANNEL_PORT (default 5600); a prefill server
frees the blocks a decode server has not pulled after VLLM_NIXL_ABORT_REQUEST_TIMEOUT seconds (default 480).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from nanoserve.config import from_json_object

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("NixlConnector",)
LOAD_FAILURE_POLICIES = ("recompute", "fail")
DEFAULT_SIDE_CHANNEL_PORT = 5600
DEFAULT_ABORT_TIMEOUT_S = 480.0


@dataclass
class KVTransferConfig:
    """vLLM's KVTransferConfig (vllm/config/kv_transfer.py): every key it takes; the ones NIXL does not use
    (kv_buffer_size, kv_rank, kv_parallel_size, kv_ip, kv_port: other connectors' settings) are accepted and
    ignored, as vLLM's NixlConnector ignores them."""

    kv_connector: str | None = None
    engine_id: str | None = None
    """This engine's name in the transfer (the prefill answer's remote_engine_id); default a fresh uuid."""
    kv_buffer_device: str | None = "cuda"
    kv_buffer_size: float = 1e9
    kv_role: str | None = None
    """kv_producer (a prefill server), kv_consumer (a decode server) or kv_both."""
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    """NixlConnector reads "backends" (default ["UCX"])."""
    kv_connector_module_path: str | None = None
    enable_permute_local_kv: bool = False
    kv_load_failure_policy: str = "fail"
    """A decode whose KV cannot be pulled: "fail" the request, or "recompute" its prompt locally."""

    def __post_init__(self) -> None:
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError(f"kv_transfer_config: kv_role is needed with kv_connector ({', '.join(KV_ROLES)})")
        if self.kv_connector is not None and self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config: kv_connector {self.kv_connector!r} is not served here "
                             f"(served: {', '.join(CONNECTORS)})")
        if self.kv_connector_module_path is not None:
            raise ValueError("kv_transfer_config: kv_connector_module_path (a connector loaded from a module) is not "
                             "supported")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_transfer_config: kv_load_failure_policy must be one of "
                             f"{', '.join(LOAD_FAILURE_POLICIES)}, got {self.kv_load_failure_policy!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config: kv_connector_extra_config must be a JSON object")
        backends = self.kv_connector_extra_config.get("backends", ["UCX"])
        if not isinstance(backends, list) or not backends or not all(isinstance(b, str) for b in backends):
            raise ValueError(f"kv_transfer_config: kv_connector_extra_config.backends must be a list of NIXL backend "
                             f"names, got {backends!r}")

    @classmethod
    def from_dict(cls, value: dict[str, Any] | None) -> "KVTransferConfig":
        return from_json_object(cls, value, "kv_transfer_config")

    @property
    def is_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    @property
    def backends(self) -> list[str]:
        return list(self.kv_connector_extra_config.get("backends", ["UCX"]))


def side_channel() -> tuple[str, int]:
    """(host, port) of this engine's side channel, from vLLM's environment variables."""
    return (os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost"),
            int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", DEFAULT_SIDE_CHANNEL_PORT)))


def abort_timeout_s() -> float:
    """How long a prefill server keeps blocks no decode server has pulled (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)."""
    return float(os.environ.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", DEFAULT_ABORT_TIMEOUT_S))
