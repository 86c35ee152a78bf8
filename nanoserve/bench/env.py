"""What every result records about where it was measured: commit, device, library versions, date."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git_commit() -> str:
    """HEAD of the repository (with -dirty when the tree has changes), $NANOSERVE_GIT_COMMIT, or 'unknown'."""
    env = os.environ.get("NANOSERVE_GIT_COMMIT")
    if env:
        return env
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001 - no git, not a checkout: still benchmark
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, " \
           f"{torch.get_num_threads()} torch threads)"


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001
        return None


def environment(device: torch.device) -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "commit": git_commit(),
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "host": platform.node(),
    }
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
        info["hip"] = getattr(torch.version, "hip", None)
        info["num_gpus"] = torch.cuda.device_count()
    return info


def tuning_record(entries: dict, **recorded) -> dict:
    """A provenance record of a tuned tile table (kernels/tuned) for entries chosen by this process on the current
    CUDA device: card, versions, the command line, the commit (`git_commit`; null where it is unknown), today's
    date (UTC), then `recorded` (times, notes)."""
    commit = git_commit()
    return {"entries": entries, "card": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": _version("triton"), "command": " ".join(["python", *sys.argv]),
            "commit": None if commit == "unknown" else commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), **recorded}
