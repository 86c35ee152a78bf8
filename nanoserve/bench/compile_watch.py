"""Count the Triton kernels built (compiled, or loaded from Triton's disk cache) while a block of code runs.

A timed benchmark run must not build kernels: one first-time build of a long-context tile costs about a second,
and it lands inside the TTFT of whichever request meets that shape first (a W4-128k run whose warm-up stopped at
16k tokens reported 3.85 s instead of 1.71 s). `CompileWatch` records every build through Triton's
`knobs.runtime.jit_post_compile_hook`, chained with any hook already installed and restored on exit, so the
benchmark can report the builds of its timed runs beside their timings.

Triton's CPU interpreter builds nothing (a watch there counts 0); without a Triton that has the hook (before
3.4) `available` is False and the count is None.
"""

from __future__ import annotations

import threading


def _knobs():
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if runtime is not None and hasattr(runtime, "jit_post_compile_hook") else None


class CompileWatch:
    """`with CompileWatch() as w: ...` then `w.count` (None: no hook to watch with) and `w.kernels` (the
    @triton.jit function names built, in order). Watches nest: each sees the builds inside its own block."""

    def __init__(self) -> None:
        self.kernels: list[str] = []
        self._runtime = _knobs()
        self._previous = None
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self._runtime is not None

    @property
    def count(self) -> int | None:
        return len(self.kernels) if self.available else None

    def _hook(self, *args, **kwargs):
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or getattr(getattr(fn, "jit_function", None), "__name__", None) or str(fn)
        with self._lock:
            self.kernels.append(str(name))
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return None

    def __enter__(self) -> "CompileWatch":
        if self._runtime is not None:
            self._previous = self._runtime.jit_post_compile_hook
            self._runtime.jit_post_compile_hook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        if self._runtime is not None:
            self._runtime.jit_post_compile_hook = self._previous
            self._previous = None

    def summary(self, limit: int = 8) -> str:
        """'3 (a x2, b)': the count and the kernels by name, most frequent first."""
        if not self.available:
            return "n/a"
        by_name: dict[str, int] = {}
        for k in self.kernels:
            by_name[k] = by_name.get(k, 0) + 1
        names = sorted(by_name, key=lambda k: -by_name[k])
        parts = [f"{k} x{by_name[k]}" if by_name[k] > 1 else k for k in names[:limit]]
        more = f", +{len(names) - limit} more" if len(names) > limit else ""
        return f"{len(self.kernels)}" + (f" ({', '.join(parts)}{more})" if parts else "")
