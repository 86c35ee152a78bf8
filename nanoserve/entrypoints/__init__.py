"""The front ends: the ways into the engine core (LLMEngine, engine/llm_engine.py).

    llm            LLM: the offline API (`generate`, `chat`), driving the engine's step loop to completion
    async_engine   AsyncLLMEngine: the asyncio bridge the HTTP server (nanoserve/server) builds on

Both only call the engine's public methods (add_request, abort_request, step); neither knows how a step runs.
"""
