"""An offline generation under torchrun, for tests/engine/test_tensor_parallel.py:

    python -m torch.distributed.run --nproc-per-node 2 tests/helpers/tp_torchrun_generate.py REQUEST.json OUT.json

Every rank runs this same script, as on a multi-host launch. `LLM(...)` sees WORLD_SIZE > 1: on rank 0 it joins
through env:// and runs the engine; on rank 1 it becomes a worker and exits when rank 0 shuts down, so only rank 0
gets past the constructor and writes OUT.json (the greedy token ids of every prompt).
REQUEST.json: {"model", "prompts": [[ids], ...], "max_tokens", "engine_args": {...}, "switches_off": [...]}.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    request_path, out_path = sys.argv[1], sys.argv[2]
    with open(request_path) as f:
        req = json.load(f)
    from nanoserve import LLM, Optimizations, SamplingParams

    opts = Optimizations().replace(**{name: False for name in req["switches_off"]})
    llm = LLM(req["model"], tensor_parallel_size=int(os.environ["WORLD_SIZE"]), optimizations=opts,
              **req["engine_args"])
    executor = llm.engine.executor
    assert os.environ["RANK"] == "0", "only rank 0 returns from LLM(...)"
    assert not executor.workers, "under torchrun rank 0 spawns no workers"
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], params, use_tqdm=False)
    with open(out_path, "w") as f:
        json.dump([o.outputs[0].token_ids for o in outs], f)
    # No shutdown call: like a plain offline script, rely on the executor's exit hook to stop rank 1.


if __name__ == "__main__":
    main()
