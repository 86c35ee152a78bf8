"""A schedule -> the StepInput the executor runs (nanoserve/step.py): each scheduled sequence's new tokens, lengths
and block table as plain lists, how to sample it, what it verifies, and which logits rows the step needs.

The rows the runner computes the LM head on, in order: one per sequence that samples a token; the prompt positions
of the sequences that asked for prompt logprobs; the k + 1 positions of each sequence that verifies k drafts
(ModelInput.prompt_rows holds the last two groups). With async scheduling a decode's newest token may still be on
the device: its input position gets a placeholder and is listed in StepInput.fed, and the runner copies the token
in there. Images and videos: the items the step encodes, the encoder-cache keys the runner drops first, and for
each input position that is a placeholder, which feature row replaces its embedding (`placements`).
"""

from __future__ import annotations

from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.step import FeaturePlacement, ModelInput, MultiModalFeature, PromptLogprobRows, StepInput, StepSeq


def build_step_input(sched: SchedulerOutput, vocab_size: int, finished: list[int]) -> StepInput:
    """The StepInput of `sched`; `finished`: the seq_ids that ended since the last step."""
    ids: list[int] = []
    verify_rows: list[int] = []
    step = StepInput(ModelInput(ids, [], [], [], [], encoder_frees=sched.encoder_frees,
                                encoder_inputs=sched.encoder_inputs), [], finished=finished)
    prompt_token_rows: list[int] = []
    for row, s in enumerate(sched.scheduled):
        seq, start = s.seq, s.seq.num_computed_tokens
        end, prompt_len = start + s.num_new_tokens, seq.num_prompt_tokens
        if seq.needs_prompt_logprobs:
            # position p's logits score prompt token p + 1; skip the ones already had (a recompute)
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None]  # nothing predicts the first token
            first, last = max(start, len(seq.prompt_logprobs) - 1), min(end, prompt_len - 1)
            if last > first:
                prompt_token_rows.extend(range(len(ids) + first - start, len(ids) + last - start))
                num = seq.params.prompt_logprobs
                step.prompt_logprobs.append(PromptLogprobRows(seq.seq_id, first + 1, last - first,
                                                              vocab_size if num == -1 else num,
                                                              seq.params.prompt_logprobs_temperature))
                step.prompt_targets.extend(seq.prompt_token_ids[first + 1: last + 1])
        for key, feature in s.features:
            step.model.placements += placements(key, feature, start, end - s.num_draft, len(ids))
        # slice the prompt or the outputs directly: seq.token_ids copies the whole sequence (128k tokens at W4)
        known = min(end - s.num_draft, seq.num_known_tokens)
        if start >= prompt_len:
            ids.extend(seq.output_token_ids[start - prompt_len: known - prompt_len])
        elif known <= prompt_len:
            ids.extend(seq.prompt_token_ids[start:known])
        else:
            ids.extend(seq.token_ids[start:known])
        for _ in range(max(start, known), end - s.num_draft):  # pending tokens: filled in on the device
            if not s.on_device:  # (else the whole query comes from the device)
                step.fed.append((len(ids), seq.seq_id))
            ids.append(0)
        if s.num_draft:  # speculative decoding: every position's logits, after the prompt rows
            verify_rows.extend(range(len(ids) - 1, len(ids) + s.num_draft))
            ids.extend(s.draft)
        step.model.query_lens.append(s.num_new_tokens)
        # (a query on the device may start up to k positions later: the longest context it can reach)
        step.model.seq_lens.append(end + (s.num_draft if s.on_device else 0))
        step.model.block_tables.append(list(seq.block_table))
        if s.samples and not s.num_draft:
            step.model.sample_rows.append(row)
        step.seqs.append(StepSeq(seq.seq_id, seq.index, seq.params, seq.prompt_token_ids, seq.output_token_ids,
                                 seq.num_output_tokens, start, s.num_new_tokens, s.samples, s.draft, s.max_drafts,
                                 s.on_device))
    step.model.prompt_rows = prompt_token_rows + verify_rows
    return step


def placements(key: str, feature: MultiModalFeature, start: int, end: int, index: int) -> list[FeaturePlacement]:
    """Where an item's features go in a step that computes prompt positions [start, end) of its sequence, whose
    first input is input `index` of the step: one placement per placeholder run (or part of one) in that range."""
    out = []
    row = 0
    for run_start, length in feature.runs:
        lo, hi = max(run_start, start), min(run_start + length, end)
        if lo < hi:
            out.append(FeaturePlacement(key, row + lo - run_start, index + lo - start, hi - lo))
        row += length
    return out
