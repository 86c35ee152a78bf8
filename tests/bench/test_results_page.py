"""`python -m nanoserve.bench --report DIR`: the page of current numbers rendered from run records - one section per
card, newest run first, each run's date, card, commit and command, then its parts as tables (the tools' own printed
tables where the record kept them). Records are written here; docs/results.md itself is checked against results/
by tests/project/test_docs.py."""

from __future__ import annotations

import json
import re

import pytest

from nanoserve.bench.results_page import MAX_ROWS, card_of, cell, render


def write(directory, name: str, data: dict) -> None:
    (directory / name).write_text(json.dumps(data))


@pytest.fixture
def records(tmp_path):
    write(tmp_path, "2026-01-02_abc1234_w1.json", {
        "meta": {"date": "2026-01-02 10:00 UTC", "commit": "abc1234", "device": "NVIDIA H200 (143,771 MiB)",
                 "command": "python -m nanoserve.bench --workloads W1", "model": "m3-slice"},
        "runs": [{"workload": "W1", "tpot_ms_mean": 1.447, "output_tok_s": 5959.3, "switches": {"x": True}}],
        "weights": {"bf16": {"gib": 46.65, "format": "bf16"}, "mxfp8": {"gib": 26.27, "format": "mxfp8"}},
        "kernels": {"columns": ["tokens", "ms"], "rows": [[4096, 6.283], [16384, 16.856]]},
        "profile": {"table": "Decode step profile\ngroup  us\nMoE    414.0", "groups": {"MoE": {"us": 414.0}}},
    })
    write(tmp_path, "2026-01-05_def5678-0123abc_later.json", {
        "meta": {"date": "2026-01-05", "commits": ["def5678", "0123abc"], "device": "one NVIDIA H200",
                 "command": ["python -m nanoserve.bench --profile W1", "python scripts/tune_gemv.py"]},
        "long": [{"i": i} for i in range(MAX_ROWS + 5)],
    })
    write(tmp_path, "2026-01-03_fedcba9_cpu-run.json", {
        "meta": {"date": "2026-01-03", "commit": "fedcba9", "device": "a 2-core x86_64 CPU (fp32)",
                 "command": "python -m nanoserve.bench --ablate"},
        "note": "one line",
    })
    write(tmp_path, "2026-01-04_1111111_h100.json", {
        "meta": {"date": "2026-01-04", "commit": "1111111", "device": "NVIDIA H100 80GB HBM3",
                 "command": "python -m nanoserve.bench --workloads W2"},
        "bench": {"meta": {"model": "m3-slice", "device": "NVIDIA H100 80GB HBM3", "date": "2026-01-04",
                           "commit": "1111111"},
                  "runs": [{"workload": "W2", "engine": "nanoserve", "mode": "default", "num_requests": 64,
                            "output_tok_s": 4410.5, "ttft_ms": {"p50": 317.2}, "tpot_ms": {"mean": 13.443,
                                                                                         "p99": 14.0},
                            "perf": {}}],
                  "ablations": [], "profiles": [], "serve": [], "errors": [], "notes": []},
    })
    return tmp_path


def test_the_page_has_a_section_per_card_newest_run_first(records):
    page = render(str(records))
    h200, h100, cpu = (page.index(f"## {c}") for c in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "CPU"))
    assert h200 < h100 < cpu
    assert page.index("### later") < page.index("### w1") < h100  # newest first within the H200's section
    assert "| [NVIDIA H200](#nvidia-h200) | 2 |" in page and "| [CPU](#cpu) | 1 |" in page
    first = page[page.index("### w1"):page.index("## NVIDIA H100")]
    assert "2026-01-02 10:00 UTC | NVIDIA H200 (143,771 MiB) | commit `abc1234` | record " \
           "[`results/2026-01-02_abc1234_w1.json`](../results/2026-01-02_abc1234_w1.json)" in first
    assert "```bash\npython -m nanoserve.bench --workloads W1\n```" in first
    assert '<a id="2026-01-02_abc1234_w1"></a>' in page
    later = page[page.index("### later"):page.index("### w1")]
    assert "commit `def5678`, `0123abc`" in later
    assert "python -m nanoserve.bench --profile W1\npython scripts/tune_gemv.py" in later


def test_parts_are_tables_as_the_tools_printed_them(records):
    page = render(str(records))
    w1 = page[page.index("### w1"):page.index("## NVIDIA H100")]
    assert "| workload | tpot_ms_mean | output_tok_s |\n|---|---|---|\n| W1 | 1.447 | 5,959.3 |" in w1
    assert "switches" not in w1  # per-row detail is left out
    assert "|  | gib | format |\n|---|---|---|\n| bf16 | 46.65 | bf16 |\n| mxfp8 | 26.27 | mxfp8 |" in w1
    assert "| tokens | ms |\n|---|---|\n| 4,096 | 6.283 |\n| 16,384 | 16.86 |" in w1
    assert "```text\nDecode step profile\ngroup  us\nMoE    414.0\n```" in w1  # the tool's own table
    later = page[page.index("### later"):page.index("### w1")]
    assert f"| {MAX_ROWS - 1} |" in later and f"| {MAX_ROWS} |" not in later
    assert "(5 rows more in the record)" in later
    h100 = page[page.index("## NVIDIA H100"):page.index("## CPU")]
    assert "m3-slice on NVIDIA H100 80GB HBM3, 2026-01-04, commit 1111111:" in h100
    assert re.search(r"\nW2 +nanoserve +default +64 +4,410 +317.2 +13.443", h100)  # bench/report.py runs_table


def test_cells_keep_the_measured_digits():
    assert [cell(v) for v in (1.447, 5959.34, 10492.0, 226, 0.948, 3.8e-06, True, None, "a|b", [1, 2])] == \
        ["1.447", "5,959.3", "10,492", "226", "0.948", "3.8e-06", "yes", "", "a\\|b", "1, 2"]
    assert card_of("quality: a 2-core CPU; GPU checks: one NVIDIA H100") == "CPU"
    assert card_of("one NVIDIA H100 80GB HBM3") == "NVIDIA H100 80GB HBM3" and card_of("a TPU") == "other"


def test_the_cli_prints_the_page_and_refuses_a_file_that_is_no_record(records, capsys, tmp_path_factory):
    from nanoserve.bench.__main__ import main

    assert main(["--report", str(records)]) == 0
    assert capsys.readouterr().out == render(str(records))
    bad = tmp_path_factory.mktemp("bad")
    write(bad, "notes.json", {"meta": {}})
    assert main(["--report", str(bad)]) == 2
    assert "notes.json: a record is named <date>_<commit(s)>_<what>.json" in capsys.readouterr().out
    (bad / "notes.json").unlink()
    write(bad, "2026-01-01_abc1234_x.json", [1, 2])
    assert main(["--report", str(bad)]) == 2
    assert "a record is a JSON object with a meta object" in capsys.readouterr().out
