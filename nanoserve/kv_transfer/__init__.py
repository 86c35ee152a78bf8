"""Prefill/decode disaggregation outside the engine core: the configuration, the request-level protocol and the
block transfer.

    config      `--kv-transfer-config` in vLLM's shape (kv_connector, kv_role, engine_id, kv_connector_extra_config)
    params      the request-level `kv_transfer_params` protocol of vLLM's NixlConnector: what the router sends the
                prefill server, what the prefill answer carries, what the decode server receives
    transfer    KV blocks moved between two engines' pools by NIXL (TCP on a CPU machine, RDMA / NVLink on GPUs):
                a source registers its pools and serves their layout on a side channel, a destination pulls given
                block ids into its own blocks and notifies the source, which frees them (or a timeout does)

The engine drives them from engine/kv_connector.py (a prefill keeps its blocks until pulled, a decode waits for its
KV; docs/scale_out.md); the executor builds the agent over the runner's pools. This package sits beside the
runner: it knows tensors and block ids, nothing of scheduling.
"""
