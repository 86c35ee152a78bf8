"""When a sequence stops: EOS, a stop token id, the end of its structured-output format, a length limit, or a stop
string in its text.

The checks run in two places, because of overlap scheduling (see llm_engine.py):

    check_token(seq)   right after a token is appended (what the next schedule depends on): EOS, a stop token id,
                       a finished format, max_tokens or max_model_len. A token that ends the sequence has its text
                       done here too.
    check_text(seq)    when the newest token's text is added: a stop string it completed (seq.text is cut there).

Both follow vLLM: `min_tokens` holds back every stop but the length limits; the text of the EOS or stop token that
ended generation is left out unless `include_stop_str_in_output`; a stop string completed by the last token
allowed wins over the length limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.engine.detokenizer import detokenize_step, flush
from nanoserve.engine.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class Stop:
    """Why a sequence ends: the finish reason, and the stop token id or stop string (vLLM's stop_reason)."""

    reason: FinishReason
    stop_reason: int | str | None = None


def find_stop_string(text: str, delta_len: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that the last `delta_len` characters completed: (start index, the string)."""
    best = None
    for stop in stops:
        start = max(0, len(text) - delta_len - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


class StopChecker:
    """Decides when sequences stop; the engine does the finishing (freeing blocks, counting)."""

    def __init__(self, tokenizer, eos_token_id: int | None, max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len

    def check_token(self, seq: Sequence) -> Stop | None:
        """seq's newest token was just appended: does EOS, a stop id or a length limit end seq?"""
        token = seq.output_token_ids[-1]
        p = seq.params
        allowed_to_stop = len(seq.output_token_ids) >= p.min_tokens
        if allowed_to_stop and token == self.eos_token_id and not p.ignore_eos:
            stop = Stop(FinishReason.STOP)
        elif allowed_to_stop and token in p.stop_token_ids:
            stop = Stop(FinishReason.STOP, token)
        elif seq.grammar is not None and seq.grammar.is_terminated:
            # the format ended (its grammar accepted EOS), e.g. under ignore_eos: no further token is allowed
            stop = Stop(FinishReason.STOP)
        else:
            if not seq.reached_length_limit(self.max_model_len, count_pending=False):
                return None
            # the last token allowed: a stop string it completes takes precedence over the length limit; else the
            # text its tokens held back (a character they left unfinished) ends it
            stop = self.check_text(seq)
            if stop is None:
                flush(self.tokenizer, seq)
            return stop or Stop(FinishReason.LENGTH)
        # as in vLLM, the text of the token that stopped generation (EOS, a stop id) is left out of the output
        # unless include_stop_str_in_output; the token itself stays in token_ids
        if p.include_stop_str_in_output:
            detokenize_step(self.tokenizer, seq)
        return stop

    def check_text(self, seq: Sequence) -> Stop | None:
        """Detokenise seq's newest token; a stop string it completed ends seq (seq.text is cut there)."""
        p = seq.params
        delta = detokenize_step(self.tokenizer, seq)
        if not (p.stop_list and delta and len(seq.output_token_ids) >= p.min_tokens):
            return None
        hit = find_stop_string(seq.text, len(delta), p.stop_list)
        if hit is None:
            return None
        idx, stop = hit
        seq.text = seq.text[: idx + len(stop)] if p.include_stop_str_in_output else seq.text[:idx]
        return Stop(FinishReason.STOP, stop)
