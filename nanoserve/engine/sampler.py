"""Turn each sequence's next-token logits into a token, on the device, for a whole batch at once.

Order of operations (as vLLM): log-probabilities are taken from the raw logits; then repetition / presence /
frequency penalties, min_tokens suppression of EOS and stop ids, temperature, top-k, top-p, min-p, and a draw.
Greedy rows (temperature 0) take the argmax of the penalised logits. A request with a seed draws from its own
generator, so its tokens do not depend on what else is in the batch; other requests share the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.engine.sequence import Sequence


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # chosen token first, then the top-N alternatives
    chosen_logprob: list[float | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int, eos_token_id: int | None):
        self.device = device
        self.eos_token_id = eos_token_id
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._seq_generators: dict[int, torch.Generator] = {}

    def forget(self, seq_id: int) -> None:
        self._seq_generators.pop(seq_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator:
        g = self._seq_generators.get(seq.seq_id)
        if g is None:
            # n > 1 completions of a seeded request must differ, yet be reproducible: offset by the index
            g = torch.Generator(device=self.device).manual_seed((seq.params.seed + seq.index) % (2**63))
            self._seq_generators[seq.seq_id] = g
        return g

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits [S, V] (fp32, one row per sequence in `seqs`) -> one token per sequence."""
        logits = logits.to(torch.float32, copy=True)  # penalties edit it in place; the caller's stays intact
        num_logprobs = [s.params.logprobs for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in num_logprobs) else None
        logits = self._apply_penalties(logits, seqs)
        logits = self._suppress_early_stop(logits, seqs)

        tokens = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            tokens[idx] = self._draw(logits[idx], [seqs[i] for i in rows])

        token_list = tokens.tolist()
        lp_out: list[dict[int, float] | None] = [None] * len(seqs)
        chosen: list[float | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            k = max(n or 0 for n in num_logprobs)
            top_vals, top_ids = raw_logprobs.topk(k, dim=-1) if k else (None, None)
            picked = raw_logprobs.gather(1, tokens[:, None])[:, 0].tolist()
            top_vals = top_vals.tolist() if k else None
            top_ids = top_ids.tolist() if k else None
            for i, n in enumerate(num_logprobs):
                if n is None:
                    continue
                d = {token_list[i]: picked[i]}
                for j in range(n):
                    d.setdefault(top_ids[i][j], top_vals[i][j])
                lp_out[i] = d
                chosen[i] = picked[i]
        return SampleResult(token_list, lp_out, chosen)

    # -- logit processing ---------------------------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0
                or s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0]
        if not rows:
            return logits
        vocab = logits.shape[-1]
        for i in rows:
            p = seqs[i].params
            out_ids = torch.tensor(seqs[i].output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out_ids[out_ids < vocab], minlength=vocab).float()
            if p.repetition_penalty != 1.0:
                # HF/vLLM semantics: prompt and output tokens; divide positive logits, multiply negative ones
                seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
                all_ids = torch.tensor(seqs[i].token_ids, dtype=torch.long, device=logits.device)
                seen[all_ids[all_ids < vocab]] = True
                row = logits[i]
                logits[i] = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty,
                                                          row * p.repetition_penalty), row)
            # OpenAI semantics: output tokens only
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return logits

    def _suppress_early_stop(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        for i, s in enumerate(seqs):
            if len(s.output_token_ids) < s.params.min_tokens:
                stop_ids = list(s.params.stop_token_ids or [])
                if self.eos_token_id is not None and not s.params.ignore_eos:
                    stop_ids.append(self.eos_token_id)
                stop_ids = [t for t in stop_ids if t < logits.shape[-1]]
                if stop_ids:
                    logits[i, stop_ids] = float("-inf")
        return logits

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one draw per row (all rows here have temperature > 0)."""
        temps = torch.tensor([s.params.temperature for s in seqs], device=logits.device)
        logits = logits / temps[:, None]
        top_k = torch.tensor([s.params.top_k for s in seqs], device=logits.device)
        top_p = torch.tensor([s.params.top_p for s in seqs], device=logits.device)
        min_p = torch.tensor([s.params.min_p for s in seqs], device=logits.device)
        if bool((top_k > 0).any() | (top_p < 1).any() | (min_p > 0).any()):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            vocab = logits.shape[-1]
            ranks = torch.arange(vocab, device=logits.device)[None, :]
            drop = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
            probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
            # top-p: drop a token if the mass strictly before it already reaches top_p (the first always stays);
            # rows with top_p = 1 skip it, since a rounded cumsum can reach 1.0 before the tail
            drop |= (top_p[:, None] < 1) & ((probs.cumsum(-1) - probs) >= top_p[:, None])
            drop |= probs < min_p[:, None] * probs[:, :1]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        probs = torch.softmax(logits, dim=-1)
        out = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        seeded = [i for i, s in enumerate(seqs) if s.params.seed is not None]
        for i in seeded:
            out[i] = torch.multinomial(probs[i], 1, generator=self._generator(seqs[i]))[0]
        if len(seeded) < len(seqs):
            rest = [i for i in range(len(seqs)) if seqs[i].params.seed is None]
            idx = torch.tensor(rest, device=logits.device)
            out[idx] = torch.multinomial(probs[idx], 1, generator=self.generator)[:, 0]
        return out
