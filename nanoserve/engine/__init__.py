"""The engine core, on rank 0: requests in, one `step()` at a time, outputs out.

    llm_engine       LLMEngine: the step loop (the plain, synchronous step)
    overlap          the overlapped step (overlap and async scheduling): the host works while the device runs
    launched_step    a step on its way: what was queued on the device, what came back
    builder          the executor and the limits an engine is built with
    scheduler        who runs this step and how many tokens
    block_manager    the KV block pool and the prefix cache
    encoder_cache    the books of the runner's encoder cache: the vision model's budget per step, what it holds
    sampler          logits -> tokens and logprobs, on the device
    stop_checker     EOS, stop ids, length limits, stop strings
    output_processor logprob lists and RequestOutputs
    detokenizer      incremental text
    sequence         one sequence's state; outputs: what the caller gets back; tokenizer: loading, chat templates

The front ends that drive it are in nanoserve/entrypoints/; the model runs behind an executor (nanoserve/executor/,
distributed/) on the per-rank side (nanoserve/runner/).
"""
