"""`python -m nanoserve.bench --compare BASE NEW` and scripts/gpu_run.sh's baseline step: two real bench runs on the
CPU (m3-tiny, W1), one of them altered where a test needs known ratios."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from nanoserve.bench import compare

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(*args: str, cwd: str = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoserve.bench", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def w1_run(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("bench") / "w1")
    proc = _bench("--workloads", "W1", "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _altered(src: str, dst: str, **scale: float) -> str:
    """A copy of a bench --out directory whose first run's metrics are multiplied by `scale` (field -> factor)."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "results.json")
    with open(path) as f:
        data = json.load(f)
    run = data["runs"][0]
    for field, factor in scale.items():
        if field == "output_tok_s":
            run[field] *= factor
        else:
            run[field] = {k: v * factor if isinstance(v, float) else v for k, v in run[field].items()}
    with open(path, "w") as f:
        json.dump(data, f)
    return dst


def test_compare_gives_each_metric_ratio_and_the_verdict(w1_run, tmp_path):
    slower = _altered(w1_run, str(tmp_path / "slower"), output_tok_s=0.9, tpot_ms=1.25)
    proc = _bench("--compare", w1_run, slower, "--out", str(tmp_path / "cmp"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0.900x" in proc.stdout and "1.250x" in proc.stdout
    res = json.load(open(tmp_path / "cmp" / "compare.json"))
    (row,) = res["rows"]
    assert row["run"] == "W1" and row["verdict"] == "slower"
    assert row["output_tok_s"]["ratio"] == pytest.approx(0.9)
    assert row["tpot_ms.mean"]["ratio"] == pytest.approx(1.25)
    assert row["ttft_ms.p50"]["ratio"] == pytest.approx(1.0)
    assert not res["cards_differ"]

    proc = _bench("--compare", w1_run, slower, "--compare-tolerance", "0.5")  # the flag reaches the comparison
    assert proc.returncode == 0 and "level" in proc.stdout and "within 50%" in proc.stdout
    proc = _bench("--compare", w1_run, str(tmp_path / "missing"))
    assert proc.returncode == 2 and "no such file" in proc.stdout and "Traceback" not in proc.stderr

    faster = _altered(w1_run, str(tmp_path / "faster"), tpot_ms=0.8)
    res = _compare_json(w1_run, faster, tmp_path / "cmp2")
    assert res["rows"][0]["verdict"] == "faster"
    # within the tolerance: level; a tighter tolerance makes the same pair a change
    near = _altered(w1_run, str(tmp_path / "near"), output_tok_s=0.98)
    assert _compare_json(w1_run, near, tmp_path / "cmp3")["rows"][0]["verdict"] == "level"
    assert _compare_json(w1_run, near, tmp_path / "cmp4", tolerance=0.01)["rows"][0]["verdict"] == "slower"


def _compare_json(base: str, new: str, out, tolerance: float = compare.DEFAULT_TOLERANCE) -> dict:
    """The comparison as the CLI writes it, run in-process (the CLI itself: the first test)."""
    assert compare.run(base, new, tolerance=tolerance, out=str(out)) == 0
    return json.load(open(os.path.join(out, "compare.json")))


def test_compare_pairs_runs_by_folder_and_names_the_unpaired(w1_run, tmp_path):
    # the layout of --quantization bf16,mxfp8: one folder per format
    base, new = tmp_path / "base", tmp_path / "new"
    for fmt in ("bf16", "mxfp8"):
        shutil.copytree(w1_run, base / fmt)
    shutil.copytree(w1_run, new / "bf16")
    res = _compare_json(str(base), str(new), tmp_path / "cmp")
    verdicts = {r["run"]: r["verdict"] for r in res["rows"]}
    assert verdicts == {"bf16/W1": "level", "mxfp8/W1": "only in base"}


def test_compare_says_when_the_cards_differ(w1_run, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(w1_run, other)
    path = other / "results.json"
    data = json.load(open(path))
    data["meta"]["device"] = "NVIDIA H200"
    json.dump(data, open(path, "w"))
    assert compare.run(w1_run, str(other)) == 0
    assert "different cards" in capsys.readouterr().out


@pytest.mark.parametrize("make", ["missing", "empty_dir", "not_json", "not_results"])
def test_compare_refuses_a_path_without_results(w1_run, tmp_path, make, capsys):
    bad = tmp_path / "bad"
    if make == "empty_dir":
        bad.mkdir()
    elif make == "not_json":
        bad.write_text("{not json")
    elif make == "not_results":
        bad.write_text(json.dumps({"meta": {}}))
    assert compare.run(w1_run, str(bad)) == 2
    out = capsys.readouterr().out
    assert out.startswith("--compare: ") and str(bad) in out


def test_gpu_run_baseline_step_runs_the_bench_in_the_baseline_checkout_and_compares(tmp_path):
    """The bench step, then the same command from the baseline checkout (the repository itself stands in for it;
    on the CPU the bench runs m3-tiny), then the comparison. With `--quantization a,b` the baseline side builds
    one format per process (an older commit would hold both models at once), into the per-format folders the
    bench step writes, so the formats still pair up."""
    out, empty = tmp_path / "out", tmp_path / "no_wheels"
    empty.mkdir()
    env = dict(os.environ, OUT=str(out), STEPS="bench,baseline", BUDGET="200",
               BENCH_ARGS="--workloads W1 --quantization=mxfp8,bf16", BASE_DIR=REPO, BASE_COMMIT="base0000",
               WHEELS=str(empty), NANOSERVE_GIT_COMMIT="new0000")
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_run.sh")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "baseline exit 0" in proc.stdout, proc.stdout + proc.stderr
    res = json.load(open(out / "compare.json"))
    assert sorted(r["run"] for r in res["rows"]) == ["bf16/W1", "mxfp8/W1"]
    assert "base0000" in res["base"] and "new0000" in res["new"]
    log = (out / "baseline.txt").read_text()
    assert log.count("nanoserve bench | m3-tiny") >= 2 and "Weight formats side by side" not in log
    for fmt in ("bf16", "mxfp8"):
        meta = json.load(open(out / "baseline" / fmt / "results.json"))["meta"]
        assert meta["commit"] == "base0000"
