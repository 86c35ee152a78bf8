"""The engine: request state, paged KV blocks, the scheduler, the model runner, sampling, and the offline and
async front ends."""
