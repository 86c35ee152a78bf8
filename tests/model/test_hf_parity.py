"""nanoserve's M3 (reference path, paged KV cache) against Hugging Face transformers on the same checkpoint.

Both sides read the same m3-tiny directory (real key names, released config.json dialect): nanoserve through
`nanoserve.model.loader`, transformers through `tests.helpers.hf_oracle.load_hf_oracle`. m3-tiny has MSA blocks of 16
tokens and top-3 block selection, so prompts up to 48 tokens attend densely and longer ones really drop blocks.

Tolerance (fp32): max |logit difference| <= FP32_RTOL x max |HF logit|, with FP32_RTOL = 1e-5. The measured
max/mean differences are printed (run with `-s`) and attached to the test report as properties.

Run: python -m pytest tests/model/test_hf_parity.py -q -s
"""

from __future__ import annotations

import copy

import pytest
import torch

from nanoserve.batch import AttentionMetadata
from nanoserve.config import Optimizations
from nanoserve.model.loader import load_model, load_weights, read_config
from nanoserve.model.m3 import M3ForCausalLM
from nanoserve.presets.catalog import get_preset
from nanoserve.presets.make_checkpoint import write_checkpoint
from nanoserve.runner.kv_cache import allocate_kv_caches
from tests.helpers.hf_oracle import load_hf_oracle

FP32_RTOL = 1e-5
"""fp32 parity: max |ours - reference| <= FP32_RTOL * max |reference| (measured: about 5e-7 relative)."""
BF16_MEAN_RTOL, BF16_MAX_RTOL = 0.03, 0.5
"""bf16 smoke check: mean / max |bf16 - fp32| <= these x max |fp32 logit| (measured: 0.016 / 0.31)."""
BF16_MIN_TOP1_AGREEMENT = 0.8
"""bf16 smoke check: at least this fraction of positions keep the fp32 argmax (measured: 0.875)."""
BF16_VS_HF = 1.5
"""bf16 smoke check: nanoserve's mean bf16 error <= this x transformers' own mean bf16 error."""
SHORT, LONG = 40, 200
"""Prompt lengths: SHORT < top_k x block (48 in m3-tiny), LONG several times that."""
NUM_BLOCKS = 96
"""KV pool size for the paged runs (blocks of 16 tokens)."""


# -- helpers ----------------------------------------------------------------------------------------------------


def _report(request, label: str, ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """Print and record the max / mean absolute logit difference and the reference scale."""
    diff = (ours.float() - ref.float()).abs()
    max_d, mean_d, scale = diff.max().item(), diff.mean().item(), ref.float().abs().max().item()
    print(f"\n[parity] {label}: max |diff| = {max_d:.3e}, mean |diff| = {mean_d:.3e}, "
          f"max |ref logit| = {scale:.3f}, max relative = {max_d / scale:.3e}")
    request.node.user_properties.append((f"{label} max_abs_diff", max_d))
    request.node.user_properties.append((f"{label} mean_abs_diff", mean_d))
    return max_d, mean_d, scale


def _assert_close(request, label: str, ours: torch.Tensor, ref: torch.Tensor, rtol: float = FP32_RTOL) -> None:
    max_d, _, scale = _report(request, label, ours, ref)
    assert max_d <= rtol * scale, f"{label}: max |diff| {max_d:.3e} exceeds {rtol} x {scale:.3f}"


class PagedRunner:
    """Drives a nanoserve model through a paged KV pool whose blocks are handed out in a shuffled order, so every
    sequence's block table is non-contiguous and out of order."""

    def __init__(self, model: M3ForCausalLM, num_blocks: int = NUM_BLOCKS, seed: int = 0):
        self.model = model
        self.block_size = model.cfg.index_block_size  # the KV block size equals the MSA block size
        kv, index = allocate_kv_caches(model.cfg, num_blocks, self.block_size, model.dtype, "cpu")
        model.bind_kv_caches(kv, index)
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[object, list[int]] = {}
        self.lens: dict[object, int] = {}

    def step(self, batch: list[tuple[object, list[int]]]) -> list[torch.Tensor]:
        """Run one flat batch: for each (sequence id, new token ids), append the tokens to that sequence.
        Sequences with one new token (decodes) must come first. Returns each sequence's logits [q, vocab]."""
        ids, query_lens, seq_lens, tables = [], [], [], []
        for seq, new in batch:
            n = self.lens.get(seq, 0) + len(new)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < n:
                table.append(self.free.pop())
            self.lens[seq] = n
            ids += new
            query_lens.append(len(new))
            seq_lens.append(n)
            tables.append(list(table))
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size)
        logits = self.model.compute_logits(self.model(torch.tensor(ids), meta.positions, meta))
        return list(torch.split(logits, query_lens))


def full_forward(model: M3ForCausalLM, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, in one prefill on a fresh cache with a contiguous block table."""
    bs = model.cfg.index_block_size
    n_blocks = -(-len(ids) // bs)
    kv, index = allocate_kv_caches(model.cfg, n_blocks, bs, model.dtype, "cpu")
    model.bind_kv_caches(kv, index)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(n_blocks))], bs)
    return model.compute_logits(model(torch.tensor(ids), meta.positions, meta))


def hf_forward(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def random_ids(n: int, seed: int, vocab: int = 256) -> list[int]:
    """Random token ids below `vocab` (the model does not care what they spell)."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class SelectionRecorder:
    """Records each MSA layer's block selection [T, G, top_k] (logical block ids, -1 = empty slot)."""

    def __init__(self, model: M3ForCausalLM):
        self.selections: dict[int, torch.Tensor] = {}
        self.handles = [layer.self_attn.register_forward_hook(self._hook(i))
                        for i, layer in enumerate(model.layers) if layer.self_attn.sparse]

    def _hook(self, idx: int):
        def hook(module, args, output):
            self.selections[idx] = output[1].clone()
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# -- fixtures ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf(tiny_hf):
    return tiny_hf


@pytest.fixture(scope="module")
def model(tiny_dir):
    m, _ = load_model(tiny_dir, Optimizations.reference(), torch.float32)
    return m


@pytest.fixture(scope="module")
def long_ids():
    return random_ids(LONG, seed=1)


@pytest.fixture(scope="module")
def full_logits(model, hf, long_ids):
    """Full-sequence logits of the long prompt, both sides (computed once)."""
    return full_forward(model, long_ids), hf_forward(hf, long_ids)


# -- prefill ----------------------------------------------------------------------------------------------------


def test_tiny_preset_shape(model):
    """The premises of the tests below: MSA blocks of 16, top-3, so 48 tokens is the dense/sparse boundary."""
    cfg = model.cfg
    assert cfg.index_block_size * cfg.index_topk_blocks == 48
    assert SHORT < 48 < LONG
    assert cfg.num_sparse_attn_layers == 3 and not cfg.is_sparse_attention(0)


def test_short_prompt_logits_match_hf(request, model, hf):
    """A prompt shorter than top_k x block: every causal block is selected, MSA is exactly dense attention."""
    ids = random_ids(SHORT, seed=0)
    rec = SelectionRecorder(model)
    try:
        ours = full_forward(model, ids)
    finally:
        rec.remove()
    _assert_close(request, f"prefill {SHORT} tokens (dense regime)", ours, hf_forward(hf, ids))
    bs = model.cfg.index_block_size
    for sel in rec.selections.values():
        chosen = (sel >= 0).sum(-1)  # [T, G]
        causal = torch.arange(SHORT) // bs + 1
        assert torch.equal(chosen, causal[:, None].expand_as(chosen)), "short prompt must select every block"


def test_long_prompt_logits_match_hf_and_msa_drops_blocks(request, model, hf, long_ids, full_logits, tiny_dir):
    """A prompt several times top_k x block: tokens past 48 attend to only 3 of their causal blocks, and the
    logits still match transformers."""
    rec = SelectionRecorder(model)
    try:
        ours = full_forward(model, long_ids)
    finally:
        rec.remove()
    ref = full_logits[1]
    _assert_close(request, f"prefill {LONG} tokens (MSA drops blocks)", ours, ref)

    cfg = model.cfg
    bs, topk = cfg.index_block_size, cfg.index_topk_blocks
    causal = torch.arange(LONG) // bs + 1  # blocks a dense layer would read, per query
    assert len(rec.selections) == cfg.num_sparse_attn_layers
    for layer, sel in rec.selections.items():
        chosen = (sel >= 0).sum(-1)  # [T, G]
        assert torch.equal(chosen, causal.clamp(max=topk)[:, None].expand_as(chosen)), layer
        last = sel[-1]  # the last query: 13 causal blocks, 3 selected per group, its own block forced
        assert causal[-1].item() == 13 and bool((last >= 0).all())
        assert bool((last == (LONG - 1) // bs).any(-1).all()), "the query's own block is always selected"
        # different KV groups choose different blocks somewhere: selection is per group, not shared
    assert any(not torch.equal(sel[:, 0].sort(-1).values, sel[:, 1].sort(-1).values)
               for sel in rec.selections.values())

    # The comparison is sensitive to the selection: the same weights with dense attention (top-k covering every
    # block) agree with HF on the first 48 positions and differ clearly after them.
    dense_model = M3ForCausalLM(read_config(tiny_dir).replace(index_topk_blocks=LONG), Optimizations.reference())
    load_weights(dense_model, tiny_dir)
    dense = full_forward(dense_model, long_ids)
    boundary = bs * topk
    torch.testing.assert_close(dense[:boundary], ref[:boundary], rtol=0, atol=FP32_RTOL * ref.abs().max().item())
    assert (dense[boundary:] - ref[boundary:]).abs().max().item() > 100 * FP32_RTOL * ref.abs().max().item()


@pytest.mark.parametrize("n", [1, 15, 16, 17, 47, 48, 49, 64, 65])
def test_prompt_lengths_at_block_boundaries_match_hf(request, model, hf, n):
    """One token, and lengths on either side of a 16-token block and of the 48-token dense/sparse boundary."""
    ids = random_ids(n, seed=100 + n)
    _assert_close(request, f"prefill {n} tokens", full_forward(model, ids), hf_forward(hf, ids))


@pytest.mark.parametrize("changes", [
    dict(index_local_blocks=2, index_topk_blocks=4, index_block_size=8),
    dict(num_attention_heads=16, rotary_dim=32, index_block_size=4, index_topk_blocks=3, index_local_blocks=3,
         num_experts_per_tok=1),
], ids=["two-local-blocks", "gqa4-full-rotary-local-only"])
def test_config_variants_match_hf(request, tmp_path, changes):
    """Other shapes of the same architecture (more forced local blocks, a GQA ratio of 4, RoPE over the whole
    head, top-1 routing): prefill and paged decode still match transformers on the same checkpoint."""
    preset = get_preset("m3-tiny")
    write_checkpoint(str(tmp_path), preset.config.replace(**changes), preset)
    model, _ = load_model(str(tmp_path), Optimizations.reference(), torch.float32)
    hf = load_hf_oracle(str(tmp_path))
    ids = random_ids(100, seed=3)
    ref = hf_forward(hf, ids)
    _assert_close(request, f"variant {request.node.callspec.id}: prefill", full_forward(model, ids), ref)
    runner = PagedRunner(model, seed=1)
    inc = torch.cat([runner.step([("a", ids[:30])])[0]] + [runner.step([("a", [t])])[0] for t in ids[30:]])
    _assert_close(request, f"variant {request.node.callspec.id}: paged decode", inc, ref)


# -- incremental decoding through the paged cache ---------------------------------------------------------------


def test_incremental_decode_matches_full_forward(request, model, long_ids, full_logits):
    """Prefill 21 tokens, then feed the rest of the 200-token sequence one token per step through the paged
    cache (shuffled, non-contiguous block table). Every step's logits equal the full-sequence forward at that
    position, both nanoserve's and HF's; the steps past position 48 run MSA decode with dropped blocks."""
    ours_full, hf_full = full_logits
    prefill = 21
    runner = PagedRunner(model, seed=3)
    steps = [runner.step([("a", long_ids[:prefill])])[0]]
    for t in range(prefill, LONG):
        steps.append(runner.step([("a", [long_ids[t]])])[0])
    inc = torch.cat(steps)
    table = runner.tables["a"]
    assert sorted(table) != table and len(table) == -(-LONG // runner.block_size), table
    _assert_close(request, "incremental decode vs HF full forward", inc, hf_full)
    _assert_close(request, "incremental decode vs nanoserve full forward", inc, ours_full)


def test_ragged_batch_matches_one_sequence_at_a_time(request, model, hf):
    """Four sequences in flat ragged batches (decodes first, then prefills and prefill chunks), over three steps,
    give the logits each sequence gets alone."""
    seqs = {name: random_ids(n, seed=10 + i) for i, (name, n) in enumerate(
        [("a", 62), ("b", 92), ("c", 121), ("d", 71)])}
    runner = PagedRunner(model, seed=4)
    got: dict[str, list[torch.Tensor]] = {k: [] for k in seqs}

    def run(batch):
        for (name, _), logits in zip(batch, runner.step(batch)):
            got[name].append(logits)

    # step 1: three prefills of different lengths (c only its first chunk)
    run([("a", seqs["a"][:60]), ("b", seqs["b"][:90]), ("c", seqs["c"][:40])])
    # step 2: two decodes, the rest of c's prompt as a second chunk, and d's whole prompt
    run([("a", seqs["a"][60:61]), ("b", seqs["b"][90:91]), ("c", seqs["c"][40:120]), ("d", seqs["d"][:70])])
    # step 3: all four decode
    run([(name, ids[-1:]) for name, ids in seqs.items()])
    assert len(set(map(len, seqs.values()))) == 4

    batched = torch.cat([torch.cat(got[name]) for name in seqs])
    alone = torch.cat([full_forward(model, ids) for ids in seqs.values()])
    reference = torch.cat([hf_forward(hf, ids) for ids in seqs.values()])
    _assert_close(request, "ragged batch vs one at a time (nanoserve)", batched, alone)
    _assert_close(request, "ragged batch vs HF", batched, reference)


def test_sequences_sharing_prefix_blocks_match_hf(request, model, hf):
    """Prefix caching's use of the paged cache: sequence b's block table starts with three full blocks that
    sequence a computed (48 shared tokens); b then prefills only its own 52 tokens and decodes. Its logits equal
    a full forward of b alone, and a (still running) is unaffected."""
    bs = model.cfg.index_block_size
    shared = random_ids(3 * bs, seed=20)
    a = shared + random_ids(30, seed=21)
    b = shared + random_ids(52, seed=22)
    kv, index = allocate_kv_caches(model.cfg, 32, bs, torch.float32, "cpu")
    model.bind_kv_caches(kv, index)
    table_a = [9, 4, 17, 2, 25]  # 78 tokens
    table_b = table_a[:3] + [30, 11, 6, 21, 13]  # shares a's first three blocks; 101 tokens
    meta = AttentionMetadata.build([len(a)], [len(a)], [table_a], bs)
    out_a = [model.compute_logits(model(torch.tensor(a), meta.positions, meta))]
    meta = AttentionMetadata.build([len(b) - 1 - 3 * bs], [len(b) - 1], [table_b], bs)
    out_b = [model.compute_logits(model(torch.tensor(b[3 * bs:-1]), meta.positions, meta))]
    # one step decoding both: a's next token (its own blocks) and b's last prompt token (shared prefix)
    nxt = random_ids(1, seed=23)
    meta = AttentionMetadata.build([1, 1], [len(a) + 1, len(b)], [table_a, table_b], bs)
    step = model.compute_logits(model(torch.tensor(nxt + b[-1:]), meta.positions, meta))
    out_a.append(step[:1])
    out_b.append(step[1:])
    _assert_close(request, "shared-prefix sequence vs HF", torch.cat(out_b), hf_forward(hf, b)[3 * bs:])
    _assert_close(request, "prefix owner vs HF", torch.cat(out_a), hf_forward(hf, a + nxt))


# -- greedy generation ------------------------------------------------------------------------------------------


def test_greedy_generation_matches_hf_generate(request, model, hf):
    """40 greedy tokens after a 40-token prompt (crossing the 48-token dense/sparse boundary): nanoserve's loop
    (prefill, then one decode per token through the paged cache) equals transformers' generate(do_sample=False)
    token for token. EOS is not a stop on either side, so all 40 tokens are always compared."""
    prompt = random_ids(40, seed=1)
    new_tokens = 40
    gen_config = copy.deepcopy(hf.generation_config)
    # No stop on EOS: transformers replaces eos_token_id=None by the model's, so name an id outside the vocabulary.
    gen_config.update(max_new_tokens=new_tokens, do_sample=False, eos_token_id=model.cfg.vocab_size)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), generation_config=gen_config)
    hf_tokens = out[0, len(prompt):].tolist()

    runner = PagedRunner(model, seed=5)
    ours: list[int] = []
    margins = []
    logits = runner.step([("g", prompt)])[0][-1]
    while True:
        top2 = logits.topk(2).values
        margins.append((top2[0] - top2[1]).item())
        ours.append(int(logits.argmax()))
        if len(ours) == new_tokens:
            break
        logits = runner.step([("g", ours[-1:])])[0][-1]
    print(f"\n[parity] greedy: {len(ours)} tokens, smallest top-1/top-2 logit margin {min(margins):.3e}\n"
          f"  nanoserve: {ours}\n  hf:        {hf_tokens}")
    request.node.user_properties.append(("greedy min margin", min(margins)))
    assert ours == hf_tokens
    assert len(set(ours)) > 5, "a degenerate generation would prove little"


# -- bf16 ---------------------------------------------------------------------------------------------------------


def test_bf16_runs_and_stays_close_to_fp32(request, tiny_dir, long_ids, full_logits):
    """The model runs in bf16 on the CPU (long prompt in two chunks, paged, MSA dropping blocks) and stays near
    fp32. m3-tiny's random weights make bf16 drift large (transformers itself drifts as much: about 0.3 of the
    logit range at worst, 86% top-1 agreement), so the bounds are loose: mean |diff| <= BF16_MEAN_RTOL and
    max |diff| <= BF16_MAX_RTOL of the logit range, top-1 agreement >= BF16_MIN_TOP1_AGREEMENT, and nanoserve's
    mean bf16 error at most BF16_VS_HF x transformers' own bf16 error on the same weights and prompt."""
    ours_fp32, hf_fp32 = full_logits
    m16, _ = load_model(tiny_dir, Optimizations.reference(), torch.bfloat16)
    assert m16.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    runner = PagedRunner(m16, seed=6)
    logits = torch.cat(runner.step([("x", long_ids[:120])]) + runner.step([("x", long_ids[120:])]))
    assert logits.dtype == torch.float32 and bool(torch.isfinite(logits).all())
    max_d, mean_d, scale = _report(request, "bf16 vs fp32 (nanoserve)", logits, ours_fp32)
    assert mean_d <= BF16_MEAN_RTOL * scale
    assert max_d <= BF16_MAX_RTOL * scale
    agreement = (logits.argmax(-1) == ours_fp32.argmax(-1)).float().mean().item()
    hf16 = hf_forward(load_hf_oracle(tiny_dir, torch.bfloat16), long_ids)
    _, hf_mean_d, _ = _report(request, "bf16 vs fp32 (transformers)", hf16, hf_fp32)
    print(f"[parity] bf16 top-1 agreement with fp32: {agreement:.3f}")
    assert agreement >= BF16_MIN_TOP1_AGREEMENT
    assert mean_d <= BF16_VS_HF * hf_mean_d
