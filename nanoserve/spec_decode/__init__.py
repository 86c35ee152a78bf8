"""Speculative decoding: what proposes draft tokens, and the rule that accepts them.

    config.py      SpeculativeConfig: vLLM's `speculative_config` (method, num_speculative_tokens, ...), checked
    ngram.py       NgramProposer: prompt lookup - the last n tokens matched earlier in the context
    draft_input.py DraftInput: what the engine asks a draft model (runner/drafter.py: MTP, EAGLE-3) for
    rejection.py   the acceptance rule: greedy = longest matching prefix; sampling = rejection sampling that
                   keeps the target model's distribution exactly

The engine (engine/speculative.py, engine/llm_engine.py) drafts, schedules the k + 1 verified positions as one
step and applies the rule; docs/speculative_decoding.md describes the whole path.
"""
