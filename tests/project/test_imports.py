"""The import graph of nanoserve/: no cycles, and no arrow from a lower layer to a higher one.

Layers, bottom to top (a module may import its own layer and any lower one):

    kernels  <-  model  <-  presets  <-  runner, spec_decode  <-  executor, distributed  <-  engine  <-  entrypoints
        <-  server, bench, walkthrough (and the `nanoserve` package itself, the public API)

The kernels know nothing of the model; the model loader reads directories and knows nothing of presets; the
runner (one rank's model, KV pools and graphs) knows nothing of scheduling; the executors move a step to one or
many runners; the engine core schedules; the front ends (LLM, AsyncLLMEngine) drive the core; the server, the
bench and the walkthrough sit on top. Neutral top-level modules (config.py, sampling.py, batch.py, step.py,
parallel_state.py) hold what every layer shares; anyone may import them, and they import only each other.
Every import counts, also the ones inside functions: a lazy import still ties the two modules together.

KNOWN_* below list violations that exist today, each with why; the test fails on a new one and also on a listed
one that is gone, so the lists can only shrink.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nanoserve"

LAYER_OF = {  # by the package under nanoserve/
    "kernels": 0,
    "model": 1,
    "multimodal": 1,  # images / video -> patches and placeholder runs (host side), beside the vision model
    "presets": 2,  # the preset catalog and checkpoint maker: above the loader, which must not import them
    "runner": 3,
    "spec_decode": 3,  # drafters and the acceptance rule: the runner may run a drafter beside the model
    "kv_transfer": 3,  # P/D: KV blocks between engines' pools; the runner registers its pools, the engine drives
    "executor": 4, "distributed": 4,
    "engine": 5,
    "entrypoints": 6,
    "parsers": 6, "chat_template": 6, "generation_config": 6,  # the chat surface the server and LLM.chat use
    "server": 7, "bench": 7, "walkthrough": 7, "__init__": 7,
}
LAYER_NAMES = {0: "kernels", 1: "model", 2: "presets", 3: "runner", 4: "executor/distributed", 5: "engine",
               6: "entrypoints", 7: "server/bench/walkthrough"}
NEUTRAL = {"nanoserve.config", "nanoserve.sampling", "nanoserve.batch", "nanoserve.step", "nanoserve.parallel_state",
           "nanoserve.cpu_threads"}

# (importer, imported) -> why: an arrow from a lower layer to a higher one that exists today. None now.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}
# Import cycles that exist today, each as the set of modules of one strongly connected component -> why. None now.
KNOWN_CYCLES: dict[frozenset[str], str] = {}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The nanoserve modules `name` imports (a `from package import submodule` names the submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import nanoserve.x.y` where y is an attribute: the longest module
                t = t.rpartition(".")[0]
            if t.startswith("nanoserve") and t != name:
                out.add(t)
    return out


@functools.lru_cache(maxsize=1)
def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def layer(name: str) -> int | None:
    """The layer of a module (None: neutral)."""
    if name in NEUTRAL:
        return None
    parts = name.split(".")
    key = "__init__" if len(parts) == 1 else parts[1]
    if key not in LAYER_OF:
        raise AssertionError(f"{name}: place nanoserve/{key} in a layer (LAYER_OF in tests/project/test_imports.py) "
                             f"or among the neutral modules")
    return LAYER_OF[key]


def upward_arrows(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    bad = set()
    for src, targets in graph.items():
        for dst in targets:
            ls, ld = layer(src), layer(dst)
            if ls is None and ld is not None:  # a neutral module must stay neutral
                bad.add((src, dst))
            elif ls is not None and ld is not None and ld > ls:
                bad.add((src, dst))
    return bad


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: set[frozenset[str]] = set()
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.add(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


# -- tests --------------------------------------------------------------------------------------------------------
def test_the_graph_sees_real_imports():
    graph = import_graph()
    runner = graph["nanoserve.runner.model_runner"]
    assert "nanoserve.presets.resolve" in runner and "nanoserve.model.m3_config" in runner
    assert "nanoserve.config" in graph["nanoserve.model.m3"]
    assert "nanoserve.kernels.reference" in graph["nanoserve.model.layers.attention"]


def test_the_checks_catch_a_cycle_and_an_upward_arrow():
    graph = {"nanoserve.model.a": {"nanoserve.engine.b"}, "nanoserve.engine.b": {"nanoserve.model.a"},
             "nanoserve.config": {"nanoserve.kernels.c"}, "nanoserve.kernels.c": set()}
    assert cycles(graph) == {frozenset({"nanoserve.model.a", "nanoserve.engine.b"})}
    assert upward_arrows(graph) == {("nanoserve.model.a", "nanoserve.engine.b"),
                                    ("nanoserve.config", "nanoserve.kernels.c")}


def test_no_import_cycles():
    found = cycles(import_graph())
    new = found - set(KNOWN_CYCLES)
    assert not new, "import cycle(s): " + "; ".join(" <-> ".join(sorted(c)) for c in new)
    gone = set(KNOWN_CYCLES) - found
    assert not gone, ("listed cycle(s) no longer exist - remove them from KNOWN_CYCLES: "
                      + "; ".join(" <-> ".join(sorted(c)) for c in gone))


def test_no_arrow_from_a_lower_layer_to_a_higher_one():
    found = upward_arrows(import_graph())
    new = found - set(KNOWN_UPWARD)

    def show(arrows):
        return "; ".join(f"{a} ({LAYER_NAMES.get(layer(a), 'neutral')}) -> {b} ({LAYER_NAMES[layer(b)]})"
                         for a, b in sorted(arrows))

    assert not new, "imports reaching upward: " + show(new)
    gone = set(KNOWN_UPWARD) - found
    assert not gone, "listed arrow(s) no longer exist - remove them from KNOWN_UPWARD: " + show(gone)


def test_the_loader_does_not_import_the_presets():
    graph = import_graph()
    seen, todo = set(), ["nanoserve.model.loader"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    assert not any(m.startswith("nanoserve.presets") for m in seen), sorted(m for m in seen if "presets" in m)


def test_the_engine_core_imports_no_torch():
    """The engine deals in plain lists and token ids: the runner turns logits into tokens behind the executor, so no
    module under nanoserve/engine/ imports torch (nor does nanoserve/step.py, what crosses the boundary)."""
    offenders = []
    for path in [*sorted((PACKAGE / "engine").rglob("*.py")), PACKAGE / "step.py"]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "torch"]
    assert not offenders, offenders
