"""The measured tile tables as data (nanoserve/kernels/tuned/*.json): every lookup the kernels make returns what the
Python tables returned before the move, each data file says where every entry came from, and a tuner's output has
the shipped files' form.

OLD_* below are the tables as Python literals, copied once from kernels/configs.py and kernels/fp8_configs.py when
their "cuda" columns moved to the data files: the regression pin. They change only with a deliberate retune.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from nanoserve.kernels import configs, fp8_configs, moe, tuned
from nanoserve.kernels.configs import Tiles

# kernel -> (cuda, hip, interpret) as (block_m, block_n, num_warps, num_stages[, tma])
OLD_TABLES = {
    "paged_decode": ((0, 64, 4, 3), (0, 64, 4, 2), (0, 32, 1, 1)),
    "paged_prefill": ((128, 64, 8, 3), (128, 32, 4, 2), (32, 32, 1, 1)),
    "paged_prefill_fp8": ((128, 64, 8, 3), (128, 32, 8, 2), (32, 32, 1, 1)),
    "split_combine": ((0, 16, 4, 2), (0, 16, 4, 2), (0, 64, 1, 1)),
    "msa_score_prefill": ((128, 0, 8, 3), (64, 0, 4, 2), (64, 0, 1, 1)),
    "msa_score_decode": ((16, 0, 4, 3), (16, 0, 4, 2), (16, 0, 1, 1)),
    "msa_topk": ((4096, 2048, 8, 1), (4096, 2048, 4, 1), (16384, 256, 1, 1)),
    "sparse_decode": ((1, 64, 4, 3), (1, 64, 4, 2), (1, 64, 1, 1)),
    "sparse_decode_fp8": ((1, 64, 4, 1), (1, 64, 4, 2), (1, 64, 1, 1)),
    "sparse_prefill": ((8, 64, 8, 3), (4, 64, 4, 2), (16, 64, 1, 1)),
    "sparse_by_block": ((4, 64, 4, 3), (4, 64, 4, 2), (4, 64, 1, 1)),
    "slot_combine": ((4, 0, 4, 1), (8, 0, 4, 1), (4, 0, 1, 1)),
    "paged_prefill_long": ((128, 128, 8, 3, True), (128, 32, 4, 2), (32, 32, 1, 1)),
    "paged_prefill_fp8_long": ((128, 64, 4, 2, True), (128, 32, 8, 2), (32, 32, 1, 1)),  # added 2026-12-06 (H100)
    "msa_score_prefill_long": ((128, 0, 4, 3), (64, 0, 4, 2), (64, 0, 1, 1)),
    "sparse_prefill_long": ((1, 64, 4, 3), (4, 64, 4, 2), (1, 64, 1, 1)),
    "sparse_by_block_long": ((4, 64, 4, 3), (4, 64, 4, 2), (4, 64, 1, 1)),
    "qk_norm_rope": ((1, 32, 4, 1), (1, 32, 4, 1), (16, 128, 1, 1)),
    "add_rmsnorm": ((1, 0, 8, 1), (1, 0, 4, 1), (16, 0, 1, 1)),
}
OLD_MOE_CUDA = {(6144, 3072, 128): {
    1: (16, 1, (32, 256, 4, 4), (64, 256, 4, 3)),
    16: (16, 1, (32, 256, 4, 4), (64, 256, 4, 3)),
    64: (16, 8, (64, 128, 4, 4), (64, 128, 4, 4)),
    256: (32, 8, (64, 128, 4, 4), (64, 128, 4, 4)),
    1024: (64, 1, (256, 64, 8, 3), (128, 64, 4, 3)),
    4096: (64, 32, (256, 64, 8, 3), (256, 64, 8, 4), "tma"),
    8192: (128, 32, (128, 64, 8, 4), (256, 64, 8, 3)),
    16384: (128, 16, (128, 64, 8, 3), (256, 64, 8, 4), "tma"),
}}
OLD_MOE_HIP_BUCKETS = {
    1: (16, 8, (16, 256, 4, 2), (32, 256, 4, 2)),
    256: (16, 8, (16, 256, 4, 2), (32, 256, 4, 2)),
    1024: (32, 8, (32, 128, 4, 2), (64, 128, 4, 2)),
    4096: (64, 8, (64, 64, 4, 2), (128, 64, 4, 2)),
}
M3_EXPERT_SHAPES = ((6144, 3072, 128), (6144, 1536, 128), (6144, 768, 128), (6144, 384, 128), (6144, 3072, 32),
                    (6144, 3072, 16))
OLD_GEMV = {
    "cuda": {(128, 6144): (1, 1024, 8, 2), (200064, 6144): (2, 2048, 8, 2), (9216, 6144): (4, 512, 4, 2),
             (9856, 6144): (16, 256, 8, 2), (6144, 8192): (8, 512, 4, 1), (6144, 12288): (8, 1024, 8, 1)},
    "hip": {(128, 6144): (1, 1024, 4, 2), (200064, 6144): (2, 2048, 4, 2), (9216, 6144): (4, 512, 2, 2),
            (9856, 6144): (16, 256, 4, 2), (6144, 8192): (8, 512, 2, 1), (6144, 12288): (8, 1024, 4, 1)},
    "interpret": {},
}
OLD_GEMV_MXFP8 = {
    "cuda": {(6144, 8192): (4, 2048, 4, 1), (9856, 6144): (8, 2048, 4, 1), (9216, 6144): (8, 2048, 4, 1),
             (6144, 12288): (4, 1024, 4, 1), (24576, 6144): (4, 2048, 4, 1)},
    "hip": {(6144, 8192): (4, 2048, 2, 1), (9856, 6144): (8, 2048, 2, 1), (9216, 6144): (8, 2048, 2, 1),
            (6144, 12288): (4, 1024, 2, 1), (24576, 6144): (4, 2048, 2, 1)},
    "interpret": {},
}
OLD_FP8_LINEAR_CUDA = {
    (6144, 12288): {1: ("bcast", 16, 64, 128, 4, 4, 8), 8: ("bcast", 16, 64, 128, 4, 4, 4),
                    32: ("bcast", 32, 64, 128, 4, 4), 64: ("bcast", 64, 64, 128, 4, 4, 8),
                    128: ("dequant", 128, 128, 64, 4, 4), 512: ("dequant", 128, 128, 64, 4, 4),
                    4096: ("dequant", 128, 128, 64, 4, 4)},
    (24576, 6144): {1: ("gemv", 1, 32, 256, 4, 1, 8), 8: ("scaled", 16, 64, 256, 4, 3, 8),
                    32: ("scaled", 32, 64, 128, 4, 4), 64: ("bcast", 64, 64, 128, 4, 4, 8),
                    128: ("bcast", 64, 128, 64, 4, 4), 512: ("dequant", 128, 128, 64, 4, 4),
                    4096: ("dequant", 128, 128, 64, 4, 4)},
    (6144, 8192): {1: ("gemv", 1, 32, 256, 4, 1, 4), 8: ("scaled", 16, 64, 256, 4, 3, 8),
                   32: ("bcast", 32, 64, 128, 4, 4), 64: ("bcast", 64, 64, 128, 4, 4, 8),
                   128: ("dequant", 128, 128, 64, 4, 4), 512: ("dequant", 128, 128, 64, 4, 4),
                   4096: ("dequant", 128, 128, 64, 4, 4)},
    (9856, 6144): {1: ("gemv", 1, 32, 256, 4, 1, 4), 8: ("gemv", 2, 32, 256, 4, 1, 8),
                   32: ("bcast", 32, 64, 128, 4, 4), 64: ("swap", 64, 64, 256, 4, 4, 8),
                   128: ("dequant", 128, 128, 64, 4, 4), 512: ("dequant", 128, 128, 64, 4, 4),
                   4096: ("dequant", 128, 128, 64, 4, 4)},
}
OLD_FP8_LINEAR_HIP_BUCKETS = {
    1: ("gemv", 1, 32, 256, 4, 1, 4), 8: ("acc", 16, 64, 128, 4, 2, 8), 32: ("bcast", 32, 64, 64, 4, 2),
    64: ("bcast", 64, 64, 128, 4, 2, 8), 128: ("bcast", 64, 128, 64, 4, 2), 512: ("dequant", 128, 128, 64, 4, 2),
}
M3_LINEAR_SHAPES = (
    (9856, 6144), (9216, 6144), (6144, 8192), (24576, 6144), (6144, 12288), (4992, 6144), (4608, 6144), (6144, 4096),
    (12288, 6144), (6144, 6144), (2560, 6144), (2304, 6144), (6144, 2048), (6144, 3072), (1536, 6144), (1280, 6144),
    (6144, 1024), (3072, 6144), (6144, 1536), (6144, 768), (768, 6144), (6144, 384),
)
OLD_FP8_MOE_CUDA = {(6144, 3072, 128): {
    1: ("gemv", 16, 8, (8, 512, 4, 1), (8, 512, 4, 1)),
    4: ("bcast", 16, 8, (32, 256, 4, 4), (64, 256, 4, 3)),
    8: ("bcast", 16, 8, (64, 256, 4, 3), (128, 128, 4, 3)),
    32: ("bcast", 16, 8, (64, 256, 4, 3), (128, 128, 4, 3)),
    64: ("bcast", 16, 8, (64, 256, 4, 3), (128, 128, 4, 3)),
    128: ("bcast", 16, 8, (64, 128, 4, 4), (64, 128, 4, 4)),
    512: ("bcast", 32, 8, (128, 128, 4, 3), (128, 128, 4, 3)),
    4096: ("scaled", 128, 16, (128, 128, 8, 3), (128, 128, 8, 3)),
}}
OLD_FP8_MOE_HIP_BUCKETS = {
    1: ("gemv", 16, 8, (8, 512, 4, 1), (8, 512, 4, 1)),
    256: ("acc", 16, 8, (32, 128, 4, 2), (64, 128, 4, 2)),
    1024: ("bcast", 32, 8, (32, 128, 4, 2), (64, 128, 4, 2)),
    4096: ("bcast", 64, 8, (64, 64, 4, 2), (128, 64, 4, 2)),
}

OLD_MOE = {"cuda": OLD_MOE_CUDA, "hip": {shape: OLD_MOE_HIP_BUCKETS for shape in M3_EXPERT_SHAPES}}
OLD_FP8_LINEAR = {"cuda": OLD_FP8_LINEAR_CUDA, "hip": {shape: OLD_FP8_LINEAR_HIP_BUCKETS for shape in M3_LINEAR_SHAPES}}
OLD_FP8_MOE = {"cuda": OLD_FP8_MOE_CUDA, "hip": {shape: OLD_FP8_MOE_HIP_BUCKETS for shape in M3_EXPERT_SHAPES}}
SIZES = sorted({n + d for n in (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 8192, 16384) for d in (-1, 0, 1)}
               | {2, 3, 5, 100, 300, 2000, 6000, 12000, 20000, 65536} - {0})
"""Row / token counts: every bucket of the tables, its neighbours, and sizes between and past them."""
FILES = ("attention", "moe", "fp8", "gemv")
TABLE_DEPTH = {"attention": {"tiles": 1}, "moe": {"moe": 2}, "fp8": {"linear": 2, "moe": 2},
               "gemv": {"16bit": 1, "mxfp8": 1}}
"""Each file's tables and how deep their keys go to an entry (shape, then bucket)."""


@pytest.fixture(params=["cuda", "hip", "interpret"])
def backend_device(request, monkeypatch) -> tuple[str, torch.device]:
    """A device that configs.backend() maps to each column, with no GPU: the table lookups never touch one."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(configs.GEMV_TUNED_CONFIG_ENV, raising=False)
    monkeypatch.delenv(fp8_configs.TUNED_CONFIG_ENV, raising=False)
    monkeypatch.setattr(torch.version, "hip", "6.2" if request.param == "hip" else None)
    device = torch.device("cpu" if request.param == "interpret" else "cuda")
    assert configs.backend(device) == request.param
    return request.param, device


def bucket(buckets: dict, size: int):
    """The old rule: the entry of the smallest bucket >= size, the largest beyond."""
    keys = sorted(buckets)
    return buckets[next((b for b in keys if size <= b), keys[-1])]


def test_attention_tiles_are_the_old_ones(backend_device):
    kind, device = backend_device
    column = ("cuda", "hip", "interpret").index(kind)
    assert set(configs.TABLES) == set(OLD_TABLES)
    for kernel, old in OLD_TABLES.items():
        assert configs.tiles(kernel, device) == Tiles(*old[column]), kernel


def test_moe_tile_choice_is_the_old_one(backend_device):
    kind, device = backend_device
    shapes = {*M3_EXPERT_SHAPES, (64, 32, 8), (6144, 3072, 64)}  # two untabled shapes: the heuristic, as before
    for hidden, inter, experts in shapes:
        for tokens in SIZES:
            got = moe.select_config(tokens, hidden, inter, experts, 4, device, torch.bfloat16)
            table = OLD_MOE.get(kind, {}).get((hidden, inter, experts))
            if kind == "interpret":
                want = moe.INTERPRETER_CONFIG
            elif table is None:
                want = moe.default_config(tokens, 4, experts, on_rocm=kind == "hip")
            else:
                want = moe._table_cfg(bucket(table, tokens))
            assert got == want, (kind, hidden, inter, experts, tokens)
            got = moe.select_config(tokens, hidden, inter, experts, 4, device, torch.bfloat16, w_fp8=True)
            fp8 = OLD_FP8_MOE.get(kind, {}).get((hidden, inter, experts))
            if kind != "interpret" and fp8 is not None:
                entry = bucket(fp8, tokens)
                want = moe._cfg(*entry[1:], fp8_variant=entry[0])
            assert got == want, (kind, hidden, inter, experts, tokens, "fp8")
    assert moe.TOKEN_BUCKETS == tuple(sorted(OLD_MOE_CUDA[(6144, 3072, 128)]))


def test_fp8_entries_are_the_old_ones(backend_device):
    kind, _ = backend_device
    for n, k in {*M3_LINEAR_SHAPES, *OLD_FP8_LINEAR_CUDA, (96, 128)}:
        for m in SIZES:
            table = OLD_FP8_LINEAR.get(kind, {}).get((n, k))
            assert fp8_configs.linear_entry(kind, n, k, m) == (bucket(table, m) if table else None), (kind, n, k, m)
    for shape in {*M3_EXPERT_SHAPES, (64, 32, 8)}:
        for t in SIZES:
            table = OLD_FP8_MOE.get(kind, {}).get(shape)
            assert fp8_configs.moe_entry(kind, *shape, t) == (bucket(table, t) if table else None), (kind, shape, t)


def test_gemv_tiles_are_the_old_ones(backend_device):
    kind, device = backend_device
    for old, mxfp8 in ((OLD_GEMV, False), (OLD_GEMV_MXFP8, True)):
        for n, k in {*OLD_GEMV["cuda"], *OLD_GEMV_MXFP8["cuda"], (48, 128)}:
            assert configs.gemv_tiles(n, k, device, mxfp8=mxfp8) == old[kind].get((n, k)), (kind, n, k, mxfp8)


def test_the_python_tables_hold_the_old_entries():
    """The table objects themselves (read by the compile gate, the tuners and the benches), not only the
    lookups."""
    assert {k: (v["cuda"], v["hip"], v["interpret"]) for k, v in configs.TABLES.items()} == \
        {k: tuple(Tiles(*t) for t in v) for k, v in OLD_TABLES.items()}
    assert configs.MOE_TILES == OLD_MOE
    assert configs.GEMV_TILES == OLD_GEMV and configs.GEMV_MXFP8_TILES == OLD_GEMV_MXFP8
    assert fp8_configs.FP8_LINEAR_TILES == OLD_FP8_LINEAR and fp8_configs.FP8_MOE_TILES == OLD_FP8_MOE


def table_paths(data: dict, name: str) -> set[tuple[str, ...]]:
    """The key paths of every entry in a table file (table, shape[, bucket])."""
    paths = set()
    for table, depth in TABLE_DEPTH[name].items():
        level = {(table,): data.get(table, {})}
        for _ in range(depth):
            level = {(*p, str(k)): v for p, sub in level.items() for k, v in sub.items()}
        paths |= set(level)
    return paths


def check_provenance(data: dict, name: str) -> None:
    """Every record has the provenance fields (a card and a command at least), dates are dates, and the records'
    entries cover the file's entries exactly once."""
    records = data["provenance"]
    assert records, name
    seen: set = set()
    for record in records:
        assert set(tuned.PROVENANCE_FIELDS) <= set(record), (name, set(tuned.PROVENANCE_FIELDS) - set(record))
        assert isinstance(record["card"], str) and record["card"], (name, record)
        assert isinstance(record["command"], str) and record["command"], (name, record)
        assert record["date"] is None or re.fullmatch(r"\d{4}-\d\d-\d\d", record["date"]), (name, record["date"])
        paths = tuned.entry_paths(record["entries"])
        assert paths and not paths & seen, (name, paths & seen)
        seen |= paths
    assert seen == table_paths(data, name), (name, seen ^ table_paths(data, name))


@pytest.mark.parametrize("name", FILES)
def test_each_data_file_records_where_every_entry_came_from(name):
    with open(tuned.path(name)) as f:
        data = json.load(f)
    assert set(data) == {*TABLE_DEPTH[name], "provenance"}
    check_provenance(data, name)


@pytest.mark.parametrize("name", FILES)
def test_the_files_are_written_as_they_are_laid_out(name):
    """tuned.write reproduces each shipped file byte for byte: a tuner that rewrites one changes only what it
    tuned."""
    assert tuned.dumps(tuned.load(name)) + "\n" == tuned.path(name).read_text()


@pytest.mark.parametrize("variable,name", [(configs.GEMV_TUNED_CONFIG_ENV, "gemv"),
                                           (fp8_configs.TUNED_CONFIG_ENV, "fp8")])
def test_a_shipped_file_is_a_valid_override_file(monkeypatch, variable, name):
    """The shipped files have the form the $NANOSERVE_*_TUNED_CONFIG overrides read (what the tuners write), and
    read as one they give the built-in tables."""
    monkeypatch.setenv(variable, str(tuned.path(name)))
    if name == "gemv":
        assert configs.tuned_gemv_tables() == {"16bit": OLD_GEMV["cuda"], "mxfp8": OLD_GEMV_MXFP8["cuda"]}
    else:
        assert fp8_configs.tuned_tables() == {"linear": OLD_FP8_LINEAR_CUDA, "moe": OLD_FP8_MOE_CUDA}
        assert fp8_configs.linear_entry("cuda", 6144, 8192, 3) == OLD_FP8_LINEAR_CUDA[(6144, 8192)][8]


def test_add_record_moves_entries_to_the_newest_run():
    data = {"moe": {}, "provenance": [{"entries": {"moe": {"1,2,3": [1, 16, 4096]}}, "card": "a"},
                                      {"entries": {"moe": {"1,2,3": [8192]}}, "card": "b"}]}
    out = tuned.add_record(data, {"entries": {"moe": {"1,2,3": [4096, 8192, 16384]}}, "card": "c"})
    assert out["provenance"] == [{"entries": {"moe": {"1,2,3": [1, 16]}}, "card": "a"},
                                 {"entries": {"moe": {"1,2,3": [4096, 8192, 16384]}}, "card": "c"}]
    assert data["provenance"][0]["entries"] == {"moe": {"1,2,3": [1, 16, 4096]}}  # the input is left as it was


RECORD = {"card": "NVIDIA H200", "torch": "2.13", "triton": "3.9",
          "command": "python scripts/tune_moe.py --write-configs", "commit": "0000000", "date": "2026-12-06"}


def test_tune_moe_write_configs_writes_the_data_file(tmp_path):
    """`scripts/tune_moe.py --write-configs`: the tuned buckets replace or join the shape's entries in
    tuned/moe.json, the others stay, and the run becomes their provenance."""
    from scripts import tune_moe

    path = tmp_path / "moe.json"
    path.write_text(tuned.path("moe").read_text())
    rows = [{"bucket": 4096, "best": (64, 16, (128, 64, 8, 3), (256, 64, 8, 4)), "ms": 6.1, "tflop_s": 380.2,
             "best_with_tma_flipped_ms": float("inf"), "start_ms": 6.283},
            {"bucket": 32768, "best": (128, 16, (128, 64, 8, 3), (256, 64, 8, 4), "tma"), "ms": 30.0,
             "tflop_s": 600.0, "best_with_tma_flipped_ms": 31.0, "start_ms": 33.0}]
    key = "6144,3072,128"
    record = {"entries": {"moe": {key: [4096, 32768]}}, **RECORD, "times": {"moe": {key: tune_moe.bucket_times(rows)}}}
    tune_moe.write_configs((6144, 3072, 128), rows, record, path)
    data = json.loads(path.read_text())
    table = configs.bucket_tables(data, ("moe",))["moe"][(6144, 3072, 128)]
    assert table == {**OLD_MOE_CUDA[(6144, 3072, 128)], 4096: rows[0]["best"], 32768: rows[1]["best"]}
    assert list(table) == sorted(table)
    assert data["provenance"][-1]["times"]["moe"][key]["4096"] == {"ms": 6.1, "tflop_s": 380.0, "tma_flipped_ms": None,
                                                                  "old_ms": 6.283}
    check_provenance(data, "moe")


def test_tune_gemv_write_adds_entries_with_their_run(tmp_path):
    from scripts import tune_gemv

    path = tmp_path / "gemv.json"
    path.write_text(tuned.path("gemv").read_text())
    record = {"entries": {"16bit": ["24576,6144"]}, **RECORD}
    tune_gemv.write_tuned(str(path), "16bit", {(24576, 6144): (8, 512, 4, 2)}, record)
    data = json.loads(path.read_text())
    assert configs.gemv_tables(data)["16bit"] == {**OLD_GEMV["cuda"], (24576, 6144): (8, 512, 4, 2)}
    check_provenance(data, "gemv")


def test_tune_fp8_output_has_the_shipped_form():
    """scripts/tune_fp8.py's winners, as fp8_tuned.json holds them: the tables tuned/fp8.json holds, and times."""
    from scripts import tune_fp8

    best = {("linear", "o_proj", 8): {"n": 6144, "k": 8192, "entry": ("bcast", 16, 64, 128, 4, 4), "ms": 0.02,
                                      "bf16_ms": 0.03},
            ("moe", "moe", 4096): {"h": 6144, "inter": 3072, "experts": 128, "ms": 5.0, "bf16_ms": 6.0,
                                   "entry": ("scaled", 128, 16, (128, 128, 8, 3), (128, 128, 8, 3))}}
    out, times = tune_fp8.tuned_json(best)
    assert times == {"linear": {"6144,8192": {"8": {"ms": 0.02, "bf16_ms": 0.03}}},
                                "moe": {"6144,3072,128": {"4096": {"ms": 5.0, "bf16_ms": 6.0}}}}
    assert fp8_configs._parse_tuned_file(json.loads(json.dumps(out))) == {
        "linear": {(6144, 8192): {8: ("bcast", 16, 64, 128, 4, 4)}},
        "moe": {(6144, 3072, 128): {4096: ("scaled", 128, 16, (128, 128, 8, 3), (128, 128, 8, 3))}}}
