"""`python -m nanoserve.bench --speculative` on the CPU: on an m3-tiny checkpoint with a random MTP module and a
small held-out set, the acceptance report has every drafter's fields (mtp at k=1 and k=3, ngram; eagle3 skipped
with the reason), greedy outputs with speculation equal those without, and the ngram drafter is really accepted
on prompts that repeat themselves; `--speculative cost` times decode, verify and draft steps and computes the
speed-up from them; `--speculative host` times every engine phase of a step without and with speculation."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from nanoserve.bench.speculative import drafters, first_difference

TASKS = {"no_tool": ["one two three one two three one two three one two", "alpha beta gamma alpha beta gamma alpha"],
         "retrieval_1k": ["the key is 4417. the key is 4417. the key is", "red green blue red green blue red green"]}


@pytest.fixture(scope="module")
def trained_dir(tiny_dir, tmp_path_factory) -> str:
    """m3-tiny plus a random MTP module and a held-out set in the layout of a trained model's directory (three
    prompts per task: the limits must drop some)."""
    import shutil

    from safetensors.torch import save_file

    from tests.engine.test_spec_decode import mtp_tensors

    path = tmp_path_factory.mktemp("m3-tiny-heldout")
    shutil.copytree(tiny_dir, path, dirs_exist_ok=True)
    save_file(mtp_tensors(tiny_dir), str(path / "mtp.safetensors"), metadata={"format": "pt"})
    with gzip.open(path / "heldout.jsonl.gz", "wt", encoding="utf-8") as f:
        for task, prompts in TASKS.items():
            for p in prompts + ["an extra prompt that the limit leaves out"]:
                f.write(json.dumps({"task": task, "prompt": p, "expected": {}, "tools": None,
                                    "thinking_mode": None}) + "\n")
    return str(path)


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoserve.bench", *args], capture_output=True, text=True,
                          timeout=540)


def test_acceptance_report_per_drafter_with_identical_greedy_output(trained_dir, tmp_path):
    res = bench("--speculative", "--model", trained_dir, "--spec-limit", "2", "--spec-retrieval-limit", "1",
                "--device", "cpu", "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads((tmp_path / "speculative.json").read_text())
    table = (tmp_path / "speculative.md").read_text()
    assert "mean accepted length" in res.stdout and table.strip() in res.stdout
    assert report["prompts"] == {"no_tool": 2, "retrieval_1k": 1}  # retrieval lengths have their own limit
    assert list(report["drafters"]) == ["ngram k=3", "mtp k=1", "mtp k=3"]
    assert "--spec-eagle3" in report["skipped"]["eagle3 k=3"] and "eagle3 k=3: skipped" in table
    assert report["identical"] is True
    for task in TASKS:
        base = report["baseline"][task]
        assert base["output_tokens"] > 0 and base["tokens_per_s"] > 0 and base["tpot_ms"] > 0
    for d in report["drafters"].values():
        k = d["config"]["num_speculative_tokens"]
        for task, t in d["tasks"].items():
            assert t["identical"] and not t["differences"]
            assert t["output_tokens"] == report["baseline"][task]["output_tokens"]
            assert t["num_drafts"] > 0 and t["num_accepted_tokens"] <= t["num_draft_tokens"] <= k * t["num_drafts"]
            assert t["mean_accepted_length"] == pytest.approx(1 + t["num_accepted_tokens"] / t["num_drafts"])
            per_pos = t["acceptance_per_pos"]
            assert len(per_pos) <= k and all(0 <= p <= 1 for p in per_pos) and per_pos == sorted(per_pos,
                                                                                                  reverse=True)
            assert sum(per_pos) * t["num_drafts"] == pytest.approx(t["num_accepted_tokens"])
            assert t["speedup_tpot"] == pytest.approx(report["baseline"][task]["tpot_ms"] / t["tpot_ms"])
    # the prompts repeat themselves, and so does the random model's greedy output: prompt lookup is accepted
    ngram = report["drafters"]["ngram k=3"]["tasks"]
    assert sum(t["num_accepted_tokens"] for t in ngram.values()) > 0


def test_drafters_the_model_cannot_run_are_skipped_with_the_reason(tiny_dir, trained_dir):
    plain = {name: skip for name, _, skip in drafters(tiny_dir, None)}
    assert plain["ngram k=3"] is None
    assert "no MTP module" in plain["mtp k=1"] and "no MTP module" in plain["mtp k=3"]
    with_mtp = {name: skip for name, _, skip in drafters(trained_dir, "/some/draft")}
    assert "GPU" in with_mtp.pop("mtp k=3, no draft chain")  # (it replays CUDA graphs)
    assert "GPU" in with_mtp.pop("mtp k=3, host in step")  # (so does the async path it is the reference of)
    assert "GPU" in with_mtp.pop("mtp k=3, feed on host")  # (the feed exists only on the async path's graphs)
    assert "GPU" in with_mtp.pop("mtp k=3, 4 steps per launch")  # (a launch of several steps is one graph)
    assert all(skip is None for skip in with_mtp.values())
    assert all(skip is None for _, _, skip in drafters(trained_dir, "/some/draft", device="cuda"))


def test_first_difference_finds_where_outputs_part():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_missing_heldout_set_is_a_clear_error(tiny_dir):
    res = bench("--speculative", "--model", tiny_dir, "--device", "cpu")
    assert res.returncode != 0 and "heldout.jsonl.gz" in res.stderr and "Traceback" not in res.stderr


def test_step_costs_and_the_speedup_they_imply(tmp_path):
    res = bench("--speculative", "cost", "--model", "m3-tiny", "--device", "cpu", "--prompt-len", "40", "--out",
                str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads((tmp_path / "speculative_cost.json").read_text())
    assert report["context"] == 40 and [r["batch"] for r in report["rows"]] == [1, 16]
    for row in report["rows"]:
        for key in ("decode_ms", "decode_eager_ms", "verify_k1_ms", "verify_k3_ms"):
            assert row[key] > 0
        for method in ("ngram", "mtp", "eagle3"):
            assert row[f"draft_{method}_k3_ms"] > 0
    row16 = report["rows"][1]
    at = {(s["batch"], s["k"], s["drafter"], s["mean_accepted_length"]): s["speedup"] for s in report["speedups"]}
    assert at[(16, 3, "eagle3", 2.7)] == pytest.approx(
        2.7 * row16["decode_ms"] / (row16["verify_k3_ms"] + row16["draft_eagle3_k3_ms"]))
    assert {(b, length) for b, k, _, length in at if k == 3} == {(1, 2.7), (1, 3.5), (16, 2.7), (16, 3.5)}
    assert "| 16 | 3 | 3.5 |" in res.stdout


def test_host_time_per_phase_of_a_speculative_step(trained_dir):
    import torch

    from nanoserve.bench.session import resolve_switches
    from nanoserve.bench.speculative_host import PHASE_SOURCES, PHASES, measure_host

    opts, _ = resolve_switches(torch.device("cpu"), True, {})  # the bench's CPU switches: the reference kernels
    report = measure_host(trained_dir, "cpu", "auto", limit=2, optimizations=opts)
    assert report["prompts"] == {"no_tool": 2}  # the chat tasks only: no retrieval prompt
    assert list(report["configs"]) == ["no speculation", "ngram k=3", "mtp k=3"]
    assert list(report["skipped"]) == [  # (graphs: a GPU)
        "mtp k=3, host in step", "mtp k=3, no draft chain", "mtp k=3, feed on host", "mtp k=3, 4 steps per launch"]
    assert report["identical"] is True and report["differences"] == []
    plain = {"launch", "schedule", "execute_model", "masks", "sample_tokens", "update", "result", "outputs"}
    expected = {"no speculation": plain, "ngram k=3": plain | {"propose"}, "mtp k=3": set(PHASES)}
    for name, c in report["configs"].items():
        assert set(c["phases"]) == expected[name], name
        assert all(ph["calls"] > 0 and ph["ms_per_step"] >= 0 for ph in c["phases"].values()), name
        assert c["steps"] == c["phases"]["execute_model"]["calls"] > 0 and c["engine_steps"] >= c["steps"]
        # each phase's time is inside step's, and the phases step calls directly do not overlap
        direct = sum(ph["ms_per_step"] for ph in c["phases"].values() if ph["within"] == "step")
        assert c["other_ms_per_step"] == pytest.approx(c["step_ms_per_step"] - direct)
        assert c["other_ms_per_step"] >= -1e-6 and c["outside_step_ms_per_step"] >= -1e-6
        assert c["ms_per_token"] == pytest.approx(c["step_ms_per_step"] * c["steps"] / c["output_tokens"])
        assert c["tokens_per_step"] == pytest.approx(c["output_tokens"] / c["steps"])
    within = {"launch": "step", "update": "step", "outputs": "step", "schedule": "launch", "execute_model": "launch",
              "masks": "launch", "sample_tokens": "launch", "result": "update", "propose": "result",
              "propose_drafts": "propose"}
    assert {p: ph["within"] for p, ph in report["configs"]["mtp k=3"]["phases"].items()} == within
    base = report["configs"]["no speculation"]
    assert base["tokens_per_step"] == pytest.approx(1.0) and base["mean_accepted_length"] is None
    outputs = {c["output_tokens"] for c in report["configs"].values()}
    assert len(outputs) == 1  # the same greedy tokens
    for name in ("ngram k=3", "mtp k=3"):
        c = report["configs"][name]
        assert c["num_drafts"] > 0 and 1 <= c["mean_accepted_length"] <= 4
        assert c["tokens_per_step"] >= 1
    # the prompts repeat themselves, and so does the random model's greedy output: prompt lookup is accepted, so a
    # step yields more than one token
    assert report["configs"]["ngram k=3"]["tokens_per_step"] > 1
    for p in PHASES:
        assert PHASE_SOURCES[p] in report["table"]
    for row in ("other", "**step**", "tokens / step", "**ms / token**", "mean accepted length"):
        assert f"| {row}" in report["table"]


def test_host_command_writes_its_report(tiny_dir, trained_dir, tmp_path):
    res = bench("--speculative", "host", "--model", trained_dir, "--spec-limit", "1", "--device", "cpu", "--out",
                str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads((tmp_path / "speculative_host.json").read_text())
    table = (tmp_path / "speculative_host.md").read_text()
    assert table.strip() in res.stdout and "| **ms / token**" in table
    assert report["prompts"] == {"no_tool": 1} and list(report["configs"]) == ["no speculation", "ngram k=3",
                                                                               "mtp k=3"]
    assert report["identical"] is True and "environment" in report
    from nanoserve.bench.speculative_host import configurations

    assert "no MTP module" in dict((n, skip) for n, _, skip in configurations(tiny_dir))["mtp k=3"]
    res = bench("--speculative", "host", "--model", tiny_dir, "--device", "cpu")  # no held-out set
    assert res.returncode != 0 and "heldout.jsonl.gz" in res.stderr and "Traceback" not in res.stderr


def test_the_m3_projection_scales_the_measured_steps():
    """The released M3's projected steps: the measured ones scaled to 60 layers, MXFP8's bytes and the TP ranks,
    plus two all-reduces per layer; the speed-up is L x decode / (verify + draft)."""
    from nanoserve.bench.speculative_cost import AR_LATENCY_US, MXFP8_BYTES_SHARE, project_m3

    row = {"batch": 1, "decode_ms": 2.0, "verify_k3_ms": 3.0, "draft_mtp_k3_ms": 4.0}
    [s] = project_m3([row], model_layers=4, tps=(8,), lengths=(2.5,))
    ar = 2 * AR_LATENCY_US / 1e3
    decode = 2.0 * 15 * MXFP8_BYTES_SHARE / 8 + 60 * ar
    verify = 3.0 * 15 * MXFP8_BYTES_SHARE / 8 + 60 * ar
    draft = 4.0 * MXFP8_BYTES_SHARE / 8 + 3 * ar
    assert (s["decode_ms"], s["verify_ms"], s["draft_ms"]) == pytest.approx((decode, verify, draft))
    assert s["speedup"] == pytest.approx(2.5 * decode / (verify + draft))
