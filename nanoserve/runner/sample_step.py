"""The second half of a step on rank 0: the forward's logits -> the tokens each sequence gets.

    StepSampler.sample(logits, step, masks)   queue on the device, without waiting: each sampling row's draw
                                              (runner/sampler.py), the prompt logprobs (runner/prompt_logprobs.py),
                                              the verification of drafts (spec_decode/verify.py) and, after a
                                              greedy verify graph, the draft chain (spec_decode/draft_chain.py)
    PendingStep.result()                      wait for them; the StepOutput (tokens, logprobs, prompt logprobs and
                                              the next step's drafts: spec_decode/proposer.py)

The logits rows come in the order runner and engine agree on (nanoserve/step.py): one per sampling sequence, the
prompt-logprob rows, then the k + 1 rows of each verifying sequence. Async scheduling reads one more thing from
here: the tokens of the last step, still on the device, that the next step's inputs take (`feed`).
"""

from __future__ import annotations

from typing import Callable

import torch

from nanoserve.batch import TokenFeed
from nanoserve.config import EngineConfig
from nanoserve.runner import prompt_logprobs as prompt_lp
from nanoserve.runner.multimodal import EncoderTiming
from nanoserve.runner.sampler import DeviceSample, Sampler, plain_greedy
from nanoserve.spec_decode import verify as spec_verify
from nanoserve.spec_decode.proposer import Proposer
from nanoserve.step import GrammarMasks, SeqTokens, StepInput, StepOutput

DraftChainFn = Callable[[], "torch.Tensor | None"]


class PendingStep:
    """A step whose tokens are queued on the device: `result()` waits for them and returns the StepOutput."""

    def __init__(self, step: StepInput, sample: DeviceSample | None,
                 prompt: prompt_lp.DevicePromptLogprobs | None, verify: spec_verify.DeviceVerify | None,
                 chain: DeviceSample | None, proposer: Proposer | None):
        self.step, self.sample, self.prompt, self.verify, self.chain = step, sample, prompt, verify, chain
        self.proposer = proposer
        self.chained: frozenset[int] = frozenset(s.seq_id for s in verify.seqs) if chain is not None else \
            frozenset()
        """The sequences whose next query - bonus token and drafts - the draft chain left on the device: a next
        step may take them there before this one's tokens arrive (async scheduling, switch spec_async)."""
        self.encoder: EncoderTiming | None = None
        """The step's encoding of images and videos, if it had any (the runner sets it): its time is reported."""

    def result(self) -> StepOutput:
        out = StepOutput()
        if self.encoder is not None:
            out.encoder_seconds = self.encoder.seconds()
        if self.prompt is not None:
            out.prompt_logprobs = prompt_lp.to_host(self.prompt)
        emitted: dict[int, list[int]] = {}
        logprobs: dict[int, list[dict[int, float]]] = {}
        if self.sample is not None:
            result = Sampler.to_host(self.sample)
            for i, s in enumerate(self.step.sampled):
                emitted[s.seq_id] = [result.token_ids[i]]
                if s.params.logprobs is not None:
                    logprobs[s.seq_id] = [result.logprobs(i)]
        premade: dict[int, list[int]] = {}
        accepted: dict[int, list[int]] = {}
        if self.verify is not None:
            tokens, per_step, result = spec_verify.to_host(self.verify)
            width = self.verify.width
            for r, s in enumerate(self.verify.seqs):
                emitted[s.seq_id] = tokens[r]
                if per_step is not None:
                    accepted[s.seq_id] = per_step[r]
                if s.params.logprobs is not None:
                    logprobs[s.seq_id] = [result.logprobs(r * width + j) for j in range(len(tokens[r]))]
            if self.chain is not None:  # the drafts the chain made on the device: row r * k + j
                chained = Sampler.to_host(self.chain).token_ids
                k = len(chained) // len(self.verify.seqs)
                premade = {s.seq_id: chained[r * k: (r + 1) * k] for r, s in enumerate(self.verify.seqs)}
        out.seqs = [SeqTokens(s.seq_id, emitted[s.seq_id], logprobs.get(s.seq_id), accepted.get(s.seq_id))
                    for s in self.step.seqs if s.seq_id in emitted]
        if self.proposer is not None and self.step.propose:
            out.drafts = self.proposer.propose(self.step, emitted, premade)
        return out


class StepSampler:
    """Rank 0's sampling, prompt logprobs and speculative decoding, and the last step's tokens for the next one."""

    def __init__(self, config: EngineConfig, device: torch.device, eos_token_id: int | None,
                 proposer: Proposer | None = None):
        opts = config.optimizations
        self.sampler = Sampler(device, config.seed, eos_token_id, config.logprobs_mode)
        self.as_logits = config.logprobs_mode.endswith("logits")
        self.proposer = proposer
        self.opts = opts
        self.last: DeviceSample | None = None  # the last step's draw, for async scheduling's token feed
        self.last_rows: dict[int, int] = {}  # seq_id -> its row in `last`
        self.chained_rows: dict[int, int] = {}  # seq_id -> its row in the last draft chain's outputs

    def feed(self, step: StepInput) -> TokenFeed | None:
        """The TokenFeed of `step`'s input positions whose token is the last step's draw (async scheduling)."""
        if not step.fed:
            return None
        if self.last is None:
            raise RuntimeError("a scheduled token is still on the device, but no step in flight sampled it")
        return TokenFeed([dst for dst, _ in step.fed], [self.last_rows[sid] for _, sid in step.fed],
                         self.last.token_ids)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, step: StepInput, masks: GrammarMasks, argmax: torch.Tensor | None,
               draft_chain: DraftChainFn, fed_ids: torch.Tensor | None = None) -> PendingStep:
        """Queue the step's tokens (see the module docstring). `argmax`: a decode graph's argmax of every row
        (switch captured_argmax); `draft_chain`: the runner's chain after a verify graph; `fed_ids`: the queries
        a verify step took on the device (the host has placeholders). Reads `logits` and `fed_ids` only through
        work queued here: with CUDA graphs they are static buffers that the next replay overwrites."""
        for seq_id in step.finished:
            self.sampler.forget(seq_id)
        sampled, verifying = step.sampled, step.verifying
        num_sampled, num_prompt = len(sampled), len(step.prompt_targets)
        sample = self.sampler.sample(logits[:num_sampled], sampled, masks.sampled, argmax) if sampled else None
        prompt = None
        if step.prompt_logprobs:  # the prompt positions' logits follow the sample rows'
            prompt = prompt_lp.compute(logits[num_sampled: num_sampled + num_prompt], step.prompt_logprobs,
                                       step.prompt_targets, as_logits=self.as_logits)
        verify = chain = None
        if verifying:  # then the k + 1 positions of each sequence that verifies drafts
            verify = spec_verify.verify(logits[num_sampled + num_prompt:], verifying, self.sampler,
                                        masks.verified, self.opts.spec_greedy_accept, fed_ids)
            drafts = draft_chain() if verify.greedy and self.chains(step) else None
            if drafts is not None:  # one copy out of the static buffer, which the next replay overwrites
                chain = DeviceSample.of_tokens(drafts.clone())
        self.last, self.last_rows = sample, {s.seq_id: i for i, s in enumerate(sampled)}
        self.chained_rows = {s.seq_id: i for i, s in enumerate(verifying)} if chain is not None else {}
        return PendingStep(step, sample, prompt, verify, chain, self.proposer)

    @torch.inference_mode()
    def sample_steps(self, step: StepInput, ids: torch.Tensor, argmax: torch.Tensor, drafts: torch.Tensor
                     ) -> PendingStep:
        """Queue the copies of a launch of several verify steps (spec_decode/multi_step.py): each step's verified
        ids and argmax [steps, tokens] and the last chain's drafts [n, k], all static buffers. Its tokens are
        accepted on the host step by step (spec_verify.to_host); no next step takes its queries on the device."""
        for seq_id in step.finished:
            self.sampler.forget(seq_id)
        verifying = step.verifying
        # (each a clone: the buffers are static, and the copies read them later on the stream)
        verify = spec_verify.DeviceVerify(verifying, max(s.num_draft for s in verifying) + 1,
                                          DeviceSample.of_tokens(argmax.clone()), greedy=True,
                                          fed=DeviceSample.of_tokens(ids.clone()), steps=argmax.shape[0])
        pending = PendingStep(step, None, None, verify, DeviceSample.of_tokens(drafts.clone()), self.proposer)
        pending.chained = frozenset()  # (the next step is staged from the host's tokens)
        self.last, self.last_rows, self.chained_rows = None, {}, {}
        return pending

    def chains(self, step: StepInput) -> bool:
        """May a draft chain follow this verify step? (switch spec_draft_chain, a draft model: every sequence
        verifies k drafts, is plain greedy, and has the KV blocks the chain's passes write to)."""
        proposer = self.proposer
        if proposer is None or proposer.by_model is None or not self.opts.spec_draft_chain:
            return False
        k = proposer.k
        return all(s.num_draft == k and s.max_drafts >= k and plain_greedy(s) for s in step.seqs)
