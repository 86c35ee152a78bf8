"""The compile gate: every Triton launch the engine makes, compiled ahead of time for the AMD and NVIDIA chips
nanoserve serves on, and checked against each chip's limits - on a CPU-only machine.

    python -m scripts.compile_gate            # the CI subset (tests/kernels/test_compile_gate.py runs the same)
    python -m scripts.compile_gate --full     # every recorded launch on every target
    python -m scripts.compile_gate --full --targets gfx950 --workers 2 --list

(scripts/compile_gate.py, run as a module from the repository root.)

The launches come from scripts/compile_gate_launches.py (the m3-slice model's wrappers, recorded on the meta
device with each backend's tile tables). Each is compiled with `triton.compile` for its backend's targets
(TARGETS) and fails the gate on:

- a compile error;
- shared memory (LDS on AMD) over the chip's budget per workgroup. AMD compiles do not refuse oversized LDS (it
  is allocated at launch), so this check is what catches it before a user's launch fails;
- a register spill to memory: on AMD vector-register spills or scratch (private segment) use; on NVIDIA a
  stack frame or local memory in the cubin (`cuobjdump --dump-resource-usage`). Scalar-register spills on AMD
  go to vector-register lanes, not memory, and are reported only. KNOWN_SPILLS lists the spills of today's
  NVIDIA tiles under Triton 3.9, each with why; a new one, a larger one or a listed one that is gone fails.

Compiles run in a pool of worker processes (default 2) and are cached by Triton's own cache, keyed by the
kernel's source, its specialisation, the options and the target: a second run only reads the cache.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

KIB = 1024


@dataclass(frozen=True)
class Target:
    """A chip the gate compiles for."""

    name: str
    backend: str  # "hip" or "cuda": which tile column its launches use
    arch: str | int
    warp_size: int
    shared_budget: int
    """Largest shared memory (LDS) one workgroup may use, bytes."""
    shared_per_cu: int
    """Shared memory (LDS) of one multiprocessor (CU): with the budget, bounds how many workgroups fit at once."""


TARGETS = {
    "gfx942": Target("gfx942", "hip", "gfx942", 64, 64 * KIB, 64 * KIB),  # MI300X / MI325X
    "gfx950": Target("gfx950", "hip", "gfx950", 64, 160 * KIB, 160 * KIB),  # MI355X / MI350X
    "sm_90": Target("sm_90", "cuda", 90, 32, 227 * KIB, 228 * KIB),  # H100 / H200
    "sm_100": Target("sm_100", "cuda", 100, 32, 227 * KIB, 228 * KIB),  # B200
}
SIMDS_PER_CU = 4
"""AMD CDNA: four SIMDs per CU; a workgroup's waves are spread over them."""


@dataclass
class Result:
    """What one compile reports."""

    target: str
    kernel: str
    shared: int = 0
    error: str = ""
    spill_bytes: int = 0
    """NVIDIA: stack frame + local memory per thread; AMD: scratch (private segment) per lane."""
    vgpr_spills: int = 0
    sgpr_spills: int = 0
    registers: int = 0
    """Vector registers (+ accumulation registers on AMD) per lane; registers per thread on NVIDIA."""
    occupancy: int = 0
    """AMD: waves per SIMD, the smaller of the compiler's register-bound figure and what the CU's LDS allows."""
    instructions: frozenset[str] = field(default_factory=frozenset)
    """The instruction mnemonics of the build (AMD GCN assembly, NVIDIA PTX): which hardware paths it uses."""
    seconds: float = 0.0

    def problems(self, budget: int, allowed_spill: int = 0) -> list[str]:
        """What fails the gate: a compile error, shared memory over `budget`, a spill to memory (beyond
        `allowed_spill` bytes: a KNOWN_SPILLS entry)."""
        out = []
        if self.error:
            out.append(f"compile error: {self.error}")
            return out
        if self.shared > budget:
            out.append(f"shared memory {self.shared / KIB:.1f} KiB over the {budget // KIB} KiB budget")
        if self.vgpr_spills or self.spill_bytes > allowed_spill:
            out.append(f"register spills to memory ({self.spill_bytes} bytes, {self.vgpr_spills} vector registers)"
                       + (f"; {allowed_spill} bytes are known (KNOWN_SPILLS)" if allowed_spill else ""))
        return out


KNOWN_SPILLS: dict[tuple[str, str, tuple], tuple[int, str]] = {
    # (target, kernel, constexprs that pick the launch) -> (bytes per thread at most, why). Spills that exist
    # today under the Triton release named by KNOWN_SPILLS_TRITON, each with why: the gate fails on a spill not
    # listed, on a listed one that grew, and on a listed one that is gone (so the list can only shrink). One
    # NVIDIA launch remains, on two targets: its tile was chosen with Triton 3.6 on an H200 or H100, as the fastest
    # measured there, and Triton 3.9's ptxas spills it. It stays until the fp8 tiles are re-measured on a card
    # with Triton 3.9.
    ("sm_90", "_paged_prefill_kernel", (("BLOCK_N", 64), ("TMA", True))): (
        176, "dense prefill over an fp8 KV pool at >= 32k context (paged_prefill_fp8_long, 4 warps): every "
             "faster-measured fp8 tile spills under 3.9, the non-spilling one runs 1.40x slower"),
    ("sm_100", "_paged_prefill_kernel", (("BLOCK_N", 64), ("TMA", True))): (120, "as on sm_90"),
}
KNOWN_SPILLS_TRITON = "3.9."
"""KNOWN_SPILLS hold for this Triton release; under any other every spill fails the gate."""


def known_spill(launch, target: str) -> tuple | None:
    """The KNOWN_SPILLS key that covers this launch on this target, if any (and this Triton is the listed one)."""
    import triton

    if not triton.__version__.startswith(KNOWN_SPILLS_TRITON):
        return None
    consts = launch.named_constexprs()
    for key in KNOWN_SPILLS:
        where, kernel, picks = key
        if where == target and launch.short_name == kernel and all(consts.get(k) == v for k, v in picks):
            return key
    return None


def _amd_field(asm: str, name: str) -> int:
    m = re.search(rf"\.{name}:\s+(\d+)", asm)
    return int(m.group(1)) if m else 0


def _cuda_resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack + local bytes) of the cubin's kernel, from cuobjdump."""
    from triton.backends.nvidia import compiler as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    return int(fields.get("REG", 0)), int(fields.get("STACK", 0)) + int(fields.get("LOCAL", 0))


def compile_launch(launch, target_name: str) -> Result:
    """Compile one recorded launch for one target and read its resources (runs in a worker process)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = TARGETS[target_name]
    module, qualname = launch.kernel.split(":")
    fn = getattr(importlib.import_module(module), qualname)
    result = Result(target_name, launch.kernel)
    start = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(fn, launch.signature, launch.constexprs, launch.attrs),
                                  target=GPUTarget(target.backend, target.arch, target.warp_size),
                                  options=dict(launch.options))
    except Exception as e:  # the gate reports every failure, whatever the compiler raised
        result.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]
        result.seconds = time.perf_counter() - start
        return result
    result.shared = int(compiled.metadata.shared)
    asm = compiled.asm["amdgcn" if target.backend == "hip" else "ptx"]
    result.instructions = frozenset(re.findall(r"^\s+(?:@!?%\w+\s+)?([a-z][\w.:]*)", asm, flags=re.M))
    if target.backend == "hip":
        result.vgpr_spills = _amd_field(asm, "vgpr_spill_count")
        result.sgpr_spills = _amd_field(asm, "sgpr_spill_count")
        result.spill_bytes = _amd_field(asm, "private_segment_fixed_size")
        result.registers = _amd_field(asm, "vgpr_count") + _amd_field(asm, "agpr_count")
        m = re.search(r"; Occupancy: (\d+)", asm)
        by_registers = int(m.group(1)) if m else 0
        warps = int(launch.options.get("num_warps", 4))
        if result.shared:  # workgroups the CU's LDS holds at once, their waves spread over its SIMDs
            by_lds = -(-(target.shared_per_cu // result.shared) * warps // SIMDS_PER_CU)
            result.occupancy = min(by_registers, by_lds)
        else:
            result.occupancy = by_registers
    else:
        result.registers, result.spill_bytes = _cuda_resources(compiled.asm["cubin"])
    result.seconds = time.perf_counter() - start
    return result


def _compile_job(job):
    launch, target = job
    return launch, compile_launch(launch, target)


def _worker_start() -> None:
    # Compile, don't interpret: the kernel modules are imported after this, so @triton.jit makes JITFunctions.
    os.environ.pop("TRITON_INTERPRET", None)


def compile_all(jobs: list[tuple], workers: int = 2) -> Iterator[tuple]:
    """(launch, Result) for each (launch, target) job, compiled in `workers` fresh processes (spawned: no forked
    copy of a parent with torch's threads running, and no TRITON_INTERPRET, which the CPU test run sets)."""
    import multiprocessing

    with ProcessPoolExecutor(max(1, workers), mp_context=multiprocessing.get_context("spawn"),
                             initializer=_worker_start) as pool:
        yield from pool.map(_compile_job, jobs)


# --------------------------------------------------------------------------------------------------------------
# Which launches: all of them, or the CI subset
# --------------------------------------------------------------------------------------------------------------


def shape_class(sharding: str) -> str:
    """The TP-shape class of a recorded sharding: one GPU, or the sharded shapes (TP, TP + EP)."""
    return "tp1" if sharding == "tp1" else "sharded"


def _size(launch) -> tuple:
    """How much a launch asks of the chip, roughly: its tile (the product of its BLOCK_* constexprs) times its
    pipeline stages, then its warps. The subset keeps the largest launch of each class: the one nearest the
    shared-memory and register limits."""
    tile = 1
    for name, value in launch.named_constexprs().items():
        if name.startswith("BLOCK") and isinstance(value, int) and not isinstance(value, bool):
            tile *= max(value, 1)
    stages = int(launch.options.get("num_stages", 1) or 1)
    return tile * stages, int(launch.options.get("num_warps", 4)), repr(launch.key)


def representative(launches: list) -> list:
    """The CI subset: for every (kernel, weight format, TP-shape class) the largest launch (_size), deduplicated
    - every kernel, weight format and shape class the engine launches appears, each with its most demanding
    tile. Deterministic: the same recording gives the same subset."""
    best: dict[tuple, object] = {}
    for launch in launches:
        for weights, sharding, _ in launch.scenarios:
            cls = (launch.kernel, weights, shape_class(sharding))
            if cls not in best or _size(launch) > _size(best[cls]):
                best[cls] = launch
    picked = {id(launch): launch for launch in best.values()}
    return sorted(picked.values(), key=lambda launch: repr(launch.key))


# --------------------------------------------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------------------------------------------


def run_gate(targets: list[str], full: bool = False, workers: int = 2, log=print) -> tuple[list, list[str], dict]:
    """Record, compile and check. Returns ([(launch, Result)], failures: one line per problem, {backend: every
    recorded launch})."""
    from scripts.compile_gate_launches import record_launches

    jobs = []
    recorded = record_launches(sorted({TARGETS[t].backend for t in targets}))
    for backend, launches in recorded.items():
        chosen = launches if full else representative(launches)
        log(f"{backend}: {len(launches)} distinct launches recorded, compiling {len(chosen)}")
        jobs += [(launch, t) for t in targets if TARGETS[t].backend == backend for launch in chosen]
    results, failures = [], []
    start = time.perf_counter()
    spilled: set[tuple] = set()
    for launch, result in compile_all(jobs, workers):
        results.append((launch, result))
        known = known_spill(launch, result.target)
        if known is not None and result.spill_bytes:
            spilled.add(known)
        allowed = KNOWN_SPILLS[known][0] if known is not None else 0
        for problem in result.problems(TARGETS[result.target].shared_budget, allowed):
            failures.append(f"{result.target} {describe(launch)}: {problem}")
    compiled = {known_spill(launch, r.target) for launch, r in results} - {None}
    for gone in sorted(compiled - spilled):
        failures.append(f"{gone[0]} {gone[1]}{dict(gone[2])}: listed in KNOWN_SPILLS but no longer spills: "
                        f"remove the entry")
    log(f"{len(jobs)} compiles in {time.perf_counter() - start:.0f} s, {len(failures)} problems")
    return results, failures, recorded


def describe(launch) -> str:
    """kernel(constexprs, options) in one line: enough to find the launch's tile table entry."""
    consts = ", ".join(f"{k}={v}" for k, v in launch.named_constexprs().items())
    opts = ", ".join(f"{k}={v}" for k, v in sorted(launch.options.items()))
    return f"{launch.short_name}({consts}; {opts})"


def report(results: list) -> str:
    """One line per compile: target, kernel and tile, shared memory, registers, spills, occupancy, seconds."""
    lines = []
    for launch, r in sorted(results, key=lambda lr: (lr[1].target, describe(lr[0]))):
        state = r.error or (f"shared {r.shared / KIB:6.1f} KiB  regs {r.registers:3d}  spill {r.spill_bytes} B"
                            + (f" / {r.vgpr_spills} v / {r.sgpr_spills} s  occupancy {r.occupancy}"
                               if TARGETS[r.target].backend == "hip" else ""))
        lines.append(f"{r.target:7s} {r.seconds:5.1f}s  {state}  {describe(launch)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.compile_gate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="compile every recorded launch (default: the CI subset)")
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, from {', '.join(TARGETS)}")
    ap.add_argument("--workers", type=int, default=2, help="compile processes (default 2)")
    ap.add_argument("--list", action="store_true", help="print one line per compile")
    args = ap.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        ap.error(f"unknown target(s) {unknown}; choose from {', '.join(TARGETS)}")
    results, failures, _ = run_gate(targets, args.full, args.workers)
    if args.list:
        print(report(results))
    for line in failures:
        print("FAIL", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
