"""Turn each sequence's next-token logits into a token, on the device, for a whole batch at once.

Order of operations (as vLLM's sampler): a structured-output request's grammar bitmask comes first, setting the tokens
its format forbids to -inf (its rows only; the engine fills the mask, runner/grammar_mask.py applies it), so
everything after - the logprobs included - sees the masked logits. Then the logprobs of the raw logits are taken
(logprobs_mode "raw_logprobs", the default); then each processing step, one method each, batched over the rows that
use it: allowed_token_ids (everything else masked), bad_words, min_tokens suppression of EOS and stop ids, logit_bias,
repetition / presence / frequency penalties; then temperature, top-k, top-p, min-p and a draw. Greedy rows
(temperature 0) take the argmax of the processed logits. With logprobs_mode "processed_logprobs" the logprobs are
taken from the logits the draw used instead (after every step above, temperature and filters included). A request with
a seed draws from its own generator, so its tokens do not depend on what else is in the batch; other requests share
the engine's.

Two halves (for the engine's overlap_scheduling): `sample` queues all of this on the device and returns tensors -
nothing in it waits for the device (no `.item()`, `.tolist()` or synchronous host-to-device copy), so on a GPU it
returns while the step's forward is still running; `to_host` then waits and copies the result to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.config import LOGPROBS_MODES
from nanoserve.runner.grammar_mask import MaskUploader
from nanoserve.step import GrammarMask, StepSeq

MASK64 = 2**64 - 1


def generator_seed(seed: int, index: int) -> int:
    """The generator seed of completion `index` of a request seeded with `seed` (any int64). n > 1 completions
    must differ yet be reproducible, so the index is added; the sum goes through splitmix64's finaliser because
    torch's CPU generator keeps only the low 32 bits of its seed, and seeds that differ only in their high bits
    (-1 and 2**63 - 1) must still draw differently."""
    z = (seed + index + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


@dataclass
class DeviceSample:
    """One batch's draw, still on the device (see `Sampler.sample`)."""

    token_ids: torch.Tensor  # [S]
    num_logprobs: list[int | None]  # per row: how many top alternatives were asked for (None: no logprobs)
    chosen_logprob: torch.Tensor | None  # [S] raw logprob of the drawn token; None when no row asked
    top_logprobs: torch.Tensor | None  # [S, k] the k = max(num_logprobs) best raw logprobs and their ids
    top_ids: torch.Tensor | None
    host: tuple[torch.Tensor | None, ...] | None = None
    """On a GPU: pinned host copies of the four tensors above, queued right behind the draw (`start_host_copy`),
    and the event that marks them done. A plain `.tolist()` would copy on the stream's tail, after whatever was
    queued since - with async scheduling, the whole next step."""
    copied: torch.cuda.Event | None = None

    @classmethod
    def of_tokens(cls, token_ids: torch.Tensor) -> "DeviceSample":
        """Token ids only, no logprobs (flattened), their host copy queued now. The caller clones a static graph
        buffer first: the copy reads it later, on the stream."""
        return cls(token_ids.reshape(-1), [None] * token_ids.numel(), None, None, None).start_host_copy()

    def start_host_copy(self) -> "DeviceSample":
        """Queue the copies to pinned host memory now (CUDA/HIP; elsewhere the tensors are on the host already)."""
        if self.token_ids.device.type != "cuda":
            return self
        tensors = (self.token_ids, self.chosen_logprob, self.top_logprobs, self.top_ids)
        self.host = tuple(None if t is None else
                          torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in tensors)
        self.copied = torch.cuda.Event()
        self.copied.record()
        return self


@dataclass
class SampleResult:
    """One batch's draw on the host."""

    token_ids: list[int]
    chosen_logprob: list[float | None]
    num_logprobs: list[int | None]
    top_logprobs: list[list[float]] | None
    top_ids: list[list[int]] | None

    def logprobs(self, i: int) -> dict[int, float] | None:
        """Row i's logprobs as returned to the user: the chosen token first, then the top-N alternatives."""
        n = self.num_logprobs[i]
        if n is None:
            return None
        d = {self.token_ids[i]: self.chosen_logprob[i]}
        for j in range(n):
            d.setdefault(self.top_ids[i][j], self.top_logprobs[i][j])
        return d


def exponential_race(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of `probs` (or from a 1-D `probs`): torch.multinomial(probs, 1)'s own algorithm, argmax of
    p / q with q ~ Exp(1) - the same tokens from the same generator state - without the validity checks it runs on
    the host, which wait for the device."""
    q = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / q).argmax(dim=-1)


def plain_greedy(seq: StepSeq) -> bool:
    """Is this row's token simply the argmax of its raw logits? (temperature 0, no logprobs, and no processing
    step that changes a logit: allowed_token_ids, bad_words, min_tokens still pending, logit_bias, penalties.)"""
    p = seq.params
    return (p.greedy and p.logprobs is None and p.allowed_token_ids is None and not p.bad_words_token_ids
            and seq.num_output_tokens >= p.min_tokens and not p.logit_bias and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0)


class Sampler:
    def __init__(self, device: torch.device, seed: int, eos_token_id: int | None,
                 logprobs_mode: str = "raw_logprobs"):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.device = device
        self.eos_token_id = eos_token_id
        self.logprobs_mode = logprobs_mode
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.masks = MaskUploader(device)
        self._seq_generators: dict[int, torch.Generator] = {}

    def forget(self, seq_id: int) -> None:
        self._seq_generators.pop(seq_id, None)

    def _generator(self, seq: StepSeq) -> torch.Generator:
        g = self._seq_generators.get(seq.seq_id)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(generator_seed(seq.params.seed, seq.index))
            self._seq_generators[seq.seq_id] = g
        return g

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A small host list on the device without waiting for it: torch.tensor(..., device=cuda) copies
        synchronously, a copy from pinned memory is queued behind the work already on the stream."""
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=dtype)
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)

    def __call__(self, logits: torch.Tensor, seqs: list[StepSeq],
                 grammar: GrammarMask | None = None) -> SampleResult:
        """logits [S, V] (one row per sequence in `seqs`) -> one token per sequence, on the host."""
        return self.to_host(self.sample(logits, seqs, grammar))

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[StepSeq], grammar: GrammarMask | None = None,
               argmax: torch.Tensor | None = None) -> DeviceSample:
        """The device half: queue the draw and the logprobs. Reads `logits` only through work queued here, so a
        static CUDA-graph output may be overwritten by a later replay once this returns. `grammar`: the
        structured-output bitmask of this batch's constrained rows (None: no row is constrained). `argmax`: each
        row's argmax of `logits`, already on the device (a decode graph took it, switch captured_argmax); an
        unconstrained batch whose rows are all plain greedy then takes a copy of it and launches nothing else."""
        if argmax is not None and grammar is None and all(plain_greedy(s) for s in seqs):
            return DeviceSample.of_tokens(argmax.clone())
        logits = logits.to(torch.float32, copy=True)  # the steps edit it in place; the caller's stays intact
        logits = self._apply_grammar(logits, grammar)
        num_logprobs = [s.params.logprobs for s in seqs]
        wanted = any(n is not None for n in num_logprobs)
        raw = self.logprobs_mode.startswith("raw")
        source = self._logprob_values(logits) if wanted and raw else None
        logits = self._restrict_to_allowed(logits, seqs)
        logits = self._ban_bad_words(logits, seqs)
        logits = self._suppress_early_stop(logits, seqs)
        logits = self._apply_logit_bias(logits, seqs)
        logits = self._apply_penalties(logits, seqs)

        tokens = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        processed = logits
        if rows:
            idx = self._tensor(rows, torch.long)
            drawn, filtered = self._draw(logits[idx], [seqs[i] for i in rows])
            tokens[idx] = drawn
            if wanted and not raw:
                processed = logits.index_copy(0, idx, filtered)
        if wanted and not raw:
            source = self._logprob_values(processed)

        chosen = top_vals = top_ids = None
        if source is not None:
            chosen = source.gather(1, tokens[:, None])[:, 0]
            vocab = logits.shape[-1]
            k = min(max(vocab if n == -1 else (n or 0) for n in num_logprobs), vocab)
            if k:
                top_vals, top_ids = source.topk(k, dim=-1)
        num_logprobs = [logits.shape[-1] if n == -1 else n for n in num_logprobs]
        return DeviceSample(tokens, num_logprobs, chosen, top_vals, top_ids).start_host_copy()

    def _logprob_values(self, logits: torch.Tensor) -> torch.Tensor:
        """What logprobs report, by logprobs_mode: log-softmax of `logits`, or the logits themselves."""
        return logits.clone() if self.logprobs_mode.endswith("logits") else torch.log_softmax(logits, dim=-1)

    @staticmethod
    def to_host(sample: DeviceSample) -> SampleResult:
        """The host half: wait for the draw (its own copies only, on a GPU) and read it on the host."""
        if sample.copied is not None:
            sample.copied.synchronize()
            token_ids, chosen_logprob, top_logprobs, top_ids = sample.host
        else:
            token_ids, chosen_logprob, top_logprobs, top_ids = (sample.token_ids, sample.chosen_logprob,
                                                                 sample.top_logprobs, sample.top_ids)
        tokens = token_ids.tolist()
        picked = chosen_logprob.tolist() if chosen_logprob is not None else [None] * len(tokens)
        chosen = [c if n is not None else None for c, n in zip(picked, sample.num_logprobs)]
        top_vals = top_logprobs.tolist() if top_logprobs is not None else None
        top_ids = top_ids.tolist() if top_ids is not None else None
        return SampleResult(tokens, chosen, sample.num_logprobs, top_vals, top_ids)

    # -- logit processing (each step touches only the rows whose request uses it) ---------------------------
    def _apply_grammar(self, logits: torch.Tensor, grammar: GrammarMask | None) -> torch.Tensor:
        """Structured outputs: the tokens a constrained row's grammar forbids get -inf (other rows untouched)."""
        return self.masks.apply(logits, grammar)

    def _restrict_to_allowed(self, logits: torch.Tensor, seqs: list[StepSeq]) -> torch.Tensor:
        """allowed_token_ids: every other token of the row is masked out."""
        vocab = logits.shape[-1]
        rows, ids = [], []
        for i, s in enumerate(seqs):
            if s.params.allowed_token_ids is not None:
                allowed = [t for t in s.params.allowed_token_ids if t < vocab]
                rows.extend([i] * len(allowed))
                ids.extend(allowed)
        if not rows:
            return logits
        r, t = self._tensor(rows, torch.long), self._tensor(ids, torch.long)
        keep = torch.zeros_like(logits, dtype=torch.bool).index_put_((r, t), torch.ones_like(r, dtype=torch.bool))
        restricted = torch.zeros(len(seqs), dtype=torch.bool, device=logits.device).index_fill_(0, r, True)
        return logits.masked_fill(restricted[:, None] & ~keep, float("-inf"))

    def _ban_bad_words(self, logits: torch.Tensor, seqs: list[StepSeq]) -> torch.Tensor:
        """bad_words: a word's last token is banned where the output already ends with the tokens before it (a
        one-token word is always banned)."""
        rows, ids = [], []
        for i, s in enumerate(seqs):
            out = s.output_token_ids
            for word in s.params.bad_words_token_ids:
                prefix = word[:-1]
                if len(out) >= len(prefix) and out[len(out) - len(prefix):] == prefix and word[-1] < logits.shape[-1]:
                    rows.append(i)
                    ids.append(word[-1])
        return self._fill(logits, rows, ids, float("-inf"))

    def _apply_logit_bias(self, logits: torch.Tensor, seqs: list[StepSeq]) -> torch.Tensor:
        """logit_bias: the request's value added to each named token's logit."""
        rows, ids, values = [], [], []
        for i, s in enumerate(seqs):
            for t, v in (s.params.logit_bias or {}).items():
                if t < logits.shape[-1]:
                    rows.append(i)
                    ids.append(t)
                    values.append(float(v))
        if rows:
            logits.index_put_((self._tensor(rows, torch.long), self._tensor(ids, torch.long)),
                              self._tensor(values, torch.float32), accumulate=True)
        return logits

    def _fill(self, logits: torch.Tensor, rows: list[int], ids: list[int], value: float) -> torch.Tensor:
        """Set logits[rows[j], ids[j]] = value for every j, in one indexed write."""
        if rows:
            r = self._tensor(rows, torch.long)
            logits.index_put_((r, self._tensor(ids, torch.long)),
                              torch.full((), value, dtype=logits.dtype, device=logits.device))
        return logits

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[StepSeq]) -> torch.Tensor:
        rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0
                or s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0]
        if not rows:
            return logits
        vocab = logits.shape[-1]
        for i in rows:
            p = seqs[i].params
            # ids filtered on the host and counted with index_add_: a boolean mask or bincount waits for the device
            out_ids = [t for t in seqs[i].output_token_ids if t < vocab]
            counts = torch.zeros(vocab, device=logits.device).index_add_(
                0, self._tensor(out_ids, torch.long), torch.ones(len(out_ids), device=logits.device))
            if p.repetition_penalty != 1.0:
                # HF/vLLM semantics: prompt and output tokens; divide positive logits, multiply negative ones
                all_ids = self._tensor([t for t in seqs[i].token_ids if t < vocab], torch.long)
                seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device).index_fill_(0, all_ids, True)
                row = logits[i]
                logits[i] = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty,
                                                          row * p.repetition_penalty), row)
            # OpenAI semantics: output tokens only
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return logits

    def _suppress_early_stop(self, logits: torch.Tensor, seqs: list[StepSeq]) -> torch.Tensor:
        """min_tokens: EOS (unless ignored) and the stop token ids are masked until that many tokens exist."""
        rows, ids = [], []
        for i, s in enumerate(seqs):
            if s.num_output_tokens < s.params.min_tokens:  # pending tokens count: they precede this one
                stop_ids = list(s.params.stop_token_ids or [])
                if self.eos_token_id is not None and not s.params.ignore_eos:
                    stop_ids.append(self.eos_token_id)
                stop_ids = [t for t in stop_ids if t < logits.shape[-1]]
                rows.extend([i] * len(stop_ids))
                ids.extend(stop_ids)
        return self._fill(logits, rows, ids, float("-inf"))

    def _draw(self, logits: torch.Tensor, seqs: list[StepSeq]) -> tuple[torch.Tensor, torch.Tensor]:
        """Temperature, top-k, top-p, min-p, then one draw per row (all rows here have temperature > 0).
        Returns the tokens and the logits they were drawn from (filtered-out tokens at -inf)."""
        logits = self._filter(logits, seqs)
        probs = torch.softmax(logits, dim=-1)
        out = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        seeded = [i for i, s in enumerate(seqs) if s.params.seed is not None]
        for i in seeded:
            out[i] = exponential_race(probs[i], self._generator(seqs[i]))
        if len(seeded) < len(seqs):
            rest = [i for i in range(len(seqs)) if seqs[i].params.seed is None]
            idx = self._tensor(rest, torch.long)
            out[idx] = exponential_race(probs[idx], self.generator)
        return out, logits

    def _filter(self, logits: torch.Tensor, seqs: list[StepSeq]) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p (all rows here have temperature > 0): the logits a draw samples
        from, filtered-out tokens at -inf."""
        temps = self._tensor([s.params.temperature for s in seqs], torch.float32)
        logits = logits / temps[:, None]
        top_k = self._tensor([s.params.top_k for s in seqs], torch.long)
        top_p = self._tensor([s.params.top_p for s in seqs], torch.float32)
        min_p = self._tensor([s.params.min_p for s in seqs], torch.float32)
        if any(s.params.top_k > 0 or s.params.top_p < 1 or s.params.min_p > 0 for s in seqs):
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
        return logits

    # -- speculative decoding (spec_decode/verify.py) -------------------------------------------------------
    @torch.inference_mode()
    def target_distributions(self, logits: torch.Tensor, seqs: list[StepSeq], grammar: GrammarMask | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """For the rows of a verify step (row i scores a position of seqs[i]; a sequence repeats for each of its
        positions): the distribution the draw would sample each row's token from - the structured-output mask of
        each constrained row at its position (`grammar`), allowed_token_ids and logit_bias applied, then
        temperature, top-k, top-p, min-p, softmax; a greedy row's is one-hot at its argmax - and the values its
        logprobs report (per logprobs_mode; None when no row asks). No other processing step reads the
        sequences' own output (spec_decode/verify.py `speculable`)."""
        logits = self._apply_grammar(logits.to(torch.float32, copy=True), grammar)
        wanted = any(s.params.logprobs is not None for s in seqs)
        raw = self.logprobs_mode.startswith("raw")
        source = self._logprob_values(logits) if wanted and raw else None
        logits = self._restrict_to_allowed(logits, seqs)
        logits = self._apply_logit_bias(logits, seqs)
        probs = torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if rows:
            idx = self._tensor(rows, torch.long)
            filtered = self._filter(logits[idx], [seqs[i] for i in rows])
            probs[idx] = torch.softmax(filtered, dim=-1)
            if wanted and not raw:
                logits = logits.index_copy(0, idx, filtered)
        if wanted and not raw:
            source = self._logprob_values(logits)
        return probs, source

    def generator_for(self, seq: StepSeq) -> torch.Generator:
        """The generator seq's random draws come from: its own when the request has a seed, else the engine's."""
        return self._generator(seq) if seq.params.seed is not None else self.generator
