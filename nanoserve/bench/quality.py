"""What a model can do, measured: held-out requests graded against the targets, held-out perplexity per corpus.

    python -m nanoserve.bench --quality                      # m3-mini on the CPU, about half an hour
    python -m nanoserve.bench --quality --quality-limit 10 --quality-retrieval-limit 2   # a few minutes
    python -m nanoserve.bench --quality --ablate             # + what each approximation costs (below)

The held-out requests (nanoserve/bench/heldout/: written by a generator of their own, frozen as data, seen by no
training code) are answered greedily through `LLM.chat` - the server's rendering of the messages, the tools and
the thinking mode - and read as a client reads the server's answer (the reasoning and tool-call parsers), then
graded (heldout/grade.py): tool calls exact, no call where none is needed, calls to tools that were not offered
(with the `constrained_tool_calls` switch on and off, where the build has it), a tool's result used in the answer,
answers read from a passage in the prompt, arithmetic with and without thinking, retrieval at 8k and 16k tokens,
honest replies to what the model cannot know; and, for a model with a vision tower, picture questions (digits, a
word, shapes counted, a sum, a bar chart: heldout/pictures.jsonl.gz, held out by seed). The table shows each target,
the measurement and the shipped weights' own (heldout/shipped.json).

    ppl <corpus>          perplexity of the held-out text of each training corpus (heldout/text.jsonl.gz, the
                          first --quality-text-tokens tokens per corpus, in windows of 512)
    ppl <corpus> past N   the same text in windows of 4,096 tokens, counting only positions past MSA's top-k x
                          block size N: the predictions made from a selection of blocks

`--ablate` grades the model directory's own held-out set (`heldout.jsonl.gz`: prompts of the training generator
from other seeds, rendered through the chat template; `evaluate` below) with each approximation switch on in
turn:

    arith           the reasoning parser splits thinking from the answer; the answer holds the right number
    tool            the minimax_m3 tool parser finds a call: right tool name, arguments equal to the expected values
    no_tool         tools were offered but the question needs none: no call, and an answer
    thinking        every answer above is well-formed: ended by EOS, one closed thinking block at most
    retrieval_Nk    a pass key hidden in N thousand tokens of filler is read back (MSA really drops blocks there)

`selection` runs those retrieval prompts and the long-window perplexity again with MSA's block choice replaced:
`local` keeps the query's newest blocks, `random` the own block plus random earlier ones; the gap to `learned` is
what the indexer is worth.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from nanoserve.bench.heldout.evaluate import CONSTRAINT, HeldoutReport, evaluate_pictures, select_rows, target_table
from nanoserve.bench.heldout.evaluate import evaluate as evaluate_heldout

TASK_TOKENS = {"arith": 200, "tool": 120, "no_tool": 200}
"""max_tokens per task: no-tool questions include sums, whose scratchpad needs arithmetic's budget."""
LONG_WINDOW = 4096
"""Window of the long-context perplexity: past MSA's top-k x block size, so that blocks are really dropped."""
RETRIEVAL_TOKENS = 24


@dataclass
class QualityReport:
    """Accuracy per task (fraction correct, with the count), perplexity per corpus."""

    accuracy: dict[str, tuple[float, int]] = field(default_factory=dict)
    perplexity: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"accuracy": {k: {"value": v, "n": n} for k, (v, n) in self.accuracy.items()},
                "perplexity": self.perplexity}


def heldout_rows(model_dir: str, limit: int | None, retrieval_limit: int | None = None,
                 flag: str = "--quality") -> list[dict]:
    """The held-out prompts in file order, at most `limit` per task (`retrieval_limit` per retrieval length: a
    long prompt's prefill is what costs time on a CPU). `flag` names the command in the error for a model
    without a held-out set."""
    path = os.path.join(model_dir, "heldout.jsonl.gz")
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: {model_dir} has no held-out set (heldout.jsonl.gz); a trained model's "
                         f"directory carries one")
    rows, per_task = [], {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            n = per_task.get(r["task"], 0)
            cap = retrieval_limit if r["task"].startswith("retrieval") and retrieval_limit is not None else limit
            if cap is None or n < cap:
                rows.append(r)
                per_task[r["task"]] = n + 1
    return rows


def split_answer(prompt: str, text: str) -> tuple[str, str]:
    """(reasoning, content) of one output, as the server's reasoning parser returns them."""
    from nanoserve.parsers.reasoning import get_reasoning_parser

    cls = get_reasoning_parser("minimax_m3")
    reasoning, content = cls(cls.prompt_opens_reasoning(prompt)).parse(text)
    return reasoning or "", content


MARKERS = ("<mm:think>", "</mm:think>", "]<]minimax[>[", "<tool_call>", "</tool_call>", "[e~[", "]~b]")


def grade(row: dict, text: str, finish: str) -> dict[str, bool]:
    """Which checks one output passes: its task's and the thinking format's."""
    from nanoserve.parsers.tool_calls import get_tool_call_parser

    reasoning, content = split_answer(row["prompt"], text)
    tools = {t["function"]["name"]: t["function"].get("parameters") for t in row.get("tools") or []}
    calls = []
    if tools:
        content, calls = get_tool_call_parser("minimax_m3")(tools).parse(content)
    well_formed = finish == "stop" and not any(m in content for m in MARKERS) and \
        text.count("<mm:think>") <= 1 and text.count("</mm:think>") <= 1
    task = row["task"]
    exp = row["expected"]
    if task == "arith":
        numbers = re.findall(r"-?\d+", content)
        ok = bool(numbers) and numbers[-1] == str(exp["answer"])
    elif task == "tool":
        ok = bool(calls) and calls[0].name == exp["name"] and json.loads(calls[0].arguments) == exp["arguments"]
    elif task == "no_tool":
        ok = not calls and bool(content.strip())
    else:  # retrieval
        ok = str(exp["value"]) in content
    return {task: ok, "thinking": well_formed}


def run_tasks(llm, rows: list[dict]) -> dict[str, list[bool]]:
    from nanoserve.sampling import SamplingParams

    # markers stay in the text: the parsers read them, as the server's do
    params = [SamplingParams(temperature=0.0, max_tokens=TASK_TOKENS.get(r["task"], RETRIEVAL_TOKENS),
                             skip_special_tokens=False) for r in rows]
    outs = llm.generate([r["prompt"] for r in rows], params, use_tqdm=False)
    results: dict[str, list[bool]] = {}
    for r, o in zip(rows, outs):
        c = o.outputs[0]
        for k, v in grade(r, c.text, c.finish_reason).items():
            if k == "thinking" and r["task"].startswith("retrieval"):
                continue
            results.setdefault(k, []).append(v)
            if k == "arith":
                mode = "thinking disabled" if r.get("thinking_mode") == "disabled" else "thinking not disabled"
                results.setdefault(f"arith ({mode})", []).append(v)
    return results


def perplexity(llm, model_dir: str, max_tokens: int, window: int = 512, skip: int = 0,
               text_path: str | None = None) -> dict[str, float]:
    """exp(mean negative log-likelihood) of each corpus's held-out text (`text_path`, default the model
    directory's heldout_text.jsonl.gz), in windows of `window` tokens, counting only the tokens at positions >=
    `skip` of their window (with skip past MSA's top-k x block size, only predictions made from a selection of
    blocks count)."""
    from nanoserve.sampling import SamplingParams

    path = text_path or os.path.join(model_dir, "heldout_text.jsonl.gz")
    out = {}
    tok = llm.engine.tokenizer
    with gzip.open(path, "rt", encoding="utf-8") as f:
        corpora = [json.loads(line) for line in f]
    for c in corpora:
        ids = tok.encode(c["text"][: max_tokens * 8])[:max_tokens]  # a token is well under 8 characters
        windows = [ids[i:i + window] for i in range(0, len(ids) - 1, window) if len(ids[i:i + window]) > skip + 1]
        outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                            SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        nll, n = 0.0, 0
        for w, o in zip(windows, outs):
            for pos in range(max(skip, 1), len(w)):
                nll -= o.prompt_logprobs[pos][w[pos]].logprob
                n += 1
        if n:
            out[c["source"]] = math.exp(nll / n)
    return out


def long_perplexity(llm, model_dir: str, max_tokens: int, text_path: str | None = None) -> dict[str, float]:
    """Perplexity of the held-out text in windows of LONG_WINDOW tokens, counting only the positions past MSA's
    top-k x block size: the predictions that read a selection of blocks rather than the whole prefix. Keyed
    `<corpus> past <N>`."""
    cfg = llm.engine.model_config
    dense = cfg.index_topk_blocks * cfg.index_block_size
    if LONG_WINDOW <= dense + 1:
        return {}
    return {f"{k} past {dense}": v for k, v in
            perplexity(llm, model_dir, max_tokens, LONG_WINDOW, dense, text_path).items()}


# -- replacing MSA's learned block choice -------------------------------------------------------------------------


def _forced_selection(kind: str, topk: int, local: int, block_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def select(index_q: torch.Tensor, meta) -> torch.Tensor:
        out = torch.full((index_q.shape[0], index_q.shape[1], topk), -1, dtype=torch.int32)
        own = (meta.positions.cpu() // block_size).long()
        for t in range(index_q.shape[0]):
            n = int(own[t]) + 1
            if kind == "local":
                picked = list(range(n - 1, max(-1, n - 1 - topk), -1))
            else:
                rest = torch.randperm(max(n - 1, 0), generator=gen)[: topk - 1].tolist() if n > 1 else []
                picked = [n - 1] + rest
            out[t, :, : len(picked)] = torch.tensor(picked, dtype=torch.int32)
        return out.to(index_q.device)

    return select


def force_selection(llm, kind: str | None) -> None:
    """Make every MSA layer of the engine's model select `kind` blocks ("local", "random"), or its own (None)."""
    model = llm.engine.executor.runner.model
    cfg = model.cfg
    for module in model.modules():
        if hasattr(module, "_select") and hasattr(module, "index_cache"):
            if kind is None:
                module.__dict__.pop("_select", None)
            else:
                module._select = _forced_selection(kind, cfg.index_topk_blocks, cfg.index_local_blocks,
                                                   cfg.index_block_size)


def evaluate(llm, model_dir: str, limit: int | None = None, text_tokens: int = 8192,
             selections: bool = True, retrieval_limit: int | None = None) -> QualityReport:
    rows = heldout_rows(model_dir, limit, retrieval_limit)
    report = QualityReport()
    for task, oks in run_tasks(llm, rows).items():
        report.accuracy[task] = (sum(oks) / len(oks), len(oks))
    if text_tokens:
        report.perplexity = perplexity(llm, model_dir, text_tokens)
        report.perplexity.update(long_perplexity(llm, model_dir, text_tokens))
    if selections:
        retrieval = [r for r in rows if r["task"].startswith("retrieval")]
        for kind in ("local", "random"):
            force_selection(llm, kind)
            try:
                for task, oks in run_tasks(llm, retrieval).items():
                    report.accuracy[f"{task} ({kind} selection)"] = (sum(oks) / len(oks), len(oks))
                if text_tokens:
                    report.perplexity.update({f"{k} ({kind} selection)": v for k, v in
                                              long_perplexity(llm, model_dir, text_tokens).items()})
            finally:
                force_selection(llm, None)
    return report


def format_report(report: QualityReport, title: str) -> str:
    lines = [f"## {title}", "", "| task | accuracy | n |", "|---|---|---|"]
    for task, (acc, n) in report.accuracy.items():
        lines.append(f"| {task} | {acc * 100:.1f} % | {n} |")
    if report.perplexity:
        lines += ["", "| held-out corpus | perplexity |", "|---|---|"]
        for name, ppl in report.perplexity.items():
            lines.append(f"| {name} | {ppl:.2f} |")
    return "\n".join(lines)


# -- the command ----------------------------------------------------------------------------------------------------


def build_llm(model: str, **engine_args):
    from nanoserve.entrypoints.llm import LLM

    return LLM(model=model, device="cpu", dtype="float32", max_model_len=16_384, kv_cache_tokens=65_536,
               seed=0, **engine_args)


WITH_MXFP8 = ("mx_activations",)
"""Approximation switches that change nothing on 16-bit weights: their quality rows run with MXFP8 weights."""


def variants() -> list[tuple[str, dict]]:
    """What is not exact, each as the engine arguments that turn it on: every approximation switch, MXFP8
    weights (the format M3 ships in: the bf16 weights quantised at load) and the fp8 KV cache. A switch that
    acts on MXFP8 weights only (WITH_MXFP8) runs on them, so its row shows MXFP8 weights plus the switch."""
    from nanoserve.config import Optimizations

    out = [(name + (" + --quantization mxfp8" if name in WITH_MXFP8 else ""),
            {"optimizations": Optimizations().replace(**{name: True}),
             **({"quantization": "mxfp8"} if name in WITH_MXFP8 else {})})
           for name in Optimizations.approximations()]
    out.append(("--quantization mxfp8", {"quantization": "mxfp8"}))
    out.append(("--kv-cache-dtype fp8", {"kv_cache_dtype": "fp8"}))
    return out


def format_deltas(base: QualityReport, rows: list[tuple[str, QualityReport]]) -> str:
    tasks = [t for t in base.accuracy if "selection" not in t]
    ppls = [c for c in base.perplexity if "selection" not in c]
    head = "| turned on | " + " | ".join(tasks) + " | " + " | ".join(f"ppl {c}" for c in ppls) + " |"
    lines = [head, "|" + "---|" * (1 + len(tasks) + len(ppls))]
    lines.append("| nothing (reference) | " + " | ".join(f"{base.accuracy[t][0] * 100:.1f} %" for t in tasks) + " | "
                 + " | ".join(f"{base.perplexity[c]:.2f}" for c in ppls) + " |")
    for name, rep in rows:
        cells = [f"{(rep.accuracy[t][0] - base.accuracy[t][0]) * 100:+.1f} pt" for t in tasks]
        cells += [f"{rep.perplexity[c] - base.perplexity[c]:+.3f}" for c in ppls]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def heldout_quality(model: str, limit: int | None, text_tokens: int, retrieval_limit: int | None = None
                    ) -> tuple[HeldoutReport, dict[str, float], bool]:
    """The held-out requests graded on `model` (the requests that offer tools with the constraint switch both ways,
    where it exists) and the perplexity of the frozen held-out text: (report, perplexity, whether the build has
    the switch)."""
    from nanoserve.bench.heldout import PICTURES, TEXT, load_requests, read_jsonl
    from nanoserve.config import Optimizations

    rows = select_rows(load_requests(), limit, retrieval_limit)
    present = CONSTRAINT in Optimizations().as_dict()
    llm = build_llm(model, reasoning_parser="minimax_m3")
    try:
        on = bool(getattr(llm.engine.config.optimizations, CONSTRAINT)) if present else None
        report = evaluate_heldout(llm, rows, on)
        if llm.engine.vision_config is not None:  # a model that reads pictures: the picture questions too
            pictures = select_rows(read_jsonl(PICTURES), limit)
            accuracy, records = evaluate_pictures(llm, pictures)
            report.accuracy.update(accuracy)
            report.answers += records
        ppl: dict[str, float] = {}
        if text_tokens:
            ppl = perplexity(llm, "", text_tokens, text_path=TEXT)
            ppl.update(long_perplexity(llm, "", text_tokens, text_path=TEXT))
    finally:
        llm.shutdown()
    return report, ppl, present


def run(model: str, limit: int | None, text_tokens: int, ablate: bool, out_dir: str | None,
        retrieval_limit: int | None = None) -> int:
    from nanoserve.bench.heldout import shipped_measurements
    from nanoserve.presets.resolve import resolve_model_dir

    model_dir = resolve_model_dir(model)
    t0 = time.time()
    report, ppl, present = heldout_quality(model, limit, text_tokens, retrieval_limit)
    seconds = time.time() - t0
    text = (f"## Quality of {model}: held-out requests, greedy, CPU fp32 ({seconds / 60:.1f} min)\n\n"
            + target_table(report, ppl, shipped_measurements(), present))
    print(text, flush=True)
    result = {"model": model, "limit": limit, "retrieval_limit": retrieval_limit, "seconds": round(seconds, 1),
              "heldout": {**report.as_dict(), "perplexity": ppl}}
    if ablate:
        llm = build_llm(model)
        try:
            base = evaluate(llm, model_dir, limit, text_tokens, retrieval_limit=retrieval_limit)
        finally:
            llm.shutdown()
        text += "\n\n" + format_report(base, f"{model}'s own held-out prompts (the ablation's reference)")
        print("\n" + format_report(base, f"{model}'s own held-out prompts (the ablation's reference)"), flush=True)
        result["report"] = base.as_dict()
        rows = []
        for name, kwargs in variants():
            llm = build_llm(model, **kwargs)
            try:
                rows.append((name, evaluate(llm, model_dir, limit, text_tokens, selections=False,
                                            retrieval_limit=retrieval_limit)))
            finally:
                llm.shutdown()
        table = format_deltas(base, rows)
        print("\n## What each approximation costs (change against the reference)\n\n" + table, flush=True)
        text += "\n\n" + table
        result["ablation"] = {name: rep.as_dict() for name, rep in rows}
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "quality.json"), "w") as f:
            json.dump(result, f, indent=2)
        with open(os.path.join(out_dir, "quality.md"), "w") as f:
            f.write(text + "\n")
    return 0
