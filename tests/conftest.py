"""Shared test setup: Triton's CPU interpreter, deterministic torch, a session-wide m3-tiny checkpoint, the `gpu`
marker (a test marked `gpu` is skipped where torch sees no CUDA/HIP device; `pytest -m gpu` runs them all on a GPU
machine), and a served m3-tiny for the server tests: `engine` -> `app` -> `server` -> `client`, one of each per
test module. A module that needs another setup overrides the fixture it changes (e.g. its own `engine` with other
limits); the ones after it follow."""

from __future__ import annotations

import os

import torch

# Triton picks interpreter vs compiler when a kernel is decorated, so this must precede any kernel import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# m3-tiny's ops are tiny: one thread avoids OpenMP synchronisation that costs more than the math (and
# thrashes when the 2-core CI machine is busy).
torch.set_num_threads(1)
os.environ.setdefault("NANOSERVE_CPU_THREADS", "1")  # the same for LLM and for server processes the tests start


def pytest_collection_modifyitems(config, items):
    """Skip the tests marked `gpu` on a machine without a GPU (they check compiled kernels, CUDA graphs and
    real-width models that the CPU cannot run)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA/HIP device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernel tests run: the GPU when there is one (compiled Triton), else the CPU (Triton's interpreter,
    chosen above). Inputs are drawn on the CPU from seeded generators, then moved here with everything else the
    kernel and its reference read: a tensor left on the CPU fails a GPU launch."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """An m3-tiny checkpoint directory (real key names, bf16, tokenizer), written once per test session."""
    from nanoserve.presets.catalog import get_preset
    from nanoserve.presets.make_checkpoint import write_checkpoint

    preset = get_preset("m3-tiny")
    path = str(tmp_path_factory.mktemp("m3-tiny"))
    write_checkpoint(path, preset.config, preset)
    return path


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory) -> str:
    """An m3-tiny-vl checkpoint directory (m3-tiny with a tiny random vision tower and the image markers in its
    tokenizer), written once per test session."""
    from nanoserve.presets.catalog import get_preset
    from nanoserve.presets.make_checkpoint import write_checkpoint

    preset = get_preset("m3-tiny-vl")
    path = str(tmp_path_factory.mktemp("m3-tiny-vl"))
    write_checkpoint(path, preset.config, preset)
    return path


@pytest.fixture(scope="session")
def mtp_dir(tiny_dir, tmp_path_factory) -> str:
    """The m3-tiny checkpoint plus a random MTP module in a second safetensors file (no index file, so the loader
    must find the module's tensors by reading every file), written once per test session."""
    import shutil

    from safetensors.torch import save_file

    from tests.engine.test_spec_decode import mtp_tensors

    path = tmp_path_factory.mktemp("m3-tiny-mtp")
    shutil.copytree(tiny_dir, path, dirs_exist_ok=True)
    assert not (path / "model.safetensors.index.json").exists()
    save_file(mtp_tensors(tiny_dir), str(path / "mtp.safetensors"), metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="session")
def tiny_hf(tiny_dir):
    """transformers' MiniMaxM3VLForCausalLM holding the `tiny_dir` weights (fp32, eval): the parity oracle.
    Shared by the whole session; do not modify it. See tests/helpers/hf_oracle.py to load other directories."""
    from tests.helpers.hf_oracle import load_hf_oracle

    return load_hf_oracle(tiny_dir)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_dir):
    """m3-tiny's tokenizer (transformers) with this repository's chat template, one per test module."""
    from pathlib import Path

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.chat_template = (Path(__file__).resolve().parent.parent / "nanoserve" / "presets" / "chat_template.jinja"
                         ).read_text()
    return tok


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Presets generated on first use go to a per-session directory, not the user's ~/.cache."""
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path_factory.getbasetemp() / "nanoserve-cache"))


# -- a served m3-tiny (one per test module) -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_dir):
    """An AsyncLLMEngine on the m3-tiny checkpoint with the server tests' fast CPU setup
    (tests/server_utils.engine_config)."""
    from nanoserve.entrypoints.async_engine import AsyncLLMEngine
    from tests.helpers.server_utils import engine_config

    return AsyncLLMEngine.from_config(engine_config(tiny_dir))


@pytest.fixture(scope="module")
def app(engine):
    """The server's app around `engine`, serving it as tests/server_utils.SERVED_MODEL."""
    from nanoserve.server import build_app
    from tests.helpers.server_utils import SERVED_MODEL

    return build_app(engine, SERVED_MODEL)


@pytest.fixture(scope="module")
def server(app):
    """`app` on a real uvicorn server on a loopback port (tests/server_utils.ServerThread)."""
    from tests.helpers.server_utils import ServerThread

    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    """The openai client of `server`."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
