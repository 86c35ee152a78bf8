"""Tensor parallelism.

    worker           what every rank runs: join the process groups, build its shard, follow rank 0's commands
    commands         the typed commands rank 0 sends every rank (Configure, InitCache, Step, Stop)
    executor         MultiprocExecutor, rank 0's side: spawns the workers, broadcasts each step
    watchdog         WorkerWatchdog: notices a dead or hung worker and fails the engine with a clear error, never a hang
    launch           ranks started by torchrun (several hosts) instead of spawned
"""
