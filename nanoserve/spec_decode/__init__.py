"""Speculative decoding, whole: what proposes draft tokens, and the rule that accepts them. The runner calls it on
rank 0 after each forward; the engine sees only draft token ids (a sequence's next drafts come with its tokens in
the StepOutput, and the scheduler schedules them after its newest token).

    config.py       SpeculativeConfig: vLLM's `speculative_config` (method, num_speculative_tokens, ...), checked
    proposer.py     after a step: which sequences draft, how many (`room`), and their drafts
    ngram.py        NgramProposer: prompt lookup - the last n tokens matched earlier in the context
    mtp.py          M3's own MTP module, a draft model that reads the target's final hidden states
    eagle3.py       an EAGLE-3 draft model, reading the residual stream of three target layers
    drafter.py      DraftRunner: a draft model on this rank - its K/V pool, its passes, their CUDA graphs
    draft_input.py  DraftInput: what the proposer asks a draft model for, as plain lists
    draft_chain.py  DraftChain: the next drafts made on the device right after a greedy verify graph
    verify.py       a verify step's logits -> the accepted drafts + 1 token (greedy on the host, or rejection)
    rejection.py    the acceptance rule: greedy = longest matching prefix; sampling = rejection sampling that
                    keeps the target model's distribution exactly

docs/speculative_decoding.md describes the whole path.
"""
