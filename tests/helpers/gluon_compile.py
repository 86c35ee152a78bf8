"""Compile a Gluon kernel for Hopper (sm_90) ahead of time, on the CPU, in a fresh Python process.

A fresh process because Triton's interpreter, once a test has run an interpreted kernel that calls a @triton.jit
helper (TRITON_INTERPRET=1), leaves triton.language patched with its own builder for the rest of the process, and
a Gluon compile in that process then fails inside tl.cdiv. The CPU tests run interpreted kernels in any order
(pytest-xdist), so the compile tests must not share their process.

`compile_for_hopper` returns the compiled kernel's shared memory in bytes and its PTX.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HOPPER_SHARED_BYTES = 232_448
"""Shared memory one H100/H200 block may use (227 KB): what a compiled kernel must fit."""

_SCRIPT = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

spec = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
GL_TYPES = {"bf16": gl.bfloat16, "fp8e4nv": gl.float8e4nv}


def descriptor(dtype, shape):
    return f"tensordesc<{dtype}{shape},{gl.NVMMASharedLayout.get_default_for(shape, GL_TYPES[dtype])!r}>"


types = {n: descriptor(*t) if isinstance(t, list) else t for n, t in spec["types"].items()}
constexprs = spec["constexprs"]
names = fn.arg_names
signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
           if n.endswith("_ptr") or n in spec["aligned"]}
compiled = triton.compile(
    GluonASTSource(fn, signature, {(names.index(k),): v for k, v in constexprs.items()}, aligned),
    target=GPUTarget("cuda", 90, 32), options=dict(num_warps=constexprs.get("num_warps", 4)))
assert compiled.asm["cubin"]
print(json.dumps({"shared": compiled.metadata.shared, "ptx": compiled.asm["ptx"]}))
"""


def compile_for_hopper(module: str, kernel: str, constexprs: dict, types: dict,
                       aligned: tuple[str, ...] = ()) -> dict:
    """Compile `module.kernel` for sm_90. `types`: the non-i32 arguments' Triton types, a tensor descriptor as
    [dtype, block shape] ("bf16" or "fp8e4nv"); `aligned`: integer arguments (besides *_ptr) known to be multiples
    of 16. Returns {"shared": bytes, "ptx": text}; fails the test with the compiler's message on an error."""
    spec = {"module": module, "kernel": kernel, "constexprs": constexprs, "types": types, "aligned": list(aligned)}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(spec)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, f"compiling {kernel} for sm_90 failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])
