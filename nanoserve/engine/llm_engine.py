"""LLMEngine: requests in, tokens out, one `step()` at a time.

    add_request(id, prompt, params)   tokenise, validate, queue n sequences
    step()                            schedule -> run the model (token ids come back) -> update -> outputs
    abort_request(id)                 drop a request wherever it is, returning its KV blocks

The offline `LLM` class (entrypoints/llm.py) and the async server bridge (entrypoints/async_engine.py) both drive
this loop. The engine deals in plain lists and token ids: the executor (executor/, distributed/) runs the forward
and returns each sequence's new tokens - sampled, verified and drafted behind it, in runner/ and spec_decode/ - so
nothing here touches a tensor.

The plain step is `step()` below, in three parts: `launch` (schedule, hand the step to the executor: the forward,
then the sampling, queued on the device), `update` (wait for the tokens; append them to their sequences and end
the sequences that EOS, a stop token id or a length limit ends: what the next schedule depends on) and `outputs`
(incremental detokenisation, stop strings, logprobs, the RequestOutputs). With switch `overlap_scheduling` on (and
`async_scheduling` on top of it) the engine runs engine/overlap.py's `OverlappedStep` instead, chosen when the
engine is built: the same three parts in another order, so the host work of one step runs while the device
computes the next.

Images and videos come in already processed (a prompt dict's `mm_features`: the front ends run
nanoserve/multimodal/); the scheduler has their encoding done with the prefill (engine/encoder_cache.py).

Speculative decoding (a `speculative_config`) changes nothing here but the count: a step's output carries each
sequence's next draft tokens, which the scheduler schedules after its newest token, and a verifying sequence gets
its accepted drafts plus one token, appended through the same stop checks (`append_tokens`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from nanoserve.config import EngineConfig
from nanoserve.engine import kv_events
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.builder import check_kv_capacity, make_executor, resolve_limits
from nanoserve.engine.encoder_cache import EncoderCacheManager
from nanoserve.engine.kv_connector import KVConnector, check_supported
from nanoserve.engine.launched_step import Appended, LaunchedStep
from nanoserve.engine.output_processor import RequestState, make_output, record_token
from nanoserve.engine.outputs import Logprob, RequestOutput
from nanoserve.engine.overlap import OverlappedStep
from nanoserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput
from nanoserve.engine.sequence import FinishReason, Sequence
from nanoserve.engine.step_input import build_step_input
from nanoserve.engine.stop_checker import Stop, StopChecker
from nanoserve.engine.structured_output import StructuredOutputManager
from nanoserve.engine.tokenizer import load_tokenizer
from nanoserve.executor.base import Executor
from nanoserve.kv_transfer import params as kv_params
from nanoserve.kv_transfer.config import KVTransferConfig
from nanoserve.runner.sampler import plain_greedy
from nanoserve.sampling import SamplingParams
from nanoserve.spec_decode.config import SpeculativeConfig
from nanoserve.step import GrammarMasks, MultiModalFeature, SeqTokens, StepInput, StepOutput

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict[str, Any]
DEFAULT_MM_LIMIT = 999
"""Images (and videos) a prompt may carry when limit_mm_per_prompt does not say (vLLM's default)."""


class LLMEngine:
    """The engine loop around a scheduler, a block manager and an executor (the model, which returns tokens)."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None):
        """`executor`: reuse an already built model and KV pool (the benchmark's ablation builds one engine per
        switch setting around one model); None builds them from `config`."""
        self.config = config
        self.kv_transfer = KVTransferConfig.from_dict(config.kv_transfer_config)
        """Prefill/decode disaggregation (engine/kv_connector.py), when it names a connector."""
        if self.kv_transfer.kv_connector is not None:
            check_supported(config, self.kv_transfer)
        self.executor: Executor = executor or make_executor(config)
        try:
            self._build(config, reuse_pool=executor is not None)
        except BaseException:
            if executor is None:  # ours: do not leave tensor-parallel workers or device memory behind
                self.executor.shutdown()
            raise

    def _build(self, config: EngineConfig, reuse_pool: bool) -> None:
        """Everything around the executor: limits, the KV pool, block manager, scheduler, tokenizer."""
        self.model_config = self.executor.model_config
        limits = resolve_limits(config, self.model_config, self.executor.block_size)
        self.block_size, self.max_model_len = limits.block_size, limits.max_model_len
        self.max_num_batched_tokens = budget = limits.max_num_batched_tokens
        num_blocks = self.executor.num_blocks if reuse_pool and self.executor.num_blocks else \
            self.executor.initialize_cache(self.max_model_len, budget, config.max_num_seqs)
        check_kv_capacity(num_blocks, limits)
        opts = config.optimizations
        self.spec_config = self._speculative_config(config)
        k = self.spec_config.num_speculative_tokens if self.spec_config else 0
        self.observers: list[Callable[..., None]] = []
        self.block_manager = BlockManager(num_blocks, self.block_size, opts.prefix_caching, self._emit)
        self.kv_connector = KVConnector.start(self.kv_transfer, self.executor, self.block_size) \
            if self.kv_transfer.kv_connector is not None else None
        self.vision_config = self.executor.vision_config  # None: the model takes no images or videos
        rows = self.executor.encoder_cache_size
        self.encoder_cache = EncoderCacheManager(rows, rows, opts.encoder_cache) if self.vision_config else None
        self.scheduler = Scheduler(SchedulerConfig(
            config.max_num_seqs, budget, self.max_model_len, opts, config.scheduling_policy, k,
            draft_writes_kv=self.spec_config is not None and self.spec_config.method != "ngram"),
            self.block_manager, self._emit, self.kv_connector, self.encoder_cache)
        self.tokenizer = load_tokenizer(config.tokenizer or self.executor.model_dir)
        self._token_texts: dict[int, str] = {}
        self.eos_token_id = self.model_config.eos_token_id
        self.stop_checker = StopChecker(self.tokenizer, self.eos_token_id, self.max_model_len)
        self.structured_output = StructuredOutputManager(config.tokenizer or self.executor.model_dir,
                                                         self.model_config.vocab_size, [self.eos_token_id],
                                                         max_batch=config.max_num_seqs)
        self.requests: dict[str, RequestState] = {}
        self.overlap_grammar = opts.overlap_grammar
        self._finished_ids: list[int] = []  # sequences ended since the last step (the runner forgets them)
        # the step loop, chosen once: a step in flight must be finished by the loop that launched it. Async
        # scheduling needs an executor that takes tokens on the device; with speculative decoding, a step whose
        # queries the draft chain left on the device (switch spec_async)
        launch_ahead = opts.async_scheduling and self.executor.supports_token_feed
        speculative_ahead = self._speculative_ahead if self.spec_config is not None else None
        self.overlapped = OverlappedStep(self.launch, self.update, self.outputs, launch_ahead, speculative_ahead) \
            if opts.overlap_scheduling else None
        self.stats = EngineStats()
        self._seq_ids = itertools.count()
        # KV-cache events for routers (--kv-events-config; engine/kv_events.py): the warm-up's scratch blocks are
        # never hashed, so they publish nothing
        self.kv_events = kv_events.attach(self, config.kv_events_config)
        logger.info("engine ready: model=%s device=%s blocks=%d x %d tokens, max_model_len=%d, "
                    "max_num_batched_tokens=%d, max_num_seqs=%d; switches %s", config.model, self.executor.device,
                    num_blocks, self.block_size, self.max_model_len, budget, config.max_num_seqs,
                    opts.describe(self.executor.platform))

    def _speculative_config(self, config: EngineConfig) -> SpeculativeConfig | None:
        """config.speculative_config, checked (also when the switch is off), or None when not used."""
        if config.speculative_config is None:
            return None
        spec = SpeculativeConfig.from_dict(config.speculative_config)
        if not config.optimizations.speculative_decoding:
            logger.info("speculative_config %s is not used: the speculative_decoding switch is off", spec)
            return None
        if spec.method != "ngram" and config.tensor_parallel_size > 1:
            raise ValueError(f"speculative_config method {spec.method!r} runs with tensor_parallel_size 1 only")
        opts = config.optimizations
        logger.info("speculative decoding: %s (verify steps %s; %s)", spec,
                    "replay CUDA graphs where they apply" if opts.spec_cuda_graphs
                    else "run eagerly (switch spec_cuda_graphs off)",
                    "launched ahead of the previous step's tokens where the draft chain leaves them on the device"
                    if opts.spec_async and opts.async_scheduling and opts.spec_draft_chain
                    else "each launched once the previous step's tokens are on the host")
        return spec

    # -- the loop -----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration: schedule -> run the model -> update the sequences -> outputs. Returns an output for
        every request that produced tokens or finished. With overlap_scheduling on, engine/overlap.py's
        iteration runs instead, and returns the previous call's step's outputs."""
        if self.overlapped is not None:
            return self.overlapped.step()
        launched = self.launch()  # schedule; the forward and the sampling, queued on the device
        if launched is None:  # nothing to run (a request may still end: a P/D decode whose KV pull failed)
            return self.outputs([])
        # (a) the tokens: append, EOS / stop ids / length; (b) detokenise, stop strings, logprobs: the outputs
        return self.outputs(self.update(launched))

    def launch(self, previous: LaunchedStep | None = None) -> LaunchedStep | None:
        """Schedule a step and start it; on a GPU this returns while the device works. `previous`: the step still in
        flight, when this one is launched before its tokens arrive (async scheduling)."""
        sched = self.scheduler.schedule(self._drafts_on_device(previous))
        self._count_step(sched)
        if sched.is_empty:
            return None
        step = build_step_input(sched, self.model_config.vocab_size, self._take_finished())
        step.spec_steps = self._spec_steps(sched, step)
        self._emit("step", scheduled=sched.scheduled, preempted=sched.preempted, model_input=step.model)
        self.executor.execute_model(step)  # the forward, queued
        future = self.executor.sample_tokens(self._grammar_masks(sched))  # (the masks filled while it runs)
        sampled = self.scheduler.update_after_step(sched)  # their new tokens are pending until update
        return LaunchedStep(sched, step, future, sampled)

    def update(self, launched: LaunchedStep) -> list[Appended]:
        """(a): wait for a step's tokens; append them and end the sequences that EOS, a stop id or a length limit
        ends. A sequence finished since the step was launched (aborted, or ended by a stop string) gets nothing."""
        output = launched.future.result()
        self._take_side_outputs(launched.sched, output)
        appended: list[Appended] = []
        for s, out in zip(launched.sampled, output.seqs, strict=True):  # (the same sequences, in order)
            seq = s.seq
            if seq.is_finished:  # (finishing dropped its pending tokens)
                continue
            seq.num_pending -= 1
            appended += (added := self.append_tokens(seq, out.token_ids, out.logprobs))
            if s.num_draft > s.num_padded:  # (the drafts proposed, not the padding: spec_pad_drafts)
                self._record_acceptance(s, out, len(added))
            if s.max_drafts and not seq.is_finished:  # speculative decoding: keep the accepted K/V, take drafts
                self._speculated(s, len(out.token_ids) - 1, output.drafts.get(seq.seq_id, []))
        return appended

    def append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[dict[int, float]] | None = None
                      ) -> list[Appended]:
        """Append a step's tokens to seq, one at a time through the stop checks (its grammar, EOS, stop ids, a
        finished format, length); several tokens (accepted drafts) have their stop strings checked at once too, so a
        stop inside the run cuts it there."""
        if seq.grammar is not None and seq.grammar.failed:  # rejected its previous token at catch-up
            self._finish(seq, FinishReason.ERROR, None)  # this step's (unmasked) token is dropped
            return [Appended(seq, None, has_token=False)]
        appended = []
        for j, token in enumerate(tokens):
            seq.output_token_ids.append(token)
            appended.append(Appended(seq, logprobs[j] if logprobs else None, text_done=len(tokens) > 1,
                                     first=len(seq.output_token_ids) == 1))
            if self._ends(seq, token, check_text=len(tokens) > 1):
                break
        self.stats.num_generation_tokens += len(appended)
        return appended

    def outputs(self, appended: list[Appended]) -> list[RequestOutput]:
        """(b): logprobs, detokenisation and stop strings for the tokens `update` appended; the outputs (also of the
        requests that ended without a token: a P/D decode whose KV could not be pulled)."""
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        gaps: list[float] = []  # each sequence's time since its previous token (the metrics' inter-token latency)
        for a in appended + self._failed_loads():
            touched[a.seq.request_id] = self.requests[a.seq.request_id]
            if a.has_token:  # (not: it ended without a token, its grammar failed at catch-up)
                gaps += record_token(a.seq, a.logprobs, now)
                if not a.seq.is_finished and not a.text_done:
                    self._finish_if(a.seq, self.stop_checker.check_text(a.seq))
        self._emit("outputs", appended=appended, inter_token_latencies=gaps)
        return [self._output(state) for state in touched.values()]

    # -- the loop's helpers ---------------------------------------------------------------------------------
    def _grammar_masks(self, sched: SchedulerOutput) -> GrammarMasks | None:
        """Structured outputs: the grammars catch up on the last tokens (overlap_grammar; otherwise `update`
        accepted them) and the constrained rows' token masks are filled - for the sampled rows, and each verified
        position."""
        constrained = [s for s in sched.scheduled if s.seq.grammar is not None and s.samples]
        if not constrained:
            return None
        if self.overlap_grammar:
            self.structured_output.catch_up([s.seq for s in constrained])
        sampled = [s.seq for s in sched.scheduled if s.samples and not s.num_draft]
        verifying = [(s.seq, s.draft) for s in sched.scheduled if s.num_draft]
        return GrammarMasks(self.structured_output.bitmask(sampled) if sampled else None,
                            self.structured_output.verify_masks(verifying) if verifying else None)

    def _record_acceptance(self, s: ScheduledSeq, out: SeqTokens, num_appended: int) -> None:
        """The acceptance counters of a verifying sequence's step: one verify per step the launch ran (several with
        spec_multi_step), counting those that emitted a token the sequence kept (not the ones past its stop)."""
        done = 0
        for n in out.accepted or [len(out.token_ids) - 1]:
            if done >= num_appended:
                break
            self.stats.record_acceptance(s.proposed, min(n, s.proposed))
            done += n + 1

    def _speculated(self, s: ScheduledSeq, num_accepted: int, drafts: list[int]) -> None:
        """After a speculative sequence's tokens are appended: the K/V of its accepted drafts is kept and the blocks of
        rejected or lookahead positions go back (`Scheduler.accept_drafts`); its next drafts - a structured output's
        cut where its grammar forbids one - wait for its next step."""
        seq = s.seq
        self.scheduler.accept_drafts(seq, num_accepted)
        if drafts and seq.grammar is not None:
            if self.overlap_grammar:  # the grammar first takes the tokens just appended
                self.structured_output.catch_up([seq])
            drafts = self.structured_output.cut_drafts(seq, drafts)
        seq.spec_token_ids = drafts

    def _ends(self, seq: Sequence, token: int, check_text: bool) -> bool:
        """Does seq's newest token end it? Its grammar rejecting it (an error), then EOS, a stop id, a finished format
        or a length limit, and with `check_text` a stop string. Finishes it if so."""
        if not self._grammar_accepts(seq, token):  # (the masks should prevent it)
            self._finish(seq, FinishReason.ERROR, None)
            return True
        stop = self.stop_checker.check_token(seq)  # a sequence it ends has its text done
        if stop is None and check_text:
            stop = self.stop_checker.check_text(seq)
        self._finish_if(seq, stop)
        return stop is not None

    def _drafts_on_device(self, previous: LaunchedStep | None) -> frozenset[int]:
        """The sequences whose next query - bonus token and drafts - a step launched ahead of `previous`'s tokens
        takes where previous's draft chain left it (speculative decoding with async scheduling)."""
        return previous.future.chained if previous is not None and self.spec_config is not None else frozenset()

    def _spec_steps(self, sched: SchedulerOutput, step: StepInput) -> int:
        """How many speculative steps this launch runs on the device (switch spec_multi_step,
        spec_decode/multi_step.py): spec_steps_per_launch where every scheduled sequence verifies k drafts, is plain
        greedy and has room for that many steps (max_tokens, max_model_len: so its drafts are those one step per
        launch makes), nothing waits to be admitted, and the pool holds the blocks of the farthest those steps and
        the last one's drafts can reach (taken here, trimmed when the tokens arrive); else 1."""
        steps, spec = self.config.spec_steps_per_launch, self.spec_config
        if (steps < 2 or spec is None or spec.method == "ngram" or not self.config.optimizations.spec_multi_step
                or self.scheduler.waiting or sched.preempted or step.fed):
            return 1
        k = spec.num_speculative_tokens
        for s, row in zip(sched.scheduled, step.seqs, strict=True):
            seq = s.seq
            if not s.samples or s.num_draft != k or s.num_padded or s.max_drafts < k or not plain_greedy(row):
                return 1
            lag = k + 1 if s.on_device else 0  # (the step in flight may emit that many the host does not know)
            room = (steps + 1) * (k + 1) + lag
            if seq.num_known_tokens + room > self.max_model_len or (
                    seq.params.max_tokens is not None and len(seq.output_token_ids) + room > seq.params.max_tokens):
                return 1
        # the farthest position: k + 1 per step, the last chain's drafts k - 1 further, after the (unknown) lag
        reach = [s.seq.num_computed_tokens + (k if s.on_device else 0) + steps * (k + 1) + k - 1
                 for s in sched.scheduled]
        if not self.scheduler.reserve(list(zip((s.seq for s in sched.scheduled), reach))):
            return 1
        step.model.block_tables = [list(s.seq.block_table) for s in sched.scheduled]
        return steps

    def _speculative_ahead(self, previous: LaunchedStep) -> bool:
        """Speculative decoding with async scheduling (switch spec_async): may the next step be launched before
        `previous`'s tokens arrive? Only where every running sequence's next query - its bonus token and drafts -
        was left on the device by previous's draft chain, nothing waits to be admitted, and the most the two steps
        can reach fits: the blocks for it are free and its positions stay within max_model_len (previous may
        accept up to k drafts the host does not know of yet, this step verifies k + 1 positions, and its chain
        writes k - 1 past them)."""
        chained, running = previous.future.chained, self.scheduler.running
        if not self.config.optimizations.spec_async or not chained or self.scheduler.waiting or \
                any(seq.seq_id not in chained or seq.num_pending > 1 for seq in running):
            return False
        k = self.spec_config.num_speculative_tokens
        # previous emits up to k + 1 tokens the host does not know yet: this step's drafts are k only where neither
        # max_tokens nor max_model_len cuts them for any number previous accepts (near them, steps wait)
        if any(seq.num_known_tokens + 2 * k + 2 > self.max_model_len or (seq.params.max_tokens is not None and
               len(seq.output_token_ids) + 2 * k + 2 > seq.params.max_tokens) for seq in running):
            return False
        reach = [seq.num_computed_tokens + 3 * k for seq in running]
        bm = self.block_manager
        blocks = sum(max(0, bm.blocks_needed(n) - len(seq.block_table)) for seq, n in zip(running, reach))
        return (max(reach) <= self.max_model_len and blocks <= bm.num_free_blocks
                and len(running) * (k + 1) <= self.max_num_batched_tokens)

    def _failed_loads(self) -> list[Appended]:
        """P/D decodes whose KV pull failed (kv_load_failure_policy "fail"): the scheduler ended them with an error;
        their requests' outputs say so."""
        failed = []
        for seq in self.scheduler.take_failed_loads() if self.kv_connector is not None else ():
            if seq.request_id in self.requests:  # (not aborted meanwhile)
                self._finish(seq, FinishReason.ERROR, None)
                failed.append(Appended(seq, None, has_token=False))
        return failed

    def _take_finished(self) -> list[int]:
        """The sequences ended since the last step (the runner forgets what it keeps for them)."""
        finished, self._finished_ids = self._finished_ids, []
        return finished

    def _grammar_accepts(self, seq: Sequence, token: int) -> bool:
        """The grammar takes the token now - always with overlap_grammar off; with it on only EOS, which may end
        the format (and so the sequence, even under ignore_eos) before the next schedule. The other tokens wait for
        the catch-up after the next forward is launched (`launch`)."""
        if seq.grammar is None:
            return True
        if not self.overlap_grammar:
            return self.structured_output.accept(seq)
        if token == self.eos_token_id:
            self.structured_output.catch_up([seq])
            return not seq.grammar.failed
        return True

    def _take_side_outputs(self, sched: SchedulerOutput, output: StepOutput) -> None:
        """A step's prompt logprobs onto their sequences (before the next schedule, which reads how many there are),
        and the time its vision model took into the stats."""
        self.stats.encoder_seconds += output.encoder_seconds
        if not output.prompt_logprobs:
            return
        seqs = {s.seq.seq_id: s.seq for s in sched.scheduled}
        for seq_id, entries in output.prompt_logprobs.items():
            seqs[seq_id].prompt_logprobs.extend(self._logprob_dict(ranked) for _, ranked in entries)

    def _logprob_dict(self, ranked: list[tuple[int, float, int]]) -> dict[int, Logprob]:
        return {token: Logprob(logprob, rank, self._token_text(token)) for token, logprob, rank in ranked}

    def _finish_if(self, seq: Sequence, stop: Stop | None) -> None:
        if stop is not None:
            self._finish(seq, stop.reason, stop.stop_reason)

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None) -> None:
        seq.stop_reason = stop_reason
        seq.grammar = None
        self.scheduler.finish(seq, reason)
        self._finished_ids.append(seq.seq_id)
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
        self.stats.num_preemptions += len(sched.preempted)
        for seq in sched.admitted:  # (a P/D decode is admitted to wait for its KV: a schedule of no step)
            self.stats.prefix_cache_queries += seq.num_tokens
            self.stats.prefix_cache_hits += seq.num_cached_tokens
        if sched.is_empty:
            return
        self.stats.num_steps += 1
        if sched.encoder_inputs:
            self.stats.encoder_items += len(sched.encoder_inputs)
            self.stats.encoder_tokens += sum(e.feature.num_tokens for e in sched.encoder_inputs)
        if self.encoder_cache is not None:
            self.stats.encoder_cache_hits = self.encoder_cache.hits
        self.stats.num_computed_prefill_tokens += sum(s.num_new_tokens for s in sched.scheduled if not s.is_decode)
        for s in sched.scheduled:  # a prompt done: where its tokens' KV came from (vLLM's prompt_tokens_by_source)
            seq = s.seq
            if s.samples and seq.num_output_tokens == 0:
                self.stats.prompt_tokens_local_compute += seq.num_prompt_tokens - seq.num_cached_tokens
                self.stats.prompt_tokens_local_cache_hit += seq.num_cached_tokens - seq.num_external_tokens
                self.stats.prompt_tokens_external_kv_transfer += seq.num_external_tokens

    # -- observers (the walkthrough and tests watch the engine through these) -------------------------------
    def add_observer(self, fn: Callable[..., None]) -> None:
        """fn(event_name, **payload) is called on admit, chunk, preempt, finish, allocate, free, evict (with the
        block's hash), cache (a full block registered in the prefix cache), reset (the prefix cache cleared),
        prefix_hit, kv_load / kv_loaded (P/D: a decode starts waiting for its prompt's KV / it has arrived), step
        (a step launched) and outputs (a step's tokens appended, with each sequence's time since
        its previous token) events (on the thread that runs the engine)."""
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

    def check_features(self, token_ids: list[int], features: Any) -> list[MultiModalFeature]:
        """A prompt's images and videos (`mm_features`, as nanoserve/multimodal/features.py makes them), checked
        against the prompt and this engine: ValueError naming what is wrong."""
        if not features:
            return []
        vision = self.vision_config
        if vision is None:
            raise ValueError(f"this model ({self.config.model}) takes no images or videos: its checkpoint has no "
                             f"vision tower")
        if not isinstance(features, list) or not all(isinstance(f, MultiModalFeature) for f in features):
            raise ValueError("mm_features must be a list of MultiModalFeature (nanoserve.multimodal.features)")
        limits = self.config.limit_mm_per_prompt or {}
        for modality in ("image", "video"):
            count = sum(f.modality == modality for f in features)
            if count > limits.get(modality, DEFAULT_MM_LIMIT):
                raise ValueError(f"At most {limits.get(modality, DEFAULT_MM_LIMIT)} {modality}(s) may be provided "
                                 f"in one prompt (limit_mm_per_prompt), got {count}")
        placeholder = {"image": vision.image_token_id, "video": vision.video_token_id}
        end = 0
        for i, f in enumerate(features):
            if f.modality not in placeholder:
                raise ValueError(f"mm_features[{i}]: modality {f.modality!r} is not image or video")
            rows = sum(t * h * w for t, h, w in f.grid_thw)
            if not f.runs or f.num_tokens * vision.merge_unit != rows or len(f.pixel_values) != rows:
                raise ValueError(f"mm_features[{i}]: {f.num_tokens} placeholders for a grid of {rows} patches")
            for start, length in f.runs:
                if start < end or length < 1 or start + length > len(token_ids) or any(
                        t != placeholder[f.modality] for t in token_ids[start:start + length]):
                    raise ValueError(f"mm_features[{i}]: its placeholder run at {start} (+{length}) is not a run of "
                                     f"{f.modality} tokens ({placeholder[f.modality]}) of the prompt after the last")
                end = start + length
            if not self.encoder_cache.fits(f):
                raise ValueError(f"{f.modality} of {f.num_tokens} tokens is larger than the encoder cache "
                                 f"({self.encoder_cache.size} tokens, from max_num_batched_tokens)")
        if not self.config.optimizations.chunked_prefill and \
                sum(f.num_tokens for f in features) > self.encoder_cache.size:
            raise ValueError(f"the prompt's images and videos ({sum(f.num_tokens for f in features)} tokens) must be "
                             f"encoded in one step without chunked prefill, but the encoder takes "
                             f"{self.encoder_cache.size} per step")
        return list(features)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    kv_transfer_params: dict[str, Any] | None = None) -> None:
        """Queue a request (n sequences). `priority`: with the priority scheduling policy, lower runs sooner (any
        other value than 0 is a ValueError under first come, first served, as in vLLM). `kv_transfer_params`:
        prefill/decode disaggregation, vLLM's request-level protocol (kv_transfer/params.py; the engine needs a
        KV connector). Raises ValueError for a bad prompt or parameters."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError("priority: requests are scheduled first come, first served; start the engine with "
                             "--scheduling-policy priority to use it")
        params = params or SamplingParams()
        transfer = kv_params.parse(kv_transfer_params)
        if transfer is not None:
            params = self._kv_transfer_request(transfer, params)
        params.validate(self.config.max_logprobs, self.model_config.vocab_size)
        if params.bad_words:
            params.set_bad_words_token_ids(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids)
        features = self.check_features(token_ids, prompt.get("mm_features") if isinstance(prompt, dict) else None)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError("cache_salt: must be a non-empty string")
        # structured outputs: compiled here, in the caller's thread (a cache hit when the server compiled it)
        compiled = self.structured_output.compile(params.structured_outputs) if params.structured_outputs else None
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seqs = [Sequence(next(self._seq_ids), request_id, i, token_ids, params, arrival_time=arrival,
                         cache_salt=salt, priority=priority, kv_transfer=transfer,
                         mm_features=features) for i in range(params.n)]
        if compiled is not None:
            for seq in seqs:
                seq.grammar = self.structured_output.new_grammar(
                    compiled, params.structured_outputs.reasoning_end_token_id)
        self.requests[request_id] = RequestState(request_id, text, token_ids, params, seqs, arrival)
        for seq in seqs:
            self.scheduler.add(seq)
        self.stats.num_requests += 1
        self.stats.num_prompt_tokens += len(token_ids)

    def _kv_transfer_request(self, transfer: kv_params.RemoteDecode | kv_params.RemotePrefill,
                             params: SamplingParams) -> SamplingParams:
        """A request's kv_transfer_params against this engine: what it may ask for. A prefill for a remote decode
        runs with max_tokens 1 (its one token is dropped: the decode server computes the prompt's last token)."""
        cfg, role = self.kv_transfer, self.kv_transfer.kv_role
        if self.kv_connector is None:
            raise ValueError("kv_transfer_params: this server transfers no KV (start it with a kv_transfer_config "
                             "that names a connector)")
        if params.n != 1:
            raise ValueError(f"kv_transfer_params: only with n 1 (the blocks of one sequence move), got n {params.n}")
        if isinstance(transfer, kv_params.RemoteDecode):
            if not cfg.is_producer:
                raise ValueError(f"kv_transfer_params: do_remote_decode needs kv_role kv_producer or kv_both; this "
                                 f"server is {role}")
            return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        if not cfg.is_consumer:
            raise ValueError(f"kv_transfer_params: do_remote_prefill needs kv_role kv_consumer or kv_both; this "
                             f"server is {role}")
        if params.prompt_logprobs is not None:
            raise ValueError("kv_transfer_params: do_remote_prefill cannot give prompt_logprobs (the prompt's KV is "
                             "pulled, not computed here)")
        return params

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
                self._finished_ids.append(seq.seq_id)
            self.stats.num_aborted += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to run: in the queue, or (P/D decodes) for their prompt's KV to arrive."""
        return len(self.scheduler.waiting) + len(self.scheduler.loading)

    def kv_transfer_wait(self) -> float | None:
        """With a KV connector, when nothing can run and KV transfers are under way (pulls in flight, blocks kept
        for a decode server): how long a driving loop may wait before the next step, which polls them. None
        otherwise (step at once, or, with no request left, wait for one)."""
        kv, sched = self.kv_connector, self.scheduler
        if kv is None or not kv.busy or sched.running or sched.waiting or sched.failed_loads or \
                (self.overlapped is not None and self.overlapped.in_flight is not None):
            return None
        return kv.poll_s

    def shutdown(self) -> None:
        if self.overlapped is not None:  # drop the step in flight: its tensors live on the device
            self.overlapped.in_flight = None
        if self.kv_events is not None:
            self.kv_events.shutdown()
            self.kv_events = None
        if self.kv_connector is not None:  # (its agent holds the pools' memory registered)
            self.kv_connector.shutdown()
            self.kv_connector = None
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
    # where each finished prompt's KV came from (vLLM's vllm:prompt_tokens_by_source), counted when its first token
    # is sampled: computed here (its last token at least), found in the prefix cache, pulled from a prefill server
    prompt_tokens_local_compute: int = 0
    prompt_tokens_local_cache_hit: int = 0
    prompt_tokens_external_kv_transfer: int = 0
    # images and videos: items encoded, their feature rows (placeholder tokens), the time the vision model took,
    # and items a sequence found in the encoder cache instead
    encoder_items: int = 0
    encoder_tokens: int = 0
    encoder_seconds: float = 0.0
    encoder_cache_hits: int = 0

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


