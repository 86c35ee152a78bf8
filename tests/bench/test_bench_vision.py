"""`python -m nanoserve.bench --vision` on the CPU (m3-tiny-vl): the image sizes' token counts, the encoder's time
counted per request, the TPOT batch's prompts carrying their image tokens, and its control: text prompts as long."""

from __future__ import annotations

import json
import subprocess
import sys


def test_vision_bench_reports_each_size_and_both_batches(tmp_path):
    out = tmp_path / "vision"
    cmd = [sys.executable, "-m", "nanoserve.bench", "--vision", "--vision-sizes", "224,448,1344", "--vision-repeats",
           "1", "--vision-concurrency", "2", "--prompt-len", "40", "--output-len", "4", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| 448 x 448 | 256 |" in done.stdout  # the table is printed
    report = json.loads((out / "vision.json").read_text())
    assert report["model"] == "m3-tiny-vl"
    # 28 px per merged token; at most 672 x 672 (576 tokens) by default, so 1344 px is resized to that
    assert [(r["size"], r["image_tokens"]) for r in report["ttft"]] == [(224, 64), (448, 256), (1344, 576)]
    assert all(r["encoder_ms"] > 0 and r["ttft_ms"] > r["encoder_ms"] for r in report["ttft"])
    text, image, matched = report["tpot"].values()
    assert image["prompt_tokens_mean"] - text["prompt_tokens_mean"] >= 576  # the image's tokens (and its markers)
    assert report["tpot_ratio"] == image["tpot_ms_mean"] / text["tpot_ms_mean"] > 0
    # the control: text only, as long as the image requests' prompts (within a few filler words' tokens)
    assert list(report["tpot"])[2] == "text only, as long as the image prompts"
    assert abs(matched["prompt_tokens_mean"] - image["prompt_tokens_mean"]) <= 8, (matched, image)
    assert report["tpot_ratio_length_matched"] == image["tpot_ms_mean"] / matched["tpot_ms_mean"] > 0
    assert "against text requests as long:" in done.stdout
    assert (out / "vision.md").read_text().startswith("## Images through the engine: m3-tiny-vl")
