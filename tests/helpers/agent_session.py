"""An agent session against a real `python -m nanoserve.server` with the agent flags, driven by the openai SDK.

    python -m tests.helpers.agent_session --out DIR                        # a GPU: m3-slice
    python -m tests.helpers.agent_session --model m3-tiny --cpu --out DIR  # any machine: m3-tiny on the CPU (~1 min)

tests/server/test_gpu_agent_session.py runs it on the GPU under `pytest -m gpu`.

The server runs with `--enable-auto-tool-choice --tool-call-parser minimax_m3 --reasoning-parser minimax_m3`. The
presets have random weights, so only what structured decoding guarantees is asserted: `tool_choice: "required"` and a
named function yield calls of declared tools whose arguments fit the tool's schema, and `response_format:
json_schema` yields JSON that fits the schema - after the thinking block when thinking is on, since the format
applies only to the answer. The rest (a multi-turn conversation with tool results, tool_choice "auto", the
streamed deltas) is checked for shape and for agreeing with the non-streamed answer. To make the model close its
thinking block within a few tokens, the thinking-on cases sample with a seed and a logit_bias on `</mm:think>`
(its id comes from /tokenize; the first bias and seed that close the thinking after some text are searched for
once), once with the format and once without: the reasoning (the unconstrained part) must come out the same in
both, since a seeded request draws the same tokens while nothing is masked.

The same server is then driven through its other agent surfaces: vLLM's thinking_token_budget, the Responses API
(a forced call, then its result over previous_response_id, streamed) and Anthropic's Messages API (the anthropic
SDK: tool_choice any, whole and streamed).

Every case writes a row to OUT/agent.jsonl as it finishes; the table (OUT/agent.md) is printed last. The exit
status is 1 when any case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[2]
CPU_FLAGS = ["--device", "cpu", "--kv-cache-tokens", "16384", "--no-triton-attention", "--no-triton-msa",
             "--no-fused-moe", "--no-fold-shared-expert", "--no-fused-qk-norm-rope", "--no-fused-add-rmsnorm",
             "--no-cuda-graphs"]
AGENT_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "minimax_m3", "--reasoning-parser", "minimax_m3"]
THINK_END = "</mm:think>"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Oslo", "Rome", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14}, "hourly": {"type": "boolean"}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "book_trip", "description": "Book a trip",
        "parameters": {"type": "object", "properties": {
            "from": {"type": "string", "enum": ["Oslo", "Rome", "Lima"]},
            "to": {"type": "string", "enum": ["Oslo", "Rome", "Lima"]},
            "flexible": {"type": "boolean"}, "class": {"type": "string", "enum": ["economy", "business"]}},
            "required": ["from", "to", "class"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# a format a random model cannot run on forever: enums, a bounded integer, a boolean, no free whitespace
ANSWER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Oslo", "Rome", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "hourly": {"type": "boolean"}}, "required": ["city", "days", "hourly"], "additionalProperties": False}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": ANSWER_SCHEMA, "strict": True}}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


# -- checks ---------------------------------------------------------------------------------------------------
def schema_errors(value, schema: dict, path: str = "$") -> list[str]:
    """What in `value` breaks `schema`, for the JSON-schema keywords the schemas above use."""
    errs: list[str] = []
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "number": (int, float), "integer": int}
    t = schema.get("type")
    if t is not None:
        ok = isinstance(value, types[t]) and not (t in ("number", "integer") and isinstance(value, bool))
        if not ok:
            return [f"{path}: {value!r} is not {t}"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errs.append(f"{path}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errs.append(f"{path}: {value} > {schema['maximum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errs += [f"{path}: missing {k!r}" for k in schema.get("required", []) if k not in value]
        for k, v in value.items():
            if k in props:
                errs += schema_errors(v, props[k], f"{path}.{k}")
            elif schema.get("additionalProperties") is False:
                errs.append(f"{path}: unexpected {k!r}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            errs += schema_errors(v, schema["items"], f"{path}[{i}]")
    return errs


def check_calls(calls, allowed: set[str]) -> list[tuple[str, dict]]:
    """The calls as (name, arguments), each a declared (and allowed) tool whose arguments fit its schema."""
    assert calls, "no tool call"
    out = []
    for c in calls:
        assert c.type == "function" and c.id, f"call without id/type: {c}"
        assert c.function.name in allowed, f"call of {c.function.name!r}, allowed {sorted(allowed)}"
        args = json.loads(c.function.arguments)
        assert isinstance(args, dict), f"arguments are not an object: {c.function.arguments!r}"
        errs = schema_errors(args, SCHEMAS[c.function.name])
        assert not errs, f"{c.function.name} arguments {args}: {errs}"
        out.append((c.function.name, args))
    return out


def check_answer(content: str | None) -> dict:
    assert content, "no content"
    value = json.loads(content)
    errs = schema_errors(value, ANSWER_SCHEMA)
    assert not errs, f"{content!r}: {errs}"
    return value


# -- the server -----------------------------------------------------------------------------------------------
class Server:
    """`python -m nanoserve.server` with the agent flags on a free loopback port; its log in OUT/server_log.txt."""

    def __init__(self, args, out: Path):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "nanoserve.server", "--model", args.model, "--port", str(self.port),
               "--host", "127.0.0.1", "--max-model-len", str(args.max_model_len), *AGENT_FLAGS,
               *(CPU_FLAGS if args.cpu else []), *args.server_arg]
        self.log_path = out / "server_log.txt"
        self.log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.cmd = " ".join(cmd[1:])

    def wait(self, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise RuntimeError(f"the server did not answer /health in {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# -- the session ----------------------------------------------------------------------------------------------
class Session:
    def __init__(self, server: Server, out: Path, max_tokens: int):
        self.server = server
        self.client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
        self.model = self.client.models.list().data[0].id
        self.max_tokens = max_tokens
        ids = httpx.post(f"{server.url}/tokenize", json={"model": self.model, "prompt": THINK_END,
                                                         "add_special_tokens": False}, timeout=30).json()["tokens"]
        assert len(ids) == 1, f"{THINK_END} is not one token: {ids}"
        self.think_end_id = ids[0]
        self._closing: dict | None = None
        self.rows: list[dict] = []
        self.jsonl = open(out / "agent.jsonl", "w")

    def chat(self, messages, thinking: str = "adaptive", **kw):
        extra = kw.pop("extra_body", {})
        extra = {**extra, "chat_template_kwargs": {"thinking_mode": thinking}}
        kw.setdefault("temperature", 0.0)
        if kw.get("seed") is None:
            kw.pop("seed", None)
        kw.setdefault("max_tokens", self.max_tokens)
        return self.client.chat.completions.create(model=self.model, messages=messages, extra_body=extra, **kw)

    def case(self, name: str, fn) -> object:
        t0 = time.perf_counter()
        try:
            result, detail = fn()
            ok = "pass"
        except Exception as e:  # noqa: BLE001 - a failed case is a row of the table, the session goes on
            result, ok, detail = None, "FAIL", f"{type(e).__name__}: {e}"
            traceback.print_exc()
        row = {"case": name, "result": ok, "seconds": round(time.perf_counter() - t0, 2), "detail": detail}
        self.rows.append(row)
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        print(f"[{ok}] {name} ({row['seconds']} s): {detail}", flush=True)
        return result

    def end_bias(self) -> dict:
        """Sampling that closes the thinking after a few tokens: a seed and a logit_bias on </mm:think>, found
        once (a bias of 100 - no reasoning text at all - if nothing smaller closes it within 32 tokens)."""
        if self._closing is None:
            user = [{"role": "user", "content": "Think briefly, then answer."}]
            self._closing = {"temperature": 1.0, "seed": 0, "logit_bias": {str(self.think_end_id): 100}}
            for bias in (2, 4, 6, 8, 10, 12, 14, 16):
                for seed in range(3):
                    kw = {"temperature": 1.0, "seed": seed, "logit_bias": {str(self.think_end_id): bias}}
                    m = self.chat(user, "enabled", max_tokens=32, **kw).choices[0].message
                    if m.content is not None and getattr(m, "reasoning_content", None):
                        self._closing = kw
                        break
                else:
                    continue
                break
            print(f"closing the thinking with {self._closing}", flush=True)
        return dict(self._closing)


def run_cases(s: Session) -> None:
    user = [{"role": "system", "content": "You plan trips."},
            {"role": "user", "content": "What is the weather in Oslo for two days?"}]
    names = set(SCHEMAS)

    def required():
        # one call (parallel_tool_calls false): with parallel calls allowed, a random model decoding greedily may
        # open call after call until max_tokens ends it (finish "length", the complete calls kept) - the streamed
        # case below takes that path
        r = s.chat(user, "disabled", tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        msg, fin = r.choices[0].message, r.choices[0].finish_reason
        calls = check_calls(msg.tool_calls, names)
        assert len(calls) == 1, calls
        assert fin == "tool_calls" and msg.content is None, (fin, msg.content)  # the call only, then EOS
        return r, f"finish={fin}, calls={calls}"
    first = s.case("tool_choice required (thinking off)", required)

    def named():
        r = s.chat(user, "disabled", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "book_trip"}})
        calls = check_calls(r.choices[0].message.tool_calls, {"book_trip"})
        assert len(calls) == 1, calls
        return r, f"finish={r.choices[0].finish_reason}, call={calls[0]}"
    s.case("tool_choice named book_trip", named)

    def required_thinking():
        # no logit_bias: the format closes the thinking once it has taken max_tokens less the call's room
        r = s.chat(user, "enabled", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                   temperature=1.0, seed=0, max_tokens=2 * s.max_tokens)
        msg, fin = r.choices[0].message, r.choices[0].finish_reason
        calls = check_calls(msg.tool_calls, names)
        assert fin == "tool_calls" and msg.content is None, (fin, msg.content)
        reasoning = getattr(msg, "reasoning_content", None)
        assert isinstance(reasoning, str), f"reasoning_content {reasoning!r}"
        return r, f"reasoning {len(reasoning)} chars, {r.usage.completion_tokens} tokens, calls={calls}"
    s.case("tool_choice required (thinking on)", required_thinking)

    def multi_turn():
        calls = first.choices[0].message.tool_calls if first is not None else None
        if not calls:
            raise AssertionError("needs the first case's calls")
        history = user + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]}]
        history += [{"role": "tool", "tool_call_id": c.id, "content": f"{c.function.name}: 3C, light snow"}
                    for c in calls]
        second = s.chat(history, "adaptive", tools=TOOLS, tool_choice="auto")
        fin2 = second.choices[0].finish_reason
        assert fin2 in ("stop", "length", "tool_calls"), fin2
        if second.choices[0].message.tool_calls:
            check_calls(second.choices[0].message.tool_calls, names)
        history += [{"role": "assistant", "content": second.choices[0].message.content or "Noted."},
                    {"role": "user", "content": "Book Oslo to Rome, two nights, economy."}]
        third = s.chat(history, "disabled", tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        got = check_calls(third.choices[0].message.tool_calls, names)
        assert len(got) == 1, f"parallel_tool_calls=false gave {len(got)} calls"
        p1, p2, p3 = first.usage.prompt_tokens, second.usage.prompt_tokens, third.usage.prompt_tokens
        assert p1 < p2 < p3, (p1, p2, p3)
        return third, f"prompt tokens {p1} -> {p2} -> {p3}; auto turn finish={fin2}; last call={got[0]}"
    s.case("multi-turn: tool results, auto, then required (one call)", multi_turn)

    def streamed():
        whole = s.chat(user, "disabled", tools=TOOLS, tool_choice="required")
        chunks = list(s.chat(user, "disabled", tools=TOOLS, tool_choice="required", stream=True,
                             stream_options={"include_usage": True}))
        calls: dict[int, dict] = {}
        finish = None
        for c in chunks:
            if not c.choices:
                continue
            finish = c.choices[0].finish_reason or finish
            for d in c.choices[0].delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.function.name, f"first delta of call {d.index} lacks id/name: {d}"
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
        assert calls, "no tool_calls deltas"
        for c in calls.values():
            args = json.loads(c["arguments"])
            assert c["name"] in names and not schema_errors(args, SCHEMAS[c["name"]]), c
        same = [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
            [(c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]
        assert same, "the streamed calls differ from the non-streamed ones (greedy decoding)"
        assert finish == whole.choices[0].finish_reason, (finish, whole.choices[0].finish_reason)
        used = chunks[-1].usage.completion_tokens if chunks[-1].usage is not None else 0
        assert used > 0, "no usage chunk"
        # parallel calls: the block ends (EOS, "tool_calls") or max_tokens cuts it after its complete calls
        assert finish == "tool_calls" or (finish == "length" and used == s.max_tokens), (finish, used)
        return None, f"{len(chunks)} chunks, {len(calls)} call(s), finish={finish}, same as non-streamed"
    s.case("streaming tool_choice required", streamed)

    def json_off():
        r = s.chat(user, "disabled", response_format=ANSWER_FORMAT, extra_body=COMPACT)
        msg = r.choices[0].message
        check_answer(msg.content)
        assert getattr(msg, "reasoning_content", None) is None, msg
        assert r.choices[0].finish_reason == "stop", r.choices[0].finish_reason
        return r, f"content={msg.content}"
    s.case("json_schema (thinking off)", json_off)

    def json_on():
        r = s.chat(user, "enabled", response_format=ANSWER_FORMAT, extra_body=COMPACT, **s.end_bias())
        free = s.chat(user, "enabled", **s.end_bias())
        msg = r.choices[0].message
        check_answer(msg.content)
        reasoning = getattr(msg, "reasoning_content", None)
        assert isinstance(reasoning, str), f"reasoning_content {reasoning!r}"
        # the thinking is not held to the format: it is what the same request without the format thinks
        free_reasoning = getattr(free.choices[0].message, "reasoning_content", None)
        assert reasoning == free_reasoning, (reasoning, free_reasoning)
        return r, f"reasoning {len(reasoning)} chars, as unconstrained ({s.end_bias()}), content={msg.content}"
    s.case("json_schema (thinking on, reasoning unconstrained)", json_on)

    def json_stream():
        chunks = list(s.chat(user, "disabled", response_format=ANSWER_FORMAT, extra_body=COMPACT, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        check_answer(text)
        return None, f"{len(chunks)} chunks: {text}"
    s.case("json_schema streamed", json_stream)

    def thinking_budget():
        # vLLM's thinking_token_budget: with </mm:think> biased away the model never closes its thinking itself
        budget = 16
        kw = dict(temperature=1.0, seed=0, logit_bias={str(s.think_end_id): -100}, max_tokens=budget + 16,
                  extra_body={"return_token_ids": True, "thinking_token_budget": budget})
        ids = s.chat(user, "enabled", **kw).choices[0].model_extra["token_ids"]
        assert ids.index(s.think_end_id) == budget, ids
        return None, f"</mm:think> forced after {budget} thinking tokens, {len(ids)} tokens in all"
    s.case("thinking_token_budget", thinking_budget)

    flat_tools = [{"type": "function", **t["function"]} for t in TOOLS]

    def responses_loop():
        first = s.client.responses.create(model=s.model, input=user[1]["content"], instructions=user[0]["content"],
                                          tools=flat_tools, tool_choice="required", parallel_tool_calls=False,
                                          temperature=0.0, max_output_tokens=s.max_tokens,
                                          extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}})
        calls = [o for o in first.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].name in names, first.output
        assert not schema_errors(json.loads(calls[0].arguments), SCHEMAS[calls[0].name]), calls[0]
        with s.client.responses.stream(model=s.model, previous_response_id=first.id, tools=flat_tools,
                                       temperature=0.0, max_output_tokens=s.max_tokens,
                                       input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                               "output": "3C, light snow"}]) as stream:
            second = stream.get_final_response()
        assert second.usage.input_tokens > first.usage.input_tokens, (first.usage, second.usage)
        return None, (f"call {calls[0].name}{calls[0].arguments}; continued by previous_response_id: "
                      f"{[o.type for o in second.output]}, status {second.status}")
    s.case("Responses API: required call, then its result over previous_response_id (streamed)", responses_loop)

    def messages_api():
        import anthropic

        claude = anthropic.Anthropic(base_url=s.server.url, api_key="none", max_retries=0, timeout=600)
        tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                  "input_schema": t["function"]["parameters"]} for t in TOOLS]
        kw = dict(model=s.model, max_tokens=s.max_tokens, tools=tools, thinking={"type": "disabled"},
                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                  messages=[{"role": "user", "content": user[1]["content"]}], extra_body={"temperature": 0.0})
        whole = claude.messages.create(**kw)
        uses = [b for b in whole.content if b.type == "tool_use"]
        assert len(uses) == 1 and uses[0].name in names and not schema_errors(uses[0].input, SCHEMAS[uses[0].name])
        with claude.messages.stream(**kw) as stream:
            streamed = stream.get_final_message()
        assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == \
            [(uses[0].name, uses[0].input)], streamed.content
        return None, f"stop_reason {whole.stop_reason}, tool_use {uses[0].name}{uses[0].input}, streamed the same"
    s.case("Anthropic Messages API: tool_choice any (whole and streamed)", messages_api)


def write_table(s: Session, out: Path, header: str) -> str:
    lines = [header, "", "| case | result | s | detail |", "|---|---|---|---|"]
    for r in s.rows:
        detail = str(r["detail"]).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['case']} | {r['result']} | {r['seconds']} | {detail[:300]} |")
    text = "\n".join(lines) + "\n"
    (out / "agent.md").write_text(text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="m3-slice")
    ap.add_argument("--cpu", action="store_true", help="serve on the CPU with the reference kernels (m3-tiny)")
    ap.add_argument("--out", default=os.environ.get("OUT", "results/agent"))
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=256, help="per request")
    ap.add_argument("--startup-timeout", type=float, default=480)
    ap.add_argument("--server-arg", action="append", default=[], help="one more server flag (repeatable)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = Server(args, out)
    try:
        started = server.wait(args.startup_timeout)
        print(f"server up in {started:.1f} s: {server.cmd}", flush=True)
        s = Session(server, out, args.max_tokens)
        run_cases(s)
    finally:
        server.stop()
    failed = sum(r["result"] != "pass" for r in s.rows)
    header = (f"agent session: {args.model}, server up in {started:.0f} s, {len(s.rows) - failed}/{len(s.rows)} "
              f"passed; `{server.cmd}`")
    print(write_table(s, out, header), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
