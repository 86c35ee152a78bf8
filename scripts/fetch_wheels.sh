#!/usr/bin/env bash
# Wheels for a GPU machine that cannot reach the package index: the packages nanoserve needs beyond a CUDA PyTorch
# image (torch, triton, transformers, numpy, tokenizers, safetensors, httpx, click are assumed there), for CPython
# 3.12 on x86-64 Linux, into .whl/ (ignored by git): at the version installed here where a package is installed,
# else the index's newest. scripts/gpu_run.sh installs .whl/*.whl into /tmp/site before it runs anything.
#   bash scripts/fetch_wheels.sh [--python-version 3.12] [extra packages...]
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=3.12
if [ "${1:-}" = "--python-version" ]; then PYV=$2; shift 2; fi
# the engine (structured outputs), the server, the clients the agent session drives, and what they pull in (the
# openai 3.x client talks through httpx2, which the GPU image does not carry); jsonschema and its dependencies,
# which ten test files import, so that `pytest -m gpu` collects every file
PKGS=(xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection
      fastapi starlette uvicorn httptools opentelemetry-api annotated-doc prometheus-client
      openai anthropic distro jiter docstring-parser sniffio
      httpx2 httpcore2 truststore idna anyio h11 certifi typing-extensions
      jsonschema jsonschema-specifications referencing rpds-py attrs "$@")
mkdir -p .whl
for name in "${PKGS[@]}"; do
  # not installed here: pip show fails, which must not end the script (pipefail); the spec is then unpinned
  version=$( (python3 -m pip show "$name" 2>/dev/null || true) | sed -n 's/^Version: //p')
  spec=$name${version:+==$version}
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform any -d .whl "$spec" \
    || { echo "no wheel for $spec" >&2; exit 1; }
done
ls -la .whl
