"""Tensor parallelism: the process group every sharded layer talks through (parallel_state) and the worker
processes that run one shard each (workers)."""
