"""The model-based drafters of speculative decoding on this rank: M3's own MTP module (method "mtp") and an EAGLE-3
draft model (method "eagle3"), with what they read of each target step and their K/V pools.

    DraftRunner.build(...)   the drafter that speculative_config names (None for ngram, or none at all)
    observe(hidden)          after every eager target forward: keep what the drafter reads (the final hidden
                             states for MTP; for EAGLE-3 the residual stream entering each tap layer, caught by
                             forward pre-hooks - or leaving the last layer). Under CUDA graphs the captured forward
                             runs `read` into a static buffer instead, and `last` is set to a view of it.
    propose(DraftInput)      its K/V over the positions the last step made final, then greedy drafts
    DraftGraphs              with switch spec_cuda_graphs, the drafter's passes (MTP or EAGLE-3: the first where
                             it fits, every one-token pass after it) replayed as CUDA graphs

Both drafters work alike: at position t the draft layer reads (the target's state at t, the token x_{t+1}) and
its output's logits give x_{t+2}; each further draft feeds the layer its own output and the token it drafted,
one position further. Their K/V live in pools of their own under the sequences' block tables.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from nanoserve.batch import AttentionMetadata
from nanoserve.config import EngineConfig
from nanoserve.model.m3 import M3ForCausalLM
from nanoserve.parallel_state import get_tp
from nanoserve.runner.cuda_graphs import GraphRunner
from nanoserve.spec_decode.config import SpeculativeConfig
from nanoserve.spec_decode.draft_input import DraftInput
from nanoserve.spec_decode.eagle3 import Eagle3Drafter, load_eagle3
from nanoserve.spec_decode.mtp import M3MTP, has_mtp, load_mtp
from nanoserve.step import ModelInput

logger = logging.getLogger(__name__)

Prepare = Callable[[ModelInput], tuple[torch.Tensor, AttentionMetadata, torch.Tensor]]


class DraftRunner:
    """One drafter, its taps on the target and its K/V pool (see the module docstring)."""

    def __init__(self, method: str, drafter: M3MTP | Eagle3Drafter, model: M3ForCausalLM, dtype: torch.dtype,
                 device: torch.device, block_size: int):
        self.method, self.drafter, self.model = method, drafter, model
        self.dtype, self.device, self.block_size = dtype, device, block_size
        self.last: torch.Tensor | None = None  # what the drafter reads of the last step, every token's row
        self._taps: dict[int, torch.Tensor] = {}
        if isinstance(drafter, Eagle3Drafter):
            for layer in drafter.cfg.aux_layer_ids:
                if layer < len(model.layers):
                    model.layers[layer].register_forward_pre_hook(self._tap(layer))
                else:  # the stream after the last layer, before the final norm
                    model.layers[-1].register_forward_hook(self._tap_output(layer))

    @classmethod
    def build(cls, config: EngineConfig, model: M3ForCausalLM, model_dir: str, dtype: torch.dtype,
              device: torch.device, block_size: int) -> "DraftRunner | None":
        if config.speculative_config is None or not config.optimizations.speculative_decoding:
            return None
        spec = SpeculativeConfig.from_dict(config.speculative_config)
        if spec.method not in ("mtp", "eagle3"):
            return None
        if get_tp().size > 1:
            raise ValueError(f"speculative_config method {spec.method!r} runs with tensor_parallel_size 1 only")
        if spec.method == "mtp":
            if not has_mtp(model_dir):
                raise ValueError(f"speculative_config method 'mtp': the checkpoint in {model_dir} has no MTP "
                                 f"module (language_model.model.mtp.layers.0.* tensors)")
            drafter: M3MTP | Eagle3Drafter = M3MTP(model.cfg, config.optimizations, dtype, device)
            count = load_mtp(drafter, model_dir)
            logger.info("MTP drafter: %d tensors from %s", count, model_dir)
        else:
            drafter = load_eagle3(spec.model, model, config.optimizations, dtype, device)
            logger.info("EAGLE-3 drafter from %s: taps on layers %s, draft vocabulary %d", spec.model,
                        drafter.cfg.aux_layer_ids, drafter.cfg.draft_vocab_size)
        return cls(spec.method, drafter.eval(), model, dtype, device, block_size)

    # -- the K/V pool ------------------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        if isinstance(self.drafter, Eagle3Drafter):
            c = self.drafter.cfg
            return 2 * self.block_size * c.num_key_value_heads * c.head_dim * item
        c = self.model.cfg
        return self.block_size * (2 * c.num_key_value_heads * c.head_dim + c.index_head_dim) * item

    def allocate(self, num_blocks: int) -> None:
        """Pools of `num_blocks` blocks (0: none), under the same block ids as the target's."""
        self.last = None
        if isinstance(self.drafter, Eagle3Drafter):
            c = self.drafter.cfg
            kv = torch.zeros(num_blocks, 2, self.block_size, c.num_key_value_heads, c.head_dim, dtype=self.dtype,
                             device=self.device) if num_blocks else None
            self.drafter.bind_kv_cache(kv)
            return
        c = self.model.cfg
        if not num_blocks:
            self.drafter.bind_kv_cache(None, None)
            return
        self.drafter.bind_kv_cache(
            torch.zeros(num_blocks, 2, self.block_size, c.num_key_value_heads, c.head_dim, dtype=self.dtype,
                        device=self.device),
            torch.zeros(num_blocks, self.block_size, c.index_head_dim, dtype=self.dtype, device=self.device))

    def kv_pools(self) -> list[torch.Tensor]:
        """The drafter's pools, block dimension first (MTP: its K/V and index-key pools; EAGLE-3: its K/V pool),
        under the target's block ids: a KV transfer moves them with the target's."""
        if isinstance(self.drafter, Eagle3Drafter):
            pools = [self.drafter.kv_cache]
        else:
            attn = self.drafter.block.self_attn
            pools = [attn.kv_cache, attn.index_cache]
        return [p for p in pools if p is not None]

    # -- what it reads of the target ---------------------------------------------------------------------------
    def _tap(self, layer: int):
        def hook(module, args):
            x, residual = args[0], args[1]
            self._taps[layer] = x if residual is None else x + residual  # the stream entering the layer
        return hook

    def _tap_output(self, key: int):
        def hook(module, args, output):
            out, residual = output[0], output[1]
            self._taps[key] = out + residual
        return hook

    @property
    def width(self) -> int:
        """The width of what `read` returns per token."""
        if isinstance(self.drafter, Eagle3Drafter):
            return self.model.cfg.hidden_size * len(self.drafter.cfg.aux_layer_ids)
        return self.model.cfg.hidden_size

    def read(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the drafter reads of the target forward that just ran (hidden: its final hidden states [T, H]):
        those states (MTP) or the taps, side by side [T, width] (EAGLE-3). Runs inside a captured graph too."""
        if isinstance(self.drafter, Eagle3Drafter):
            return torch.cat([self._taps.pop(i) for i in self.drafter.cfg.aux_layer_ids], dim=-1)
        return hidden

    def observe(self, hidden: torch.Tensor) -> None:
        """After an eager target forward: keep what the drafter reads of it (`read`)."""
        self.last = self.read(hidden)

    # -- drafting ----------------------------------------------------------------------------------------------
    def _step(self, ids: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the draft layer: (final-normed output, the next pass's hidden input)."""
        if isinstance(self.drafter, Eagle3Drafter):
            return self.drafter.step(self.model, ids, hidden, meta.positions, meta)
        out = self.drafter(self.model, ids, hidden, meta.positions, meta)
        return out, out

    def _tokens(self, normed: torch.Tensor) -> torch.Tensor:
        if isinstance(self.drafter, Eagle3Drafter):
            return self.drafter.draft_tokens(self.model, normed)
        return self.model.compute_logits(normed).argmax(dim=-1)

    @torch.inference_mode()
    def propose(self, inp: DraftInput, prepare: Prepare, graphs: "DraftGraphs | None" = None) -> list[list[int]]:
        """The drafter's K/V over the positions the last step finished, then greedy drafts (see DraftInput):
        step 1 from its output at each sequence's last such position, step j from its own output of step j - 1
        and the token drafted there, one position further. `prepare`: the runner's step-input preparation;
        `graphs`: the passes replay these where they fit - the first where every sequence drafts and has the same
        number of final positions (at most k + 1), each later one-token pass always."""
        assert self.last is not None, "no target step to draft from"
        rows = self.last[torch.tensor(inp.rows, dtype=torch.int64, device=self.device)]
        hidden = self.drafter.combine(rows) if isinstance(self.drafter, Eagle3Drafter) else rows
        active = [s for s, n in enumerate(inp.num_drafts) if n > 0]
        drafts: list[list[int]] = [[] for _ in inp.seq_lens]
        q = inp.query_lens[0] if inp.query_lens else 0
        # the first pass replays a graph only where every sequence drafts from the same number of positions
        uniform = bool(active) and len(active) == len(inp.seq_lens) and inp.query_lens == [q] * len(active)
        replayed = graphs.run_pass(inp.next_ids, hidden, inp.seq_lens, inp.block_tables, q) \
            if graphs is not None and uniform else None
        if replayed is not None:
            tokens, carry = replayed
        else:
            # the rows' next tokens as input ids, each drafting sequence's last row as its logits row
            next_ids, meta, last_rows = prepare(ModelInput(inp.next_ids, inp.query_lens, inp.seq_lens,
                                                           inp.block_tables, active))
            out, carry = self._step(next_ids, hidden, meta)
            if not active:
                return drafts
            carry = carry[last_rows]
            tokens = self._tokens(out[last_rows])
        # every pass is queued before any token is read back: one host-device synchronisation per call, at the end
        passes: list[tuple[list[int], torch.Tensor]] = []
        for j in range(max(inp.num_drafts)):
            # a graph's outputs are static buffers that its next replay overwrites
            passes.append((active, tokens.clone() if replayed is not None else tokens))
            keep = [i for i, s in enumerate(active) if inp.num_drafts[s] > j + 1]
            if not keep:
                break
            if len(keep) < len(active):  # (while every sequence still drafts, no gather is launched)
                idx = torch.tensor(keep, dtype=torch.int64, device=self.device)
                tokens, carry = tokens[idx], carry[idx]
            active = [active[i] for i in keep]
            lens = [inp.seq_lens[s] + j + 1 for s in active]
            tables = [inp.block_tables[s] for s in active]
            replayed = graphs.run_pass(tokens, carry, lens, tables) if graphs is not None else None
            if replayed is not None:
                tokens, carry = replayed
                continue
            _, meta, _ = prepare(ModelInput([0] * len(active), [1] * len(active), lens, tables, []))
            out, carry = self._step(tokens, carry, meta)
            tokens = self._tokens(out)
        if passes:
            flat = torch.cat([t for _, t in passes]).tolist()
            for seqs, _ in passes:
                for s, t in zip(seqs, flat):
                    drafts[s].append(t)
                flat = flat[len(seqs):]
        return drafts


class DraftGraphs(GraphRunner):
    """The draft model's passes as CUDA graphs (switch spec_cuda_graphs), for the MTP module and for an EAGLE-3
    layer alike. Every draft after the first is a decode-like pass - each drafting sequence one token at position
    seq_len - 1 - of the draft layer and its head's argmax, keyed like a decode graph by (batch bucket, context
    bucket). The first pass reads the q positions the last step made final: where every sequence drafts and q is
    the same for all (q <= k + 1: after a decode or a verify step, not a prompt chunk) it replays a graph keyed
    like a verify graph by (batch bucket, context bucket, q), which takes each sequence's last row; otherwise it
    runs eagerly. Static inputs: the step staging plus the hidden input rows (EAGLE-3's first pass: its combined
    taps, computed before the replay); outputs: the drafted tokens and the next pass's hidden input. Padding rows
    write no K/V (slot -1; EAGLE-3's layer rewrites its first row's slot instead, `reference.write_kv_padded`)."""

    runs_eagerly = "draft passes"
    verify_runs_eagerly = "first draft passes over several positions"

    def __init__(self, draft: DraftRunner, target: GraphRunner):
        """`target`: the target model's graphs (their limits, capture function and memory pool)."""
        super().__init__(draft.model, target.max_bs, target.max_model_len, target.block_size, target.device,
                         target._capture, max_query_len=target.max_query_len, with_logits=False)
        self.draft, self.target = draft, target
        h = draft.drafter.cfg.hidden_size if isinstance(draft.drafter, Eagle3Drafter) else draft.model.cfg.hidden_size
        self.hidden_in = torch.zeros(self.max_tokens, h, dtype=draft.dtype, device=target.device)
        self.carry_out = torch.zeros(self.max_bs, h, dtype=draft.dtype, device=target.device)

    def run_pass(self, ids: list[int] | torch.Tensor, hidden: torch.Tensor, seq_lens: list[int],
                 block_tables: list[list[int]], query_len: int = 1) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One pass for n sequences of query_len positions each (their input ids - on the host, or the last
        drafted tokens on the device - and hidden input rows): (the drafted tokens [n], the next hidden inputs
        [n, H]) at each sequence's last position - views of the static outputs, valid until the next replay - or
        None where no graph fits or its capture failed (the caller runs the pass eagerly)."""
        n = len(seq_lens)
        if not self.fits(n, max(seq_lens), max(len(t) for t in block_tables), query_len):
            return None
        bs, length = self.key(n, max(seq_lens))
        on_host = isinstance(ids, list)
        self.stage(ids if on_host else [0] * n, seq_lens, block_tables, bs, query_len)
        if not on_host:
            self.i64[0, :n].copy_(ids)  # after the staging's copy, in stream order
        self.hidden_in[: n * query_len].copy_(hidden)
        if not self.replay(bs, length, query_len):
            return None
        return self.tokens[:n], self.carry_out[:n]

    def _forward(self, bs: int, max_seq_len: int, query_len: int = 1):
        input_ids, meta = self.static_inputs(bs, max_seq_len, query_len)
        t, draft = bs * query_len, self.draft
        hidden, carry, tokens = self.hidden_in[:t], self.carry_out[:bs], self.tokens[:bs]
        # each sequence's last position (a constant of the key, made before the capture)
        last = torch.arange(query_len - 1, t, query_len, device=self.device) if query_len > 1 else None

        def forward() -> None:
            out, nxt = draft._step(input_ids, hidden, meta)
            if last is not None:
                out, nxt = out[last], nxt[last]
            carry.copy_(nxt)
            tokens.copy_(draft._tokens(out))

        forward.key = ("draft", bs, max_seq_len, query_len)  # for the capture seam (logs, tests)
        return forward
