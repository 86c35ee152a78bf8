#!/usr/bin/env bash
# The packages scripts/gpu_pd.sh needs on a GPU machine that cannot reach the package index, for CPython 3.12 on
# x86-64 Linux, packed small enough to travel with the checkout (a call of the GPU tool carries at most 64 MiB,
# the checkout's ~25 MB included): scripts/fetch_wheels.sh's set (the server's packages), NIXL (nixl, nixl-cu13),
# pyzmq and msgpack (the transfer and its side channel), and vllm-router with what its launcher imports.
#
#   bash scripts/pd_bundle.sh [--dest .pd]
#
# Writes $DEST/pd-a.tar.xz and, when everything does not fit one call, $DEST/pd-b.tar.xz (vllm-router and its
# own packages): unpacked, each is a site directory (tar xJf FILE -C /tmp/site; PYTHONPATH=/tmp/site). NIXL's
# wheel is 59 MB, mostly what this run does not load: its expert-parallel package (nixl_ep_cu13), headers, and
# every backend plugin but UCX with the libraries only they need. Those are left out, the rest kept as the wheel
# has it; the script then checks that the kept set imports and starts a UCX agent. Versions are the ones installed
# here where one is (the versions this checkout's tests ran with), the newest for the router launcher's own.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.pd
[ "${1:-}" = --dest ] && DEST=$2
BUDGET=$(( 64 * 1024 * 1024 - $(git ls-files -z | xargs -0 cat | wc -c) - 2 * 1024 * 1024 ))  # 2 MiB to spare
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
PLATFORM=(--only-binary=:all: --implementation cp --python-version 3.12
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any)
pinned() {
  local version
  version=$( (python3 -m pip show "$1" 2>/dev/null || true) | sed -n 's/^Version: //p')
  echo "$1${version:+==$version}"
}

# the server's set, then the P/D packages (no dependencies: they are named here, their dependencies are in the set)
bash scripts/fetch_wheels.sh --dest "$work/wheels" > "$work/fetch.log" 2>&1 || { cat "$work/fetch.log"; exit 1; }
rm -f "$work"/wheels/openai-*.whl "$work"/wheels/anthropic-*.whl  # clients: not what the servers need
ROUTER=(vllm-router setproctitle orjson aiohttp aiohappyeyeballs aiosignal frozenlist multidict propcache yarl)
specs=()
for name in nixl nixl-cu13 pyzmq msgpack vllm-router; do specs+=("$(pinned "$name")"); done
python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$work/wheels" "${specs[@]}"
# the router launcher's packages: their newest (this machine's may have no wheel for 3.12)
python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$work/wheels" "${ROUTER[@]:1}"

# unpack: the router's packages apart
mkdir -p "$work/a" "$work/b"
for wheel in "$work"/wheels/*.whl; do
  name=$(basename "$wheel" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')
  side=a
  for r in "${ROUTER[@]}"; do [ "$name" = "$(echo "$r" | tr - _)" ] && side=b; done
  unzip -q -o "$wheel" -d "$work/$side"
done

# NIXL: only what a UCX agent loads
site=$work/a
rm -rf "$site"/nixl_ep* "$site"/nixl_cu13-*.data "$site"/nixl_cu13.scripts
find "$site/.nixl_cu13.mesonpy.libs/plugins" -name 'libplugin_*.so' ! -name 'libplugin_UCX.so' -delete
find "$site/nixl_cu13.libs/nixl" -type f ! -name 'libplugin_UCX.so' -delete 2>/dev/null || true
find "$site/nixl_cu13.libs/ucx" -type f \( -name '*_ib*' -o -name '*perftest*' -o -name '*.la' \) -delete
python3 - "$site" <<'EOF'
"""Drop the libraries of nixl_cu13.libs that nothing kept needs (the removed plugins' cloud and RDMA stacks)."""
import os
import subprocess
import sys

site = sys.argv[1]
libs = os.path.join(site, "nixl_cu13.libs")
bundled = {f for f in os.listdir(libs) if os.path.isfile(os.path.join(libs, f))}
roots = [os.path.join(d, f) for d in (site, libs) for d, _, files in os.walk(d) for f in files
         if ".so" in f and not (d == libs and f in bundled)]
keep, todo = set(), roots
while todo:
    elf = subprocess.run(["readelf", "-d", todo.pop()], capture_output=True, text=True).stdout
    for line in elf.splitlines():
        if "(NEEDED)" in line:
            lib = line.split("[", 1)[1].split("]", 1)[0]
            if lib in bundled and lib not in keep:
                keep.add(lib)
                todo.append(os.path.join(libs, lib))
for lib in bundled - keep:
    os.remove(os.path.join(libs, lib))
print(f"nixl_cu13.libs: kept {len(keep)} of {len(bundled)} libraries")
EOF
find "$work/a" "$work/b" -name __pycache__ -prune -exec rm -rf {} +

# the check, with this machine's interpreter where it is 3.12 (the .so files are built for it)
if python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  UCX_TLS=tcp PYTHONPATH="$work/a:$work/b" python3 -c "
import torch
from nanoserve.kv_transfer.transfer import KVTransferAgent
a = KVTransferAgent('check', [torch.zeros(4, 16)]); a.shutdown()
import vllm_router.launch_router, zmq, msgpack
print('the bundle imports: nixl (a UCX agent started), vllm_router, zmq, msgpack')"
else
  echo "(not checked here: this python is not 3.12)"
fi

mkdir -p "$DEST"
rm -f "$DEST"/pd-a.tar.xz "$DEST"/pd-b.tar.xz
tar cf - -C "$work/a" . -C "$work/b" . | xz -6 -T0 > "$DEST/pd-a.tar.xz"
if [ "$(stat -c %s "$DEST/pd-a.tar.xz")" -gt "$BUDGET" ]; then  # two calls: a first, b with the run
  tar cf - -C "$work/a" . | xz -6 -T0 > "$DEST/pd-a.tar.xz"
  tar cf - -C "$work/b" . | xz -6 -T0 > "$DEST/pd-b.tar.xz"
fi
ls -la "$DEST"
for f in "$DEST"/pd-*.tar.xz; do
  [ "$(stat -c %s "$f")" -le "$BUDGET" ] || { echo "$f is over the $BUDGET bytes a call can carry beside the checkout" >&2; exit 1; }
done
