"""Where the model runs, as the engine sees it.

    base.py    Executor: the interface the engine calls
    local.py   LocalExecutor: one device, the runner in this process

The tensor-parallel executor (MultiprocExecutor, distributed/executor.py) implements the same interface;
`engine/builder.py` picks one of the two for a config.
"""
