"""LLMEngine: requests in, tokens out, one `step()` at a time.

    add_request(id, prompt, params)   tokenise, validate, queue n sequences
    step()                            schedule -> run the model -> sample -> detokenise -> check stops
    abort_request(id)                 drop a request wherever it is, returning its KV blocks

The offline `LLM` class (entrypoints/llm.py) and the async server bridge (entrypoints/async_engine.py) both drive
this loop.

The plain step is `step()` below: schedule -> run the model -> sample (`_launch`), then the host work on the
step's tokens, in two parts: (a) `_receive`, what the next schedule depends on (wait for the tokens, append them,
end the sequences that EOS, a stop token id or a length limit ends), and (b) `_process`, the rest (incremental
detokenisation, stop strings, logprobs, the RequestOutputs). With switch `overlap_scheduling` on (and
`async_scheduling` on top of it) the engine runs engine/overlap.py's `OverlappedStep` instead, chosen when the
engine is built: the same three parts in another order, so the host work of one step runs while the device
computes the next.

Speculative decoding (switch `speculative_decoding`, with a `speculative_config`; engine/speculative.py): before
each schedule the decoding sequences draft tokens, a step verifies them with their newest token, and `_receive`
appends the accepted ones plus one, each through the usual stop checks - the stop strings too, at once, so a stop
inside the accepted run cuts it there. Async scheduling is off while speculating.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from nanoserve.batch import ModelInput, TokenFeed
from nanoserve.config import EngineConfig
from nanoserve.engine import prompt_logprobs as prompt_lp
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.builder import check_kv_capacity, make_executor, resolve_limits
from nanoserve.engine.launched_step import LaunchedStep, Received
from nanoserve.engine.output_processor import RequestState, make_output, record_token
from nanoserve.engine.outputs import RequestOutput
from nanoserve.engine.overlap import OverlappedStep
from nanoserve.engine.sampler import DeviceSample, Sampler
from nanoserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from nanoserve.engine.sequence import FinishReason, Sequence
from nanoserve.engine.speculative import DeviceVerify, Speculator, StepRows
from nanoserve.engine.stop_checker import Stop, StopChecker
from nanoserve.engine.structured_output import StructuredOutputManager
from nanoserve.engine.tokenizer import load_tokenizer
from nanoserve.executor.base import Executor
from nanoserve.sampling import SamplingParams
from nanoserve.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict[str, Any]


class LLMEngine:
    """The engine loop around a scheduler, a block manager, an executor (the model) and a sampler."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None):
        """`executor`: reuse an already built model and KV pool (the benchmark's ablation builds one engine per
        switch setting around one model); None builds them from `config`."""
        self.config = config
        self.executor: Executor = executor or make_executor(config)
        try:
            self._build(config, reuse_pool=executor is not None)
        except BaseException:
            if executor is None:  # ours: do not leave tensor-parallel workers or device memory behind
                self.executor.shutdown()
            raise

    def _build(self, config: EngineConfig, reuse_pool: bool) -> None:
        """Everything around the executor: limits, the KV pool, block manager, scheduler, tokenizer, sampler."""
        self.model_config = self.executor.model_config
        limits = resolve_limits(config, self.model_config)
        self.block_size, self.max_model_len = limits.block_size, limits.max_model_len
        self.max_num_batched_tokens = budget = limits.max_num_batched_tokens
        num_blocks = self.executor.num_blocks if reuse_pool and self.executor.num_blocks else \
            self.executor.initialize_cache(self.max_model_len, budget, config.max_num_seqs)
        check_kv_capacity(num_blocks, limits)
        opts = config.optimizations
        self.observers: list[Callable[..., None]] = []
        self.block_manager = BlockManager(num_blocks, self.block_size, opts.prefix_caching, self._emit)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, budget, self.max_model_len, opts,
                                                   config.scheduling_policy),
                                   self.block_manager, self._emit)
        self.tokenizer = load_tokenizer(config.tokenizer or self.executor.model_dir)
        self._token_texts: dict[int, str] = {}
        self.eos_token_id = self.model_config.eos_token_id
        self.stop_checker = StopChecker(self.tokenizer, self.eos_token_id, self.max_model_len)
        self.sampler = Sampler(self.executor.device, config.seed, self.eos_token_id, config.logprobs_mode)
        self.structured_output = StructuredOutputManager(config.tokenizer or self.executor.model_dir,
                                                         self.model_config.vocab_size, [self.eos_token_id],
                                                         max_batch=config.max_num_seqs)
        self.requests: dict[str, RequestState] = {}
        self.overlap_grammar = opts.overlap_grammar
        self.pinned_masks = opts.overlap_grammar and self.executor.device.type == "cuda"
        self.speculator = self._speculator(config)
        self._last_rows: list[StepRows] = []  # the last received step's final positions (a draft model's input)
        # the step loop, chosen once: a step in flight must be finished by the loop that launched it. Async
        # scheduling needs an executor that takes tokens on the device, and no drafts (a draft is made from the
        # previous step's tokens, on the host)
        launch_ahead = opts.async_scheduling and self.executor.supports_token_feed and self.speculator is None
        self.overlapped = OverlappedStep(self._launch, self._receive, self._process, launch_ahead) \
            if opts.overlap_scheduling else None
        self.stats = EngineStats()
        self._seq_ids = itertools.count()
        logger.info("engine ready: model=%s device=%s blocks=%d x %d tokens, max_model_len=%d, "
                    "max_num_batched_tokens=%d, max_num_seqs=%d; switches %s", config.model, self.executor.device,
                    num_blocks, self.block_size, self.max_model_len, budget, config.max_num_seqs, opts.describe())

    def _speculator(self, config: EngineConfig) -> Speculator | None:
        """The drafter and verifier of config.speculative_config (checked even when the switch is off)."""
        if config.speculative_config is None:
            return None
        spec = SpeculativeConfig.from_dict(config.speculative_config)
        if not config.optimizations.speculative_decoding:
            logger.info("speculative_config %s is not used: the speculative_decoding switch is off", spec)
            return None
        if spec.method != "ngram" and config.tensor_parallel_size > 1:
            raise ValueError(f"speculative_config method {spec.method!r} runs with tensor_parallel_size 1 only")
        opts = config.optimizations
        logger.info("speculative decoding: %s (async scheduling off; verify steps %s)", spec,
                    "replay CUDA graphs where they apply" if opts.spec_cuda_graphs
                    else "run eagerly (switch spec_cuda_graphs off)")
        return Speculator(spec, self.max_model_len, self.executor, self.block_manager.allocate,
                          opts.spec_greedy_accept, opts.spec_draft_chain and opts.spec_cuda_graphs)

    # -- the loop -----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration: schedule -> run the model -> sample -> process the outputs. Returns an output for
        every request that produced tokens or finished. With overlap_scheduling on, engine/overlap.py's
        iteration runs instead, and returns the previous call's step's outputs."""
        if self.overlapped is not None:
            return self.overlapped.step()
        launched = self._launch()  # schedule, run the model, queue the sampling
        if launched is None:  # nothing to run
            return []
        received = self._receive(launched)  # (a) the tokens on the host: append, EOS / stop ids / length
        return self._process(received)  # (b) detokenise, stop strings, logprobs: the outputs

    def _launch(self, previous: LaunchedStep | None = None) -> LaunchedStep | None:
        """Schedule a step, run the model and queue the sampling; on a GPU this returns while the device works.
        `previous`: the step still in flight whose tokens this one may take on the device (async scheduling)."""
        if self.speculator is not None:
            if self.overlap_grammar:  # a structured output's drafts are checked against its current grammar
                self.structured_output.catch_up([s for s in self.scheduler.running if s.grammar is not None])
            self.speculator.propose(self.scheduler.running, self._last_rows)
            self._last_rows = []
        sched = self.scheduler.schedule()
        self.stats.num_preemptions += len(sched.preempted)
        if sched.is_empty:
            return None
        self._count_step(sched)
        # (before the staging: a draft chain's passes write past the verified positions)
        chain = self.speculator is not None and self.speculator.prepare_chain(sched.scheduled)
        inp, prompt_rows, targets, fed = model_input(sched, self.model_config.vocab_size)
        feed = token_feed(fed, previous)
        self._emit("step", scheduled=sched.scheduled, preempted=sched.preempted, model_input=inp)
        logits = self.executor.execute_model(inp, feed) if feed is not None else self.executor.execute_model(inp)
        sampled = [s.seq for s in sched.scheduled if s.samples and not s.num_draft]
        verifying = [s for s in sched.scheduled if s.num_draft]
        # structured outputs, on the host while the forward runs: the grammars catch up on the last tokens
        # (overlap_grammar; else _receive accepted them) and the constrained rows' token masks are filled
        grammar = None
        if sampled:
            if self.overlap_grammar:
                self.structured_output.catch_up(sampled)
            grammar = self.structured_output.bitmask(sampled, pinned=self.pinned_masks)
        # sampled at once: with CUDA graphs `logits` is a view of a static buffer that the next replay overwrites
        sample = self.sampler.sample(logits[: len(sampled)], sampled, grammar, self.executor.last_argmax()) \
            if sampled else None
        launched = LaunchedStep(sampled, sample)
        num_prompt_rows = len(targets)
        if prompt_rows:  # the prompt positions' logits follow the sample rows'
            launched.prompt_logprobs = prompt_lp.compute(logits[len(sampled): len(sampled) + num_prompt_rows],
                                                         prompt_rows, targets,
                                                         as_logits=self.config.logprobs_mode.endswith("logits"))
            launched.prompt_seqs = {s.seq.seq_id: s.seq for s in sched.scheduled}
        if verifying:  # then the k + 1 positions of each sequence that verifies drafts
            launched.verify = self.speculator.verify(logits[len(sampled) + num_prompt_rows:], verifying,
                                                     self.sampler)
            drafts = self.executor.draft_chain() if chain and launched.verify.drafts is not None else None
            if drafts is not None:  # the next step's drafts, copied back beside this step's tokens
                # (one copy out of the static buffer, which the next replay overwrites; dense, so it flattens)
                launched.chain = DeviceSample(drafts.clone().view(-1), [None] * drafts.numel(), None, None,
                                              None).start_host_copy()
        for seq in sampled + [s.seq for s in verifying]:  # its token is on the device until _receive takes it
            seq.num_pending += 1
        if self.speculator is not None:
            offset = 0
            for s in sched.scheduled:
                launched.rows.append((s.seq, s.seq.num_computed_tokens, offset, s.num_new_tokens - s.num_draft))
                offset += s.num_new_tokens
        self.scheduler.update_after_step(sched)
        return launched

    def _receive(self, launched: LaunchedStep) -> list[Received]:
        """(a): wait for a step's tokens; append them and end the sequences that EOS, a stop id or a length limit
        ends. A sequence finished since the step was launched (aborted, or ended by a stop string) gets nothing."""
        if launched.prompt_logprobs is not None:  # before the next schedule, which reads how many there are
            for seq_id, entries in prompt_lp.to_host(launched.prompt_logprobs, self._token_text).items():
                launched.prompt_seqs[seq_id].prompt_logprobs.extend(d for _, d in entries)
        received: list[Received] = []
        accepted: dict[int, int] = {}
        if launched.verify is not None:
            accepted = self._receive_verified(launched.verify, received)
            if launched.chain is not None:
                self.speculator.keep_chain(launched.verify, self.sampler.to_host(launched.chain), accepted)
        if self.speculator is not None:  # the positions made final: the drafter reads them (unfinished sequences)
            self._last_rows = [(seq, start, offset, n + accepted.get(seq.seq_id, 0))
                               for seq, start, offset, n in launched.rows]
        if launched.sample is None:
            return received
        result = self.sampler.to_host(launched.sample)
        for i, seq in enumerate(launched.seqs):
            if seq.is_finished:  # (finishing dropped its pending tokens)
                continue
            seq.num_pending -= 1
            if seq.grammar is not None and seq.grammar.failed:  # rejected its previous token at catch-up
                self._finish(seq, FinishReason.ERROR, None)  # this step's (unmasked) token is dropped
                received.append((seq, None, i, False))
                continue
            token = result.token_ids[i]
            seq.output_token_ids.append(token)
            self.stats.num_generation_tokens += 1
            if not self._grammar_accepts(seq, token):  # rejected (the mask should prevent it)
                self._finish(seq, FinishReason.ERROR, None)
            else:
                self._finish_if(seq, self.stop_checker.check_token(seq))  # a sequence it ends has its text done
            received.append((seq, result, i, False))
        return received

    def _receive_verified(self, verify: DeviceVerify, received: list[Received]) -> dict[int, int]:
        """The tokens of the sequences that verified drafts: the accepted drafts and the drawn token, appended one
        at a time through every stop check (stop strings included: a stop ends the run there); then the K/V of
        the accepted positions is kept and the blocks of the rejected ones given back. Returns each unfinished
        sequence's accepted drafts (by seq_id)."""
        result = self.speculator.to_host(verify)
        accepted: dict[int, int] = {}
        for r, seq in enumerate(verify.seqs):
            if seq.is_finished:  # aborted, or ended by a stop string, since the step was launched
                continue
            seq.num_pending -= 1
            row = r * verify.width
            tokens = [t for t in result.token_ids[row: row + verify.width] if t >= 0]
            self.stats.record_acceptance(verify.num_draft[r], len(tokens) - 1)
            for j, token in enumerate(tokens):
                seq.output_token_ids.append(token)
                self.stats.num_generation_tokens += 1
                received.append((seq, result, row + j, True))
                if not self._grammar_accepts(seq, token):  # rejected (the masks should prevent it)
                    self._finish(seq, FinishReason.ERROR, None)
                    break
                stop = self.stop_checker.check_token(seq)
                if stop is None:
                    stop = self.stop_checker.check_text(seq)
                if stop is not None:
                    self._finish(seq, stop.reason, stop.stop_reason)
                    break
            if not seq.is_finished:
                self.scheduler.accept_drafts(seq, len(tokens) - 1)
                accepted[seq.seq_id] = len(tokens) - 1
        return accepted

    def _grammar_accepts(self, seq: Sequence, token: int) -> bool:
        """The grammar takes the token now - always with overlap_grammar off; with it on only EOS, which may end
        the format (and so the sequence, even under ignore_eos) before the next schedule. The other tokens wait for
        the catch-up after the next forward is launched (_launch)."""
        if seq.grammar is None:
            return True
        if not self.overlap_grammar:
            return self.structured_output.accept(seq)
        if token == self.eos_token_id:
            self.structured_output.catch_up([seq])
            return not seq.grammar.failed
        return True

    def _process(self, received: list[Received]) -> list[RequestOutput]:
        """(b): logprobs, detokenisation and stop strings for the tokens `_receive` appended; the outputs."""
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        gaps: list[float] = []  # each sequence's time since its previous token (the metrics' inter-token latency)
        for seq, result, i, text_done in received:
            if result is None:  # ended without a token (its grammar failed at catch-up)
                touched[seq.request_id] = self.requests[seq.request_id]
                continue
            if seq.first_token_time is not None:
                gaps.append(now - seq.last_token_time)
            record_token(seq, result, i, now)
            if not seq.is_finished and not text_done:
                self._finish_if(seq, self.stop_checker.check_text(seq))
            touched[seq.request_id] = self.requests[seq.request_id]
        if gaps:
            self._emit("inter_token_latencies", values=gaps)
        return [self._output(state) for state in touched.values()]

    # -- the loop's helpers ---------------------------------------------------------------------------------
    def _finish_if(self, seq: Sequence, stop: Stop | None) -> None:
        if stop is not None:
            self._finish(seq, stop.reason, stop.stop_reason)

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None) -> None:
        seq.stop_reason = stop_reason
        seq.grammar = None
        self.scheduler.finish(seq, reason)
        self.sampler.forget(seq.seq_id)
        self.stats.finished[reason.value] = self.stats.finished.get(reason.value, 0) + 1

    def _output(self, state: RequestState) -> RequestOutput:
        out = make_output(state)
        if out.finished:
            self.requests.pop(state.request_id, None)
        return out

    def _token_text(self, token_id: int) -> str:
        """A token's text, special tokens included (prompt logprobs' decoded_token)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _count_step(self, sched: SchedulerOutput) -> None:
        self.stats.num_steps += 1
        for seq in sched.admitted:
            self.stats.prefix_cache_queries += seq.num_tokens
            self.stats.prefix_cache_hits += seq.num_cached_tokens
        self.stats.num_computed_prefill_tokens += sum(s.num_new_tokens for s in sched.scheduled if not s.is_decode)

    # -- observers (the walkthrough and tests watch the engine through these) -------------------------------
    def add_observer(self, fn: Callable[..., None]) -> None:
        """fn(event_name, **payload) is called on admit, chunk, preempt, finish, allocate, free, evict,
        prefix_hit, step and inter_token_latencies events (on the thread that runs the engine)."""
        self.observers.append(fn)

    def _emit(self, event: str, **payload: Any) -> None:
        for fn in self.observers:
            fn(event, **payload)

    # -- requests -----------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt is too long: {len(token_ids)} tokens, but max_model_len is "
                             f"{self.max_model_len} (and at least one token must be generated)")

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue a request (n sequences). `priority`: with the priority scheduling policy, lower runs sooner (any
        other value than 0 is a ValueError under first come, first served, as in vLLM). Raises ValueError for a
        bad prompt or parameters."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError("priority: requests are scheduled first come, first served; start the engine with "
                             "--scheduling-policy priority to use it")
        params = params or SamplingParams()
        params.validate(self.config.max_logprobs, self.model_config.vocab_size)
        if params.bad_words:
            params.set_bad_words_token_ids(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError("cache_salt: must be a non-empty string")
        # structured outputs: compiled here, in the caller's thread (a cache hit when the server compiled it)
        compiled = self.structured_output.compile(params.structured_outputs) if params.structured_outputs else None
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seqs = [Sequence(next(self._seq_ids), request_id, i, token_ids, params, arrival_time=arrival,
                         cache_salt=salt, priority=priority) for i in range(params.n)]
        if compiled is not None:
            for seq in seqs:
                seq.grammar = self.structured_output.new_grammar(
                    compiled, params.structured_outputs.reasoning_end_token_id)
        self.requests[request_id] = RequestState(request_id, text, token_ids, params, seqs, arrival)
        for seq in seqs:
            self.scheduler.add(seq)
        self.stats.num_requests += 1
        self.stats.num_prompt_tokens += len(token_ids)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests wherever they are (waiting, prefilling, decoding) and free their blocks. Freeing them
        while a step that uses them is in flight is safe: any later use is queued behind it on the device."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            state = self.requests.pop(rid, None)
            if state is None:
                continue
            for seq in state.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, FinishReason.ABORT)
                self.sampler.forget(seq.seq_id)
            self.stats.num_aborted += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def shutdown(self) -> None:
        if self.overlapped is not None:  # drop the step in flight: its tensors live on the device
            self.overlapped.in_flight = None
        self.executor.shutdown()


@dataclass
class EngineStats:
    """Monotonic counters since start (read by /metrics, the benchmark and the walkthrough)."""

    num_requests: int = 0
    num_prompt_tokens: int = 0  # tokens of every prompt added
    num_computed_prefill_tokens: int = 0  # prompt (and recompute) tokens actually run through the model
    num_generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0
    num_steps: int = 0
    num_aborted: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> count
    # speculative decoding, in vLLM's terms (its vllm:spec_decode_* metrics): verify steps of a sequence, draft
    # tokens verified, draft tokens accepted, and accepted per draft position (a tuple: replaced, never mutated,
    # so a copy of the stats keeps its own)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: tuple[int, ...] = ()

    @property
    def spec_decode_mean_accepted_length(self) -> float:
        """Tokens a verify step yields per sequence on average: 1 + its accepted drafts (vLLM's definition)."""
        n = self.spec_decode_num_drafts
        return 1.0 + self.spec_decode_num_accepted_tokens / n if n else 0.0

    def record_acceptance(self, num_draft: int, num_accepted: int) -> None:
        self.spec_decode_num_drafts += 1
        self.spec_decode_num_draft_tokens += num_draft
        self.spec_decode_num_accepted_tokens += num_accepted
        per_pos = list(self.spec_decode_accepted_per_pos) + [0] * (num_draft - len(self.spec_decode_accepted_per_pos))
        for j in range(num_accepted):
            per_pos[j] += 1
        self.spec_decode_accepted_per_pos = tuple(per_pos)


def token_feed(fed: list[tuple[int, Sequence]], previous: LaunchedStep | None) -> TokenFeed | None:
    """The TokenFeed for the input positions `fed` (index into input_ids, the sequence whose pending token goes
    there): each pending token is the one `previous` sampled for that sequence."""
    if not fed:
        return None
    if previous is None or previous.sample is None:
        raise RuntimeError("a scheduled token is still on the device, but no step in flight sampled it")
    rows = {seq.seq_id: i for i, seq in enumerate(previous.seqs)}
    return TokenFeed([dst for dst, _ in fed], [rows[seq.seq_id] for _, seq in fed], previous.sample.token_ids)


def model_input(sched: SchedulerOutput, vocab_size: int
                ) -> tuple[ModelInput, list[prompt_lp.PromptLogprobRows], list[int], list[tuple[int, Sequence]]]:
    """The schedule as the runner's plain lists: each sequence's new tokens, lengths and block table; for the
    sequences that need prompt logprobs, which extra logits rows give them and the prompt tokens those score; and
    the input positions whose token is still pending on the device (a placeholder 0 in the list, with its
    sequence: async scheduling feeds it). The positions of the sequences that verify drafts ask for their logits
    after the prompt rows' (ModelInput.prompt_rows holds both: the runner returns the logits of any row listed)."""
    ids: list[int] = []
    verify_rows: list[int] = []
    fed: list[tuple[int, Sequence]] = []
    query_lens, seq_lens, tables, sample_rows = [], [], [], []
    prompt_token_rows: list[int] = []
    prompt_rows: list[prompt_lp.PromptLogprobRows] = []
    targets: list[int] = []
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
                prompt_rows.append(prompt_lp.PromptLogprobRows(seq.seq_id, first + 1, last - first,
                                                               vocab_size if num == -1 else num,
                                                               seq.params.prompt_logprobs_temperature))
                targets.extend(seq.prompt_token_ids[first + 1: last + 1])
        # slice the prompt or the outputs directly: seq.token_ids copies the whole sequence (128k tokens at W4)
        known = min(end - s.num_draft, seq.num_known_tokens)
        if start >= prompt_len:
            ids.extend(seq.output_token_ids[start - prompt_len: known - prompt_len])
        elif known <= prompt_len:
            ids.extend(seq.prompt_token_ids[start:known])
        else:
            ids.extend(seq.token_ids[start:known])
        for _ in range(max(start, known), end - s.num_draft):  # pending tokens: filled in on the device
            fed.append((len(ids), seq))
            ids.append(0)
        if s.num_draft:  # speculative decoding: every position's logits, after the prompt rows
            verify_rows.extend(range(len(ids) - 1, len(ids) + s.num_draft))
            ids.extend(s.draft)
        query_lens.append(s.num_new_tokens)
        seq_lens.append(start + s.num_new_tokens)
        tables.append(list(seq.block_table))
        if s.samples and not s.num_draft:
            sample_rows.append(row)
    inp = ModelInput(ids, query_lens, seq_lens, tables, sample_rows, prompt_token_rows + verify_rows)
    return inp, prompt_rows, targets, fed
