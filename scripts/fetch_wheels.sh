#!/usr/bin/env bash
# Wheels for a GPU machine that cannot reach the package index: the packages nanoserve needs beyond a CUDA PyTorch
# image (torch, triton, transformers, numpy, tokenizers, safetensors and what they pull in are assumed there), for
# CPython 3.12 on x86-64 Linux, into .whl/ (ignored by git). scripts/gpu_run.sh installs .whl/*.whl into /tmp/site
# before it runs anything.
#   bash scripts/fetch_wheels.sh [--python-version 3.12] [--dest DIR] [extra packages...]
#
# One consistent set: pip's resolver picks every package and dependency together for the target interpreter
# (`pip download` with dependencies), the packages named below pinned to the version installed here where one is
# (the versions this checkout's tests ran with). Pinning every package on its own to this machine's version, as an
# earlier version of this script did, made sets that do not import (a typing_extensions older than the anyio beside
# it needs). xgrammar is fetched without its dependencies (torch, transformers, triton: the image's), which are
# listed here by hand instead (apache-tvm-ffi, pydantic, typing-extensions).
#
# Then the check: the same versions, for this machine's Python, installed with `pip install --target` into an empty
# directory, which is put first on the path of a fresh interpreter that imports fastapi, uvicorn, the OpenAI
# client and nanoserve's server from it (and fails if any of them comes from elsewhere). The script fails when the
# set does not import.
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=3.12
DEST=.whl
while [ $# -gt 0 ]; do
  case $1 in
    --python-version) PYV=$2; shift 2;;
    --dest) DEST=$2; shift 2;;
    *) break;;
  esac
done
# the engine (structured outputs), the server, the clients the agent session drives; jsonschema, which ten test
# files import, so that `pytest -m gpu` collects every file
PKGS=(fastapi uvicorn httptools prometheus-client openai anthropic jsonschema apache-tvm-ffi pydantic
      typing-extensions "$@")
NO_DEPS=(xgrammar)
PLATFORM=(--only-binary=:all: --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform any)

pinned() {  # name, or name==version when it is installed here (pip show fails otherwise: not an error)
  local version
  version=$( (python3 -m pip show "$1" 2>/dev/null || true) | sed -n 's/^Version: //p')
  echo "$1${version:+==$version}"
}
specs=() no_deps=()
for name in "${PKGS[@]}"; do specs+=("$(pinned "$name")"); done
for name in "${NO_DEPS[@]}"; do no_deps+=("$(pinned "$name")"); done

rm -rf "$DEST" && mkdir -p "$DEST"
python3 -m pip download -q "${PLATFORM[@]}" --python-version "$PYV" -d "$DEST" "${specs[@]}"
python3 -m pip download -q --no-deps "${PLATFORM[@]}" --python-version "$PYV" -d "$DEST" "${no_deps[@]}"
# the image has these: a wheel of them here would shadow the image's (uvicorn pulls in click)
rm -f "$DEST"/click-*.whl
ls -la "$DEST"

# -- the check: the same versions for this machine's Python, in an empty --target directory ---------------------
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
pins=()
for wheel in "$DEST"/*.whl; do  # name-version-...whl -> name==version
  base=$(basename "$wheel")
  pins+=("$(echo "$base" | cut -d- -f1)==$(echo "$base" | cut -d- -f2)")
done
python3 -m pip download -q --no-deps --only-binary=:all: -d "$check/wheels" "${pins[@]}"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$check/site" "$check"/wheels/*.whl
PYTHONPATH="$check/site:$PWD" python3 - "$check/site" <<'EOF'
import importlib
import sys

site = sys.argv[1]
for name in ("typing_extensions", "anyio", "pydantic", "starlette", "fastapi", "uvicorn", "prometheus_client",
             "openai", "anthropic", "xgrammar"):
    module = importlib.import_module(name)
    if not module.__file__.startswith(site):
        sys.exit(f"{name} was imported from {module.__file__}, not from the fetched set")
import nanoserve.server.app  # noqa: E402,F401  (the whole server: FastAPI, uvicorn, the request models)

print(f"the fetched set imports: fastapi, uvicorn, openai and nanoserve.server from {site}")
EOF
