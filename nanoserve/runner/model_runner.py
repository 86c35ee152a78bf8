"""Runs the model for one scheduled step: a StepInput -> tensors -> forward -> logits -> tokens.

The runner owns the model and its KV cache on one device (one tensor-parallel rank). It knows nothing of
scheduling: the engine hands it a `StepInput` (nanoserve/step.py: plain lists), and gets back the token ids each
sequence emitted - sampled, verified and drafted here (runner/sample_step.py), not in the engine. A step is two
calls, as in vLLM's model runner: `execute_model` queues the forward (every tensor-parallel rank runs `execute` on
the step's `ModelInput`), then `sample_tokens` - given the structured-output masks the engine filled meanwhile -
queues the sampling on rank 0 and returns a PendingStep whose `result()` is the step's StepOutput.
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Callable

import torch

from nanoserve.batch import AttentionMetadata, TokenFeed, VerifyFeed
from nanoserve.config import DEFAULT_CPU_KV_TOKENS, EngineConfig, Platform
from nanoserve.kernels import check_tuned_files, triton_usable
from nanoserve.kernels.moe_wgmma import hopper_gluon
from nanoserve.model.loader import load_vision_model
from nanoserve.model.m3_config import M3Config
from nanoserve.model.memory_plan import DeviceMemory, engine_kv_pool_bytes
from nanoserve.model.vision.config import VisionConfig
from nanoserve.multimodal.processor import MultiModalProcessor
from nanoserve.presets.resolve import load_model_or_preset, random_vision_model
from nanoserve.runner import cuda_graphs
from nanoserve.runner.input_prep import InputPreparer, apply_token_feed, reference_prepare
from nanoserve.runner.kv_cache import (
    allocate_kv_caches,
    kv_block_size,
    kv_cache_bytes_per_block,
    kv_cache_torch_dtype,
)
from nanoserve.runner.multimodal import EncoderRunner, EncoderTiming
from nanoserve.runner.sample_step import PendingStep, StepSampler
from nanoserve.spec_decode.config import SpeculativeConfig
from nanoserve.spec_decode.draft_chain import DraftChain
from nanoserve.spec_decode.draft_input import DraftInput
from nanoserve.spec_decode.drafter import DraftGraphs, DraftRunner
from nanoserve.spec_decode.multi_step import MultiStep
from nanoserve.spec_decode.proposer import Proposer
from nanoserve.step import GrammarMasks, ModelInput, StepInput

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA/HIP device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def platform_of(device: torch.device, dtype: torch.dtype, mxfp8: bool, speculative: str | None = None,
                tensor_parallel_size: int = 1) -> Platform:
    """The Platform a model on `device` in `dtype` runs on (which switches can act there: Optimizations
    .not_applicable), the device questions answered by the kernels' own checks."""
    gluon = device.type == "cuda" and hopper_gluon(torch.empty(0, dtype=dtype, device=device))
    return Platform(device=device.type, triton=triton_usable(device), hopper_gluon=gluon, mxfp8=mxfp8,
                    speculative=speculative, tensor_parallel_size=tensor_parallel_size)


class ModelRunner:
    """The model, its KV pools, and the step-to-tensors conversion, on one device."""

    def __init__(self, config: EngineConfig, device: torch.device | None = None):
        self.config = config
        self.device = device or resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        """The target model's KV and index-key pools' element type (a drafter's pool stays in the model dtype)."""
        if self.device.type == "cuda":
            if self.device.index is None:  # "cuda" means the current device; set_device needs an index
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            # what the process holds before this engine's weights (other engines; tensors of one shut down are
            # collected first): the KV pool's share counts this engine's memory only (determine_num_blocks)
            gc.collect()
            self._memory_baseline = torch.cuda.memory_allocated(self.device)
        torch.manual_seed(config.seed)
        check_tuned_files()  # a bad $NANOSERVE_*_TUNED_CONFIG stops the start, before the weights load
        self.model, self.model_dir = load_model_or_preset(config.model, config.optimizations, self.dtype,
                                                          self.device, config.quantization)
        self.model.eval()
        logger.info("weights: %s", self.model.weight_summary())
        self.cfg: M3Config = self.model.cfg
        self.encoder = self._load_vision()
        """The vision model and the features it encoded (runner/multimodal.py); None for a text-only checkpoint."""
        self.encoder_cache_size = 0  # feature rows the encoder cache holds (set with the KV pool's limits)
        self._encoder_timing: EncoderTiming | None = None  # the step's encoding, until sample_tokens reports it
        self.block_size = kv_block_size(self.cfg, config.block_size)
        self.num_blocks = 0
        self.inputs = InputPreparer(self.block_size, self.device)
        # decode graphs (runner/cuda_graphs.py): sized by the limits determine_num_blocks was given, rebuilt when
        # the KV pool or a model-side switch changes. graph_capture: a test seam (None = real CUDA graphs).
        self.max_model_len: int | None = None
        self.max_num_seqs: int | None = None
        self.graphs: cuda_graphs.GraphRunner | None = None
        self.draft_graphs: DraftGraphs | None = None
        self.chain: DraftChain | None = None  # switch spec_draft_chain: the MTP drafts made after a verify graph
        self.multi: MultiStep | None = None  # switch spec_multi_step: several verify steps and chains per launch
        self._multi_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        """The last step, when it ran several speculative steps in one launch: their ids, argmax and last drafts."""
        self._last_verify: tuple[cuda_graphs.GraphRunner, int, int, int] | None = None
        """The last step, when it replayed a verify graph: (its graphs, sequences, query length, longest context)."""
        self.graph_capture: cuda_graphs.CaptureFn | None = None
        self._graph_switches: tuple[bool, ...] | None = None
        self._graph_notice: str | None = None
        self.last_argmax: torch.Tensor | None = None
        """The argmax of the last step's logits when its decode graph computed it (switch captured_argmax): a view
        of the graph's static tokens, valid until the next step."""
        self.drafter = DraftRunner.build(config, self.model, self.model_dir, self.dtype, self.device,
                                         self.block_size)
        """Speculative decoding's model-based drafter (MTP, EAGLE-3; spec_decode/drafter.py), or None."""
        self.platform = platform_of(self.device, self.dtype,
                                    self.model.weight_format == "mxfp8" or config.quantization == "mxfp8",
                                    (config.speculative_config or {}).get("method"), config.tensor_parallel_size)
        """Which switches can act here (Optimizations.not_applicable): the engine's ready line names the others."""
        self.sampling = StepSampler(config, self.device, self.cfg.eos_token_id)
        """Rank 0's second half of a step: logits -> tokens (runner/sample_step.py)."""
        self._step: StepInput | None = None  # the step execute_model ran, until sample_tokens takes its logits
        self.fed_ids: torch.Tensor | None = None  # a verify step's queries taken on the device (VerifyFeed)
        self.logits: torch.Tensor | None = None
        """The logits of the step execute_model ran, until sample_tokens takes them (the parity tests read them)."""

    def _load_vision(self) -> EncoderRunner | None:
        """The checkpoint's vision tower, projector and merger, replicated on this rank (model/loader.py
        load_vision_model), or None when it has none."""
        if not os.path.isfile(os.path.join(self.model_dir, "config.json")):
            # a preset drawn on the device (its directory holds only the tokenizer): its vision path drawn too
            vision = random_vision_model(self.config.model, self.config.optimizations, self.dtype, self.device)
        else:
            vision = load_vision_model(self.model_dir, self.config.optimizations, self.dtype, self.device)
        if vision is None:
            return None
        vision.eval()
        image = MultiModalProcessor.from_model_dir(self.model_dir).image_config
        return EncoderRunner(vision, self.device, image.max_pixels // image.factor ** 2)

    @property
    def vision_config(self) -> VisionConfig | None:
        return self.encoder.vision.cfg if self.encoder is not None else None

    # -- KV cache -----------------------------------------------------------------------------------------
    def determine_num_blocks(self, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """How many KV blocks fit: fixed by num_gpu_blocks_override, a token budget on the CPU, or on a GPU the
        memory left under gpu_memory_utilization after the weights and a worst-case warm-up step."""
        cfg = self.config
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.encoder_cache_size = self.encoder.cache_size(max_num_batched_tokens) if self.encoder else 0
        self.sampling.proposer = self._proposer()
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        if self.device.type != "cuda":
            tokens = cfg.kv_cache_tokens or max(DEFAULT_CPU_KV_TOKENS, max_model_len)
            return -(-tokens // self.block_size)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warmup(min(max_num_batched_tokens, max_model_len), max_num_seqs)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = engine_kv_pool_bytes(DeviceMemory(
            total=total, free=free, baseline=self._memory_baseline, held=torch.cuda.memory_allocated(self.device),
            peak=peak, reserved=torch.cuda.memory_reserved(self.device)), cfg.gpu_memory_utilization)
        per_block = kv_cache_bytes_per_block(self.cfg, self.block_size, self.kv_dtype) + \
            (self.drafter.bytes_per_block() if self.drafter else 0)
        blocks = int(budget // per_block)
        logger.info("KV cache: %.2f GiB for %d blocks of %d tokens (peak step memory %.2f GiB)",
                    blocks * per_block / 2**30, blocks, self.block_size, peak / 2**30)
        if blocks < 1:
            raise RuntimeError(f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} GiB); raise "
                               f"--gpu-memory-utilization or lower --max-num-batched-tokens")
        return blocks

    def _warmup(self, num_tokens: int, max_num_seqs: int) -> None:
        """One worst-case prefill through a temporary cache, to measure peak activation memory (with images: after
        a worst-case encoder step, whose output stands for a full encoder cache meanwhile)."""
        full_encoder_cache = self.encoder.profile(self.encoder_cache_size) if self.encoder is not None else None
        blocks = -(-num_tokens // self.block_size) + 1
        self.allocate_kv_cache(blocks)
        table = list(range(1, blocks))
        ids = [i % self.cfg.vocab_size for i in range(num_tokens)]
        self.execute(ModelInput(ids, [num_tokens], [num_tokens], [table], [0]))
        # the logits of the largest sampled step: one row per sequence, k + 1 with verify graphs (their static
        # logits buffer is that size), so the pool leaves room for them
        rows = max_num_seqs * self._verify_len()
        logits_rows = torch.zeros(rows, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        self.model.compute_logits(logits_rows)
        del full_encoder_cache
        self.allocate_kv_cache(0)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.graphs = self.draft_graphs = self.chain = None  # captured against the old pools
        self.kv_caches, self.index_caches = [], []
        self.model.bind_kv_caches([None] * self.cfg.num_hidden_layers, [None] * self.cfg.num_hidden_layers)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.drafter is not None:
            self.drafter.allocate(0)
        if num_blocks:
            self.kv_caches, self.index_caches = allocate_kv_caches(self.cfg, num_blocks, self.block_size,
                                                                   self.kv_dtype, self.device)
            self.model.bind_kv_caches(self.kv_caches, self.index_caches)
            if self.drafter is not None:
                self.drafter.allocate(num_blocks)

    def kv_pools(self) -> list[torch.Tensor]:
        """Every pool of the target model, block dimension first, in layer order: per layer its K/V pool, then on
        MSA layers its index-key pool; then the drafter's (MTP, EAGLE-3). One block id names the same block in all
        of them (what a KV transfer moves: kv_transfer/transfer.py)."""
        target = [pool for kv, index in zip(self.kv_caches, self.index_caches)
                  for pool in ((kv,) if index is None else (kv, index))]
        return target + (self.drafter.kv_pools() if self.drafter is not None else [])

    # -- one step -----------------------------------------------------------------------------------------
    def prepare(self, inp: ModelInput) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """input_ids, AttentionMetadata and the rows whose logits are wanted, for an eager step."""
        if self.config.optimizations.fast_input_prep:
            return self.inputs.prepare(inp.input_ids, inp.query_lens, inp.seq_lens, inp.block_tables,
                                       inp.sample_rows, inp.prompt_rows)
        return reference_prepare(inp, self.block_size, self.device)

    def execute_model(self, step: StepInput) -> None:
        """Queue a step's forward (rank 0; the other ranks run `execute` on step.model). `sample_tokens` follows."""
        self._step, self.fed_ids, self._multi_out = step, None, None
        verify_feed = self._verify_feed(step)
        if step.spec_steps > 1:  # (else, or where no multi-step graph fits: one step)
            self._multi_out = self._multi_step(step, verify_feed)
            if self._multi_out is not None:
                return
        self.logits = self.execute(step.model, self.sampling.feed(step), verify_feed,
                                   on_host=lambda: self._resolve_on_host(step, verify_feed))

    def _multi_step(self, step: StepInput, feed: VerifyFeed | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Run step.spec_steps speculative steps in one launch (spec_decode/multi_step.py), or None where it does
        not apply here: no draft chain, a batch that no verify graph takes, or no graph fits."""
        opts = self.config.optimizations
        if step.model.encoder_inputs or step.model.encoder_frees:  # (the encoder's work runs in one step's path)
            return None
        graphs, q = self._step_graphs(step.model)
        if (graphs is None or q < 2 or not opts.spec_multi_step or not opts.spec_greedy_accept
                or not self.sampling.chains(step) or self.draft_pass_graphs() is None):
            return None
        chain = self._chain(graphs)
        if self.multi is None or self.multi.chain is not chain or self.multi.steps != step.spec_steps:
            self.multi = MultiStep(chain, step.spec_steps)
        inp = step.model
        out = self.multi.run(inp.input_ids, inp.seq_lens, inp.block_tables, q, feed)
        if out is not None and self.drafter is not None:  # (what a proposer would read: the last step's rows)
            self.drafter.last = graphs.kept[: len(inp.input_ids)]
        return out

    def _verify_feed(self, step: StepInput) -> VerifyFeed | None:
        """The queries a step launched ahead of the previous one's tokens takes from that step's draft chain (every
        sequence of such a step is one: the engine launches it only then), or None."""
        if not any(s.on_device for s in step.seqs):
            return None
        rows = self.sampling.chained_rows
        if self.chain is None or not all(s.on_device and s.seq_id in rows for s in step.seqs):
            raise RuntimeError("a step launched ahead of the previous one's tokens has sequences whose queries no "
                               "draft chain left on the device")
        return VerifyFeed([rows[s.seq_id] for s in step.seqs], self.chain.next_ids, self.chain.next_pos)

    @staticmethod
    def _resolve_on_host(step: StepInput, feed: VerifyFeed) -> None:
        """A step with fed queries that no graph replays: read them back (one wait for the device) into the host's
        lists, which the eager path and the host-side verification read."""
        ids, pos = feed.ids.tolist(), feed.pos.tolist()
        offset = 0
        for i, (s, row) in enumerate(zip(step.seqs, feed.rows)):
            q = s.query_len
            step.model.input_ids[offset: offset + q] = ids[row][:q]
            step.model.seq_lens[i] = pos[row] + q
            s.start, s.draft = pos[row], ids[row][1:q]
            offset += q

    def sample_tokens(self, masks: GrammarMasks | None = None) -> PendingStep:
        """Queue the tokens of the step `execute_model` ran (its structured-output masks: `masks`); returns at once
        on a GPU. PendingStep.result() waits for them."""
        step, logits, multi = self._step, self.logits, self._multi_out
        self._step = self.logits = self._multi_out = None
        if multi is not None:
            pending = self.sampling.sample_steps(step, *multi)
        else:
            pending = self.sampling.sample(logits, step, masks or GrammarMasks(), self.last_argmax,
                                           self.draft_chain, self.fed_ids)
        pending.encoder, self._encoder_timing = self._encoder_timing, None
        return pending

    def _proposer(self) -> Proposer | None:
        """The drafter of speculative decoding, or None (no speculative_config, or the switch off)."""
        spec = self.config.speculative_config
        if spec is None or not self.config.optimizations.speculative_decoding:
            return None
        # (looked up at each call: the tests and the step-cost bench wrap the runner's method)
        by_model = (lambda inp: self.propose_drafts(inp)) if self.drafter is not None else None
        return Proposer(SpeculativeConfig.from_dict(spec), self.max_model_len, by_model)

    @torch.inference_mode()
    def execute(self, inp: ModelInput, feed: TokenFeed | None = None, verify_feed: VerifyFeed | None = None,
                on_host: Callable[[], None] | None = None) -> torch.Tensor:
        """Run one step; returns fp32 logits [len(sample_rows) + len(prompt_rows), vocab]: the sample rows', then
        the prompt rows' (every rank computes them). The LM head runs on those rows only. `feed`: input ids to take
        from the previous step's sampled tokens on the device (async scheduling); `verify_feed`: a verify step's
        queries from the previous step's draft chain, which only a graph replay takes on the device - else
        `on_host()` first reads them into `inp`."""
        self.last_argmax = None
        self._last_verify = None
        if self.encoder is not None:  # drop what the engine evicted, encode this step's images and videos
            self._encoder_timing = self.encoder.run(inp)
        graphs, q = self._step_graphs(inp)
        greedy = self.config.optimizations.spec_greedy_accept  # (the rejection sampler reads the drafts' values)
        if graphs is not None and (verify_feed is None or greedy):
            logits = graphs.run(inp.input_ids, inp.seq_lens, inp.block_tables, feed, q, verify_feed)
            if logits is not None:
                if verify_feed is not None:  # what the step verified: the host holds placeholders
                    self.fed_ids = graphs.i64[0, : len(inp.input_ids)]
                if graphs.captured_argmax and q == 1:
                    self.last_argmax = graphs.tokens[: len(inp.seq_lens)]
                if q > 1:
                    self._last_verify = (graphs, len(inp.seq_lens), q, max(inp.seq_lens))
                if self.drafter is not None:  # what the captured forward kept for it: every token's row
                    self.drafter.last = graphs.kept[: len(inp.input_ids)]
                return logits
        if verify_feed is not None:
            on_host()
        input_ids, meta, logits_index = self.prepare(inp)
        apply_token_feed(input_ids, feed)
        embeds = self.encoder.embed(self.model.embed_tokens, input_ids, inp) if self.encoder is not None else None
        hidden = self.model(input_ids, meta.positions, meta, embeds)
        if self.drafter is not None:
            self.drafter.observe(hidden)
        return self.model.compute_logits(hidden[logits_index])

    def propose_drafts(self, inp: DraftInput) -> list[list[int]]:
        """Speculative decoding: the model-based drafter's tokens per sequence (spec_decode/drafter.py)."""
        assert self.drafter is not None, "no model-based drafter was loaded"
        return self.drafter.propose(inp, self.prepare, self.draft_pass_graphs())

    def draft_chain(self) -> torch.Tensor | None:
        """Right after a verify step replayed as a graph (switch spec_draft_chain, a draft model): the next
        step's drafts [n, k] of its sequences, made on the device from the greedy acceptance of its argmax
        (spec_decode/draft_chain.py); None where the last step was no such replay or no chain graph fits."""
        last, self._last_verify = self._last_verify, None
        if last is None or not self.config.optimizations.spec_draft_chain or self.draft_pass_graphs() is None:
            return None
        graphs, n, q, max_seq_len = last
        return self._chain(graphs).run(n, q, max_seq_len)

    def _chain(self, graphs: cuda_graphs.GraphRunner) -> DraftChain:
        """The draft chain over these graphs (rebuilt with them, or with another drafter)."""
        if self.chain is None or self.chain.target is not graphs or self.chain.draft is not self.drafter:
            self.chain = DraftChain(self.drafter, graphs)
        return self.chain

    def draft_pass_graphs(self, drafter: DraftRunner | None = None) -> DraftGraphs | None:
        """With spec_cuda_graphs and the target's graphs in use: the drafter's passes as graphs (rebuilt with the
        target's graphs; EAGLE-3's only with triton_attention on, as the target's dense layers). `drafter`: the
        runner's own by default (the step-cost bench passes one of its own)."""
        drafter = drafter or self.drafter
        opts = self.config.optimizations
        if not opts.spec_cuda_graphs or drafter is None:
            return None
        if drafter.method == "eagle3" and not opts.triton_attention and self.graph_capture is None:
            return None  # its reference attention loops over the sequences on the host
        graphs = self._graphs()
        if graphs is None:
            return None
        current = self.draft_graphs
        if current is None or current.target is not graphs or current.draft is not drafter:
            self.draft_graphs = DraftGraphs(drafter, graphs)
        return self.draft_graphs

    def _step_graphs(self, inp: ModelInput) -> tuple[cuda_graphs.GraphRunner | None, int]:
        """The graphs and the query length q if this step can replay one: a decode-only batch (every sequence one
        new token, all sampled; q = 1), or with `spec_cuda_graphs` a verify step (every sequence q > 1 tokens,
        the logits of every token wanted, in order); graphs on and applicable, the batch within the captured
        sizes."""
        n = len(inp.query_lens)
        if not n or inp.placements:
            return None, 1
        q = inp.query_lens[0]
        if len(inp.input_ids) != n * q or any(x != q for x in inp.query_lens):
            return None, q
        if q == 1:
            if len(inp.sample_rows) != n or inp.prompt_rows:
                return None, q
        elif inp.sample_rows or inp.prompt_rows != list(range(n * q)):
            return None, q
        graphs = self._graphs()
        if graphs is None or not graphs.fits(n, max(inp.seq_lens), max(len(t) for t in inp.block_tables), q):
            return None, q
        return graphs, q

    def _verify_len(self) -> int:
        """The longest verify query a graph takes: k + 1 with `spec_cuda_graphs` and a speculative_config in use,
        else 1 (decode graphs only)."""
        opts, spec = self.config.optimizations, self.config.speculative_config
        if not opts.spec_cuda_graphs or not opts.speculative_decoding or spec is None:
            return 1
        return 1 + SpeculativeConfig.from_dict(spec).num_speculative_tokens

    def _graphs(self) -> cuda_graphs.GraphRunner | None:
        """The GraphRunner for the current pool and switches (rebuilt if a model-side switch or spec_cuda_graphs
        changed), or None when graphs are off or not applicable (the reason is logged once)."""
        opts = self.config.optimizations
        if not opts.cuda_graphs or not self.num_blocks or self.max_model_len is None:
            return None
        if self.drafter is not None and not opts.spec_cuda_graphs:
            # the eager forward hands the drafter its hidden states; without spec_cuda_graphs no graph keeps them
            if self._graph_notice != "drafter":
                logger.info("CUDA graphs not used: the %s drafter reads every step's hidden states (switch "
                            "spec_cuda_graphs keeps them in graphs)", self.drafter.method)
                self._graph_notice = "drafter"
            return None
        state = cuda_graphs.switch_state(opts) + (opts.spec_cuda_graphs, opts.spec_feed_in_graph)
        if self.graphs is None or state != self._graph_switches:
            self.graphs = None
            reason = None if self.graph_capture is not None else \
                cuda_graphs.unsupported_reason(self.model, opts, self.device)
            if reason is not None:
                if reason != self._graph_notice:
                    logger.info("CUDA graphs not applicable, decode runs eagerly: %s", reason)
                    self._graph_notice = reason
                return None
            drafter = self.drafter
            self.graphs = cuda_graphs.GraphRunner(
                self.model, self.max_num_seqs, self.max_model_len, self.block_size, self.device, self.graph_capture,
                captured_argmax=opts.captured_argmax, max_query_len=self._verify_len(),
                keep=drafter.read if drafter is not None else None, keep_width=drafter.width if drafter else 0,
                keep_dtype=self.dtype, feed_in_graph=opts.spec_feed_in_graph)
            self._graph_switches = state
        return self.graphs

    @property
    def num_decode_graphs(self) -> int:
        """Decode graphs captured over the current pool."""
        return len(self.graphs.graphs) if self.graphs is not None else 0

    @property
    def num_graphs(self) -> int:
        """Every graph captured over the current pool: decode, verify, draft-pass, draft-chain and multi-step
        graphs (engine/warmup.py reports how many it captured)."""
        chain = (len(self.chain.graphs) if self.chain is not None else 0) + \
            (len(self.multi.graphs) if self.multi is not None else 0)
        return chain + sum(len(g.graphs) + len(g.verify_graphs) for g in (self.graphs, self.draft_graphs)
                           if g is not None)

    @torch.inference_mode()
    def capture_decode_graphs(self, max_seq_len: int, max_batch: int) -> int:
        """Capture ahead of time the decode graphs of every batch bucket up to max_batch at the context bucket of
        max_seq_len (otherwise each is captured the first time a step needs it). Returns how many were captured."""
        graphs = self._graphs()
        if graphs is None:
            return 0
        return graphs.capture_all(min(max_seq_len, self.max_model_len), max_batch)

    def shutdown(self) -> None:
        """Free the graphs, the KV pools and the weights. Idempotent: an engine's finalizer may call it again."""
        if not hasattr(self, "model"):
            return
        self.graphs = self.draft_graphs = self.chain = None
        self.allocate_kv_cache(0)
        self.encoder = None
        del self.model
