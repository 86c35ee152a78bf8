"""The agent session (tests/helpers/agent_session.py) on m3-slice on the GPU: a real `python -m nanoserve.server` with
the agent flags, driven by the openai and anthropic SDKs through tool calls, structured outputs under thinking,
thinking_token_budget, the Responses API and the Messages API; every case must pass. Marked `gpu` (m3-slice needs
the Triton kernels; the same session runs on the CPU with
`python -m tests.helpers.agent_session --model m3-tiny --cpu`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def test_agent_session_on_m3_slice(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tests.helpers.agent_session", "--model", "m3-slice", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=540)
    rows = [json.loads(line) for line in (tmp_path / "agent.jsonl").read_text().splitlines() if line.strip()] \
        if (tmp_path / "agent.jsonl").exists() else []
    failed = [r for r in rows if r["result"] != "pass"]
    assert done.returncode == 0 and rows and not failed, (failed or done.stdout[-3000:] + done.stderr[-3000:])
