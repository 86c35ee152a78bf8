"""One declaration per switch: a switch declared with `switch(...)` in an Optimizations class - and nowhere else -
gets its server flags, its ablation row, its line in the docs table, the bench's kernel probe and its place in
CUDA-graph invalidation. The tests declare throwaway switches on a subclass and look for them in each place."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from nanoserve.config import ENGINE, KERNEL, MODEL, EngineConfig, Optimizations, switch
from tests.project.test_docs import switch_table


@dataclass
class WithExtra(Optimizations):
    """Today's switches plus one throwaway model-side switch, declared the way every switch is."""

    x_demo: bool = switch(True, MODEL, "model/m3.py", "a throwaway switch of the tests", "the model as it is")


@dataclass
class WithExtraKernel(Optimizations):
    x_kernel: bool = switch(True, KERNEL, "kernels/moe.py", "a throwaway kernel switch", "kernels/reference.py",
                            entry_points=("fused_moe", "no_such_kernel"))


def test_declaration_is_a_typed_switch():
    opts = WithExtra()
    assert opts.x_demo is True and opts.fused_moe is True
    assert WithExtra.names()[-1] == "x_demo" and WithExtra.names()[:-1] == Optimizations.names()
    assert "x_demo" in WithExtra.names(MODEL) and "x_demo" not in WithExtra.names(ENGINE, KERNEL)
    assert WithExtra.reference().x_demo is False and WithExtra.reference_kernels().x_demo is True
    assert opts.replace(x_demo=False).x_demo is False
    assert WithExtra.approximations() == Optimizations.approximations()
    with pytest.raises(ValueError, match="x_demo"):
        WithExtra(x_demo="yes")  # type: ignore[arg-type]
    # the vLLM aliases still land on their switches
    cfg = EngineConfig.from_kwargs(enable_prefix_caching=False, enforce_eager=True, optimizations=opts)
    assert not cfg.optimizations.prefix_caching and not cfg.optimizations.cuda_graphs and cfg.optimizations.x_demo


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="approximation must be off"):
        switch(True, MODEL, "model/m3.py", "x", "y", exact=False)
    with pytest.raises(ValueError, match="layer must be one of"):
        switch(True, "scheduler", "engine/scheduler.py", "x", "y")
    with pytest.raises(ValueError, match="entry_points"):
        switch(True, KERNEL, "kernels/moe.py", "x", "y")


def test_server_flags_come_from_the_declaration(monkeypatch):
    from nanoserve.server import __main__ as cli

    monkeypatch.setattr(cli, "Optimizations", WithExtra)
    parser = cli.build_parser()
    helptext = parser.format_help()
    assert "--x-demo, --no-x-demo" in helptext and "a throwaway switch of the tests" in helptext
    for flags, want in (([], True), (["--no-x-demo"], False), (["--x-demo"], True)):
        args = parser.parse_args(flags)
        opts = cli.engine_config(args, parser).optimizations
        assert isinstance(opts, WithExtra) and opts.x_demo is want, flags


def test_docs_table_lists_the_declaration():
    rows = [r for r in switch_table(WithExtra).splitlines() if r.startswith("| `x_demo` |")]
    assert rows == ["| `x_demo` | on | yes | model | [`model/m3.py`](../nanoserve/model/m3.py) | a throwaway switch "
                    "of the tests | the model as it is | not read yet |"]


def test_kernel_probe_reads_the_declared_entry_points():
    from nanoserve.bench.offline import unavailable_kernel_switches

    missing = unavailable_kernel_switches(WithExtraKernel)
    assert missing["x_kernel"] == "nanoserve.kernels.moe has no no_such_kernel"
    del missing["x_kernel"]
    assert missing == unavailable_kernel_switches()  # the declared kernels are probed as before


def test_ablation_and_graph_invalidation_see_the_declaration():
    """A real tiny bench built with the extended switches: the ablation gives the new switch its row, and flipping
    it (a model-side switch) drops the decode graphs while flipping an engine-side one keeps them."""
    from nanoserve.bench import workloads as W
    from nanoserve.bench.ablation import ablate
    from nanoserve.bench.offline import NanoBench

    nb = NanoBench("m3-tiny", "cpu", "float32", WithExtra.reference_kernels(), max_model_len=256, max_num_seqs=4,
                   kv_tokens=1024)
    try:
        wl = W.build(["W1"], 512, "small", prompt_len=12, output_len=2, num_requests=1)[0]
        abl = ablate(nb, wl, {n: "CPU reference kernels" for n in WithExtra.names(KERNEL)}, "m3-tiny",
                     {"device": "cpu"}, warmup_tokens=1)
        rows = {r["switch"]: r for r in abl["rows"] if r["switch"]}
        assert list(rows) == WithExtra.names()
        assert rows["x_demo"]["label"] == "x_demo off" and rows["x_demo"]["identical"]  # run, not skipped
        assert "x_demo" in abl["table"]

        runner = nb.runner
        runner.graph_capture = lambda fn: fn  # emulated capture: the graph plumbing without a GPU
        try:
            assert runner.capture_decode_graphs(20, 1) == 1
            graphs = runner.graphs
            nb.opts.paged_kv = False  # engine side: not baked into a graph
            assert runner._graphs() is graphs
            nb.opts.x_demo = False  # model side: the graphs are stale
            assert runner._graphs() is not graphs
        finally:
            runner.graph_capture, runner.graphs = None, None
            nb.opts.paged_kv, nb.opts.x_demo = True, True
    finally:
        nb.close()
