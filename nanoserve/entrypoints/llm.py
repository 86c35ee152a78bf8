"""The offline API, in vLLM's shape:

    from nanoserve import LLM, SamplingParams
    llm = LLM(model="m3-mini")                      # a checkpoint directory, m3-mini or a preset
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
    print(outs[0].outputs[0].text)
    llm.shutdown()                                  # or: with LLM(...) as llm: ...

`shutdown()` stops the engine: its tensor-parallel workers exit and the process groups are left, so another LLM
(of any tensor-parallel size) can be built in the same process. Dropping the last reference to an LLM, or the
interpreter exiting, shuts it down too (a finalizer).

Images and videos, as vLLM takes them: `generate({"prompt": "]<]image[>[What is this?", "multi_modal_data": {"image":
pil_image}})` (one `]<]image[>[` / `]<]video[>[` marker per item, in order; an item is a PIL image, encoded bytes or an
[H, W, 3] uint8 array; a video its frames), or `chat` messages with image_url / video_url parts (data URLs) or
image_pil parts. A model without a vision tower refuses them (docs/vision.md).

`LLM(..., reasoning_parser="minimax_m3")` (vLLM's engine argument) does offline what `--reasoning-parser` does on
the server: a structured output applies to the answer, not the thinking (the grammar starts after `</mm:think>`
when the prompt leaves thinking open or to the model), and `LLM.chat` splits each output into
`CompletionOutput.reasoning` and `.content`.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Any
from typing import Sequence as Seq

import torch
from tqdm import tqdm

from nanoserve.chat_template import MediaPart, load_chat_template, render_chat, template_messages
from nanoserve.config import EngineConfig
from nanoserve.cpu_threads import configure_cpu_threads
from nanoserve.engine.llm_engine import LLMEngine, Prompt
from nanoserve.engine.outputs import RequestOutput
from nanoserve.entrypoints.beam_search import BeamSearchInstance, BeamSearchOutput
from nanoserve.multimodal.features import process_prompt
from nanoserve.multimodal.loader import MediaLoader, load_parts
from nanoserve.multimodal.processor import MultiModalProcessor
from nanoserve.parsers.reasoning import ReasoningParser, get_reasoning_parser
from nanoserve.parsers.tools import check_tools
from nanoserve.sampling import BeamSearchParams, SamplingParams
from nanoserve.spec_decode.config import SpeculativeConfig


class LLM:
    """Build an engine from vLLM-style keyword arguments and run batches of prompts to completion."""

    def __init__(self, model: str = "m3-mini", cpu_threads: int | None = None, reasoning_parser: str | None = None,
                 **engine_args: Any):
        """`cpu_threads`: torch's intra-op threads when the model runs on the CPU (default:
        $NANOSERVE_CPU_THREADS, else every physical core; nanoserve/cpu_threads.py). `reasoning_parser`: the
        model's thinking format (see the module docstring); None: outputs are not read for thinking."""
        try:
            self.reasoning_parser: type[ReasoningParser] | None = \
                get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        except ValueError as e:
            raise ValueError(f"reasoning_parser: {e}") from None
        config = EngineConfig.from_kwargs(model=model, **engine_args)
        if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
            configure_cpu_threads(cpu_threads)
        self.engine = LLMEngine(config)
        self._counter = 0
        # holds the engine, not the LLM: runs once, at shutdown(), when the LLM is collected, or at exit
        self._finalizer = weakref.finalize(self, LLMEngine.shutdown, self.engine)
        self._reasoning_end_id = self._reasoning_end() if self.reasoning_parser else None
        self._processor: MultiModalProcessor | None = None  # images and videos -> patches (made on first use)

    def _reasoning_end(self) -> int:
        ids = self.engine.tokenizer.encode(self.reasoning_parser.end, add_special_tokens=False)
        if len(ids) != 1:
            self.shutdown()
            raise ValueError(f"reasoning_parser: its end marker {self.reasoning_parser.end!r} is {len(ids)} tokens "
                             f"in this tokenizer, not one")
        return ids[0]

    def _for_prompt(self, params: SamplingParams, state: str, chat: bool) -> SamplingParams:
        """`params` for one prompt whose last turn leaves thinking `state` (ReasoningParser.prompt_state): a
        structured output waits for the end of the thinking when the model may think (a chat turn that did not
        close the block; a raw prompt only when it left one open, as the server's completions), and a chat
        decodes the markers the parser reads even when the tokenizer calls them special."""
        so = params.structured_outputs
        if so is not None and so.reasoning_end_token_id is None and (state == "open" or chat and state == "none"):
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
                so, reasoning_end_token_id=self._reasoning_end_id))
        if chat and params.skip_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        return params

    def shutdown(self) -> None:
        """Stop the engine and its tensor-parallel workers; the LLM cannot generate afterwards. Idempotent."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _check_alive(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this LLM has been shut down; build a new one")

    def get_tokenizer(self):
        return self.engine.tokenizer

    def _with_media(self, prompt: Prompt, media: list[MediaPart] | None = None) -> Prompt:
        """A prompt with images or videos - a dict's `multi_modal_data`, or a chat's media parts - as the engine
        takes it: the expanded prompt's token ids and its `mm_features`. Other prompts pass unchanged."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data and not media:
            return prompt
        vision = self.engine.vision_config
        if vision is None:
            raise ValueError(f"multi_modal_data: this model ({self.engine.config.model}) takes no images or videos")
        if self._processor is None:
            self._processor = MultiModalProcessor.from_model_dir(self.engine.executor.model_dir)
        if media:
            images, videos = load_parts(MediaLoader(), media)
            text = prompt["prompt"]
        else:
            if not isinstance(data, dict) or set(data) - {"image", "video"}:
                raise ValueError("multi_modal_data: must be a dict with 'image' and / or 'video'")
            if not isinstance(prompt.get("prompt"), str):
                raise ValueError("multi_modal_data: needs the prompt as text ('prompt'), with one ]<]image[>[ or "
                                 "]<]video[>[ marker per item")
            images, videos = (data.get(k) for k in ("image", "video"))
            images = [] if images is None else images if isinstance(images, list) else [images]
            videos = [] if videos is None else videos if isinstance(videos, list) else [videos]
            text = prompt["prompt"]
        ids, features = process_prompt(self._processor, self.engine.tokenizer, text, vision, images, videos)
        out = {"prompt": text, "prompt_token_ids": ids, "mm_features": features}
        if "cache_salt" in prompt:
            out["cache_salt"] = prompt["cache_salt"]
        return out

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None
                 = None, use_tqdm: bool = True, priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Run every prompt (a string, token ids as {"prompt_token_ids": [...]}, or a list of those) and return
        one RequestOutput each, in order. A progress bar shows prefill and decode tokens/s. `priority`: one per
        prompt, with scheduling_policy="priority" (lower runs sooner), as vLLM's."""
        self._check_alive()
        if not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt (anything but a list of prompts is one; a bad one fails validation)
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priority values for {len(prompts)} prompts")
        prompts = [self._with_media(p) for p in prompts]
        if self.reasoning_parser is not None:
            params = [self._for_prompt(p, self.reasoning_parser.prompt_state(self._prompt_text(prompt)), False)
                      for prompt, p in zip(prompts, params)]
        return self._generate(prompts, params, use_tqdm, priority)

    def _prompt_text(self, prompt: Prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
        return self.engine.tokenizer.decode(list(ids or []), skip_special_tokens=False)

    def _generate(self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool,
                  priority: Seq[int] | None = None) -> list[RequestOutput]:
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = str(self._counter)
                self._counter += 1
                self.engine.add_request(rid, prompt, p, priority=priority[i] if priority is not None else 0)
                ids.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            raise

    def beam_search(self, prompts: Prompt | Seq[Prompt], params: BeamSearchParams, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's LLM.beam_search; the algorithm: entrypoints/beam_search.py).
        `prompts`: strings, {"prompt": ...} or {"prompt_token_ids": [...], "cache_salt": ...} dicts, or one of
        those. Returns one BeamSearchOutput per prompt, in order: its best params.beam_width beams, best first,
        each with `tokens` (the prompt's and the beam's, an ending EOS included), `text` (those tokens decoded;
        the ending EOS's text only with include_stop_str_in_output), `cum_logprob`, `logprobs` and
        `finish_reason`. `concurrency_limit`: search this many prompts at a time (None: all). `use_tqdm`: a bar
        over the token steps. Bad input raises ValueError naming the parameter."""
        self._check_alive()
        engine = self.engine
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        params.validate(self.engine.config.max_logprobs)
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be an integer >= 1, got {concurrency_limit!r}")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        instances = []
        for prompt in prompts:
            _, token_ids = engine.tokenize_prompt(prompt)
            engine.validate_prompt(token_ids)
            salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise ValueError("cache_salt: must be a non-empty string")
            instances.append(BeamSearchInstance(token_ids, params, engine.eos_token_id, engine.max_model_len, salt))
        limit = concurrency_limit or max(len(instances), 1)
        for start in range(0, len(instances), limit):
            batch = instances[start:start + limit]
            steps = tqdm(range(params.max_tokens), desc="Beam search", unit="token", dynamic_ncols=True,
                         disable=not use_tqdm)
            for _ in steps:
                live = [inst for inst in batch if not inst.done]
                if not live:
                    break
                step_prompts = [inst.step_prompts() for inst in live]
                flat = [p for ps in step_prompts for p in ps]
                outs = self._generate(flat, [inst.step_params() for inst, ps in zip(live, step_prompts) for _ in ps],
                                      use_tqdm=False)
                at = 0
                for inst, ps in zip(live, step_prompts):
                    inst.advance([o.outputs[0] for o in outs[at:at + len(ps)]])
                    at += len(ps)
            steps.close()
        results = []
        for inst in instances:
            best = inst.best()
            for beam in best:
                ends_in_eos = beam.finish_reason == "stop" and not params.include_stop_str_in_output
                beam.text = engine.tokenizer.decode(beam.tokens[:-1] if ends_in_eos else beam.tokens)
            results.append(BeamSearchOutput(sequences=best))
        return results

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Render one conversation (or a list of them) with the chat template and generate, as vLLM's LLM.chat.
        The rendering is the server's (chat_template.render_chat): `tools` (OpenAI function tools, checked as the
        server checks them) go into the prompt as the template writes them, `chat_template` (a jinja string or a
        file) replaces the tokenizer's, `chat_template_kwargs` are the template's variables (M3's `thinking_mode`),
        and `continue_final_message` continues the last message (with add_generation_prompt=False). The output is
        the raw text; tool calls are not parsed (nanoserve.parsers does that). With `reasoning_parser`, the
        text keeps the thinking markers and each CompletionOutput also has `reasoning` (None when the model did
        not think) and `content`, split as the server splits them. Bad input raises ValueError naming the
        parameter."""
        if tools is not None:
            check_tools(tools)
        template = load_chat_template(chat_template)
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        texts, prompts = [], []
        for conv in convs:
            media: list[MediaPart] = []
            text = render_chat(self.engine.tokenizer, template_messages(conv, media), tools=tools,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, chat_template=template,
                               chat_template_kwargs=chat_template_kwargs)
            texts.append(text)
            prompts.append(self._with_media({"prompt": text}, media) if media else
                           {"prompt_token_ids": self.engine.tokenizer.encode(text, add_special_tokens=False)})
        if self.reasoning_parser is None:
            return self.generate(prompts, sampling_params, use_tqdm)
        self._check_alive()
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        states = [self.reasoning_parser.prompt_state(t) for t in texts]
        outs = self._generate(prompts, [self._for_prompt(p, st, True) for p, st in zip(params, states)], use_tqdm)
        for out, state in zip(outs, states):
            for c in out.outputs:
                c.reasoning, c.content = self.reasoning_parser(state == "open").parse(c.text)
        return outs

    def get_metrics(self) -> list["Metric"]:
        """The engine's metrics as vLLM's offline API gives them (vllm.v1.metrics.reader): each a Counter, Gauge or
        Vector named as the server's Prometheus metrics are (vllm:...), labelled with the model and the engine
        index; the speculative-decoding counters (vllm:spec_decode_*) when a speculative_config is in use, the
        accepted drafts per position as one Vector. Counters count since the engine was built."""
        engine, stats = self.engine, self.engine.stats
        labels = {"model_name": engine.config.served_model_name or engine.config.model, "engine": "0"}
        metrics: list[Metric] = [
            Gauge("vllm:num_requests_running", labels, engine.num_running),
            Gauge("vllm:num_requests_waiting", labels, engine.num_waiting),
            Gauge("vllm:kv_cache_usage_perc", labels, engine.block_manager.usage),
            Counter("vllm:prefix_cache_queries", labels, stats.prefix_cache_queries),
            Counter("vllm:prefix_cache_hits", labels, stats.prefix_cache_hits),
            Counter("vllm:num_preemptions", labels, stats.num_preemptions),
            Counter("vllm:prompt_tokens", labels, stats.num_prompt_tokens),
            Counter("vllm:generation_tokens", labels, stats.num_generation_tokens)]
        for reason in ("stop", "length", "abort"):  # vLLM's finished_reason label values
            count = stats.num_aborted if reason == "abort" else stats.finished.get(reason, 0)
            metrics.append(Counter("vllm:request_success", {**labels, "finished_reason": reason}, count))
        config = engine.config
        if config.speculative_config is not None and config.optimizations.speculative_decoding:
            k = SpeculativeConfig.from_dict(config.speculative_config).num_speculative_tokens
            per_pos = list(stats.spec_decode_accepted_per_pos)
            metrics += [Counter("vllm:spec_decode_num_drafts", labels, stats.spec_decode_num_drafts),
                        Counter("vllm:spec_decode_num_draft_tokens", labels, stats.spec_decode_num_draft_tokens),
                        Counter("vllm:spec_decode_num_accepted_tokens", labels, stats.spec_decode_num_accepted_tokens),
                        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels,  # one count per draft position
                               per_pos + [0] * (k - len(per_pos)))]
        return metrics

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        engine = self.engine
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        # rates over the whole run, not the last step: steps that prefill (possibly beside decodes) count
        # toward prefill, decode-only steps toward decode
        prefill_tokens = prefill_time = decode_tokens = decode_time = 0.0
        while len(results) < len(ids):
            prefill_before = engine.stats.num_computed_prefill_tokens
            decode_before = engine.stats.num_generation_tokens
            t0 = time.perf_counter()
            outputs = engine.step()
            dt = time.perf_counter() - t0
            prefilled = engine.stats.num_computed_prefill_tokens - prefill_before
            if prefilled:
                prefill_tokens, prefill_time = prefill_tokens + prefilled, prefill_time + dt
            else:
                decode_tokens += engine.stats.num_generation_tokens - decode_before
                decode_time += dt
            bar.set_postfix_str(f"prefill {prefill_tokens / max(prefill_time, 1e-9):,.0f} tok/s, "
                                f"decode {decode_tokens / max(decode_time, 1e-9):,.0f} tok/s", refresh=False)
            for out in outputs:
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
            if not outputs and not engine.has_unfinished_requests():
                break
        bar.close()
        return [results[i] for i in ids]


# -- LLM.get_metrics: vLLM's metric types (vllm.v1.metrics.reader) ---------------------------------------------------
@dataclasses.dataclass
class Metric:
    """One metric: its name (vllm:...) and labels."""

    name: str
    labels: dict[str, str]


@dataclasses.dataclass
class Counter(Metric):
    """A count that only grows."""

    value: int


@dataclasses.dataclass
class Gauge(Metric):
    """A value at the time of reading."""

    value: float


@dataclasses.dataclass
class Vector(Metric):
    """Counts by position (vLLM folds a counter's `position` label into one list)."""

    values: list[int]
