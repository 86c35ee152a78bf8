"""Tensor parallelism.

    parallel_state   this rank's place in the group, and the collectives the sharded layers call
    worker           what every rank runs: join the process groups, build its shard, follow rank 0's commands
    executor         MultiprocExecutor, rank 0's side: spawns the workers, broadcasts each step, watches them
    launch           ranks started by torchrun (several hosts) instead of spawned
"""
