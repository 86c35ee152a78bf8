"""Beam search as vLLM's (its `LLM.beam_search` and the server's `use_beam_search`), over the ordinary engine.

    BeamSearchParams      (nanoserve/sampling.py) beam_width, max_tokens, ignore_eos, temperature, length_penalty,
                          include_stop_str_in_output
    BeamSearchInstance    one prompt's search: its live beams and the beams that ended
    get_beam_search_score cumulative logprob / length ** length_penalty (a trailing EOS not counted)
    BeamSearchOutput      the best beam_width beams of a prompt, best first

The search runs one token at a time. Each step every live beam is an ordinary one-token request whose prompt is
the beam's tokens so far (the prompt and what the beam generated), asking for 2 x beam_width logprobs: each of
those tokens is a candidate continuation whose cumulative logprob is the beam's plus the token's. A candidate
that is EOS (unless ignore_eos) ends its beam; the beam_width best of the others are the next step's beams. After
max_tokens steps (or when no beam is left) the ended and the live beams are ranked together by
get_beam_search_score and the best beam_width are returned.

Where the KV lives: the beams of a prompt share every full KV block of their common prefix through the prefix
cache - a step's requests find the blocks the previous step computed (freed when that step's requests finished,
but kept with their hashes), take a reference each (a block's ref count is the number of beams on it) and compute
only the tokens after the last full block. A beam that diverges inside a block gets its own copy of that block's
tokens, recomputed, instead of a copy of its K/V: at most block_size tokens per beam per step. When the search
ends every block is back in the free list (vLLM's V1 engine runs beam search the same way).

A driver owns the loop: `LLM.beam_search` runs the steps on its engine (entrypoints/llm.py); `BeamSearchStream`
runs them as requests on an AsyncLLMEngine (what the server's `use_beam_search` uses) and hands the result out as
a RequestStream does. Both only call `step_prompts`, `step_params` and `advance` of a BeamSearchInstance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from nanoserve.engine.outputs import CompletionOutput, RequestOutput
from nanoserve.entrypoints.async_engine import AsyncLLMEngine, RequestStream
from nanoserve.sampling import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's shape): `tokens` are the prompt's and the beam's, `logprobs` one dict per generated token
    (every candidate of that step: token id -> logprob, the token the engine drew first), `cum_logprob` the sum of
    the beam's tokens' logprobs. `text` is filled when the beam is returned; `finish_reason` is "stop" for a beam
    EOS ended (`stop_reason` the EOS id) and "length" for one that ran to max_tokens or the model's length."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first; as many as beam_width (fewer only when fewer ever existed)."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's (and Hugging Face's) beam score: the cumulative logprob over the sequence's length (prompt
    included, a final EOS not) to the power length_penalty. Above 1 favours longer beams, 0 ranks by logprob."""
    seq_len = len(tokens)
    if tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    try:
        return cumulative_logprob / (seq_len ** length_penalty)
    except OverflowError:  # an extreme length_penalty > 0: the divisor past the floats, the score 0 to the floats
        return cumulative_logprob * 0.0
    except ZeroDivisionError:  # an extreme length_penalty < 0: the divisor below them, the score past them
        return -math.inf if cumulative_logprob < 0 else 0.0


def create_sort_beams_key_function(eos_token_id: int | None,
                                   length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    def sort_beams_key(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, length_penalty)

    return sort_beams_key


class BeamSearchInstance:
    """One prompt's search state. `step_prompts()` are the requests of the next step (one per live beam), and
    `advance(outputs)` takes their one-token outputs, in the same order, and keeps the best continuations."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_id: int | None,
                 max_model_len: int, cache_salt: str | None = None):
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self.cache_salt = cache_salt  # kept on every beam's request: they share blocks with each other only
        self.beams = [BeamSearchSequence(tokens=list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.num_steps = 0
        self.sort_key = create_sort_beams_key_function(eos_token_id, params.length_penalty)

    @property
    def done(self) -> bool:
        return not self.beams or self.num_steps >= self.params.max_tokens

    def step_params(self) -> SamplingParams:
        """Each beam's request: one token, 2 x beam_width candidates (Hugging Face's and vLLM's number, so that
        beam_width non-EOS candidates remain even when EOS ends some)."""
        return SamplingParams(logprobs=2 * self.params.beam_width, max_tokens=1,
                              temperature=self.params.temperature)

    def step_prompts(self) -> list[dict[str, Any]]:
        prompts = []
        for beam in self.beams:
            prompt: dict[str, Any] = {"prompt_token_ids": beam.tokens}
            if self.cache_salt is not None:
                prompt["cache_salt"] = self.cache_salt
            prompts.append(prompt)
        return prompts

    def advance(self, outputs: list[CompletionOutput | None]) -> None:
        """Extend each live beam by each of its candidates; EOS candidates end (unless ignore_eos), the best
        beam_width others live on. A beam whose request returned nothing (aborted) has no continuation."""
        if len(outputs) != len(self.beams):
            raise ValueError(f"advance: {len(outputs)} outputs for {len(self.beams)} beams")
        candidates: list[BeamSearchSequence] = []
        for beam, out in zip(self.beams, outputs):
            if out is None or not out.logprobs:
                continue
            step_logprobs = out.logprobs[0]
            for token_id, logprob in step_logprobs.items():
                new = BeamSearchSequence(tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [step_logprobs],
                                         cum_logprob=beam.cum_logprob + logprob)
                if token_id == self.eos_token_id and not self.params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", token_id
                    self.completed.append(new)
                else:
                    candidates.append(new)
        # equal lengths: the score orders them as their cumulative logprobs do; ties keep the candidates' order
        self.beams = sorted(candidates, key=self.sort_key, reverse=True)[:self.params.beam_width]
        self.num_steps += 1
        # a beam that fills the model's context can take no further token: it ends here
        full = [b for b in self.beams if len(b.tokens) >= self.max_model_len]
        if full:
            self.beams = [b for b in self.beams if len(b.tokens) < self.max_model_len]
            for beam in full:
                beam.finish_reason = "length"
            self.completed.extend(full)

    def best(self) -> list[BeamSearchSequence]:
        """The ended and the live beams ranked together, the best beam_width of them (finish_reason set)."""
        for beam in self.beams:
            beam.finish_reason = beam.finish_reason or "length"
        ranked = sorted(self.completed + self.beams, key=self.sort_key, reverse=True)
        return ranked[:self.params.beam_width]


def generated_tokens(beam: BeamSearchSequence, prompt_len: int, keep_eos: bool) -> list[int]:
    """The beam's tokens after the prompt; the EOS that ended it only with `keep_eos`."""
    tokens = beam.tokens[prompt_len:]
    if beam.finish_reason == "stop" and not keep_eos:
        tokens = tokens[:-1]
    return tokens


def to_request_output(request_id: str, prompt: str | None, instance: BeamSearchInstance,
                      decode: Callable[[list[int]], str], num_logprobs: int | None = None) -> RequestOutput:
    """A finished search as one RequestOutput whose choices are the best beams, best first (the server's shape,
    vLLM's): `token_ids` the generated tokens (the EOS only with include_stop_str_in_output), `text` their text
    without the EOS, `cumulative_logprob`, `finish_reason` "stop" or "length", and with `num_logprobs` (the
    request's logprobs count; None: no logprobs) per returned token its logprob and the `num_logprobs` most likely
    of that step's candidates."""
    prompt_len = len(instance.prompt_token_ids)
    keep_eos = instance.params.include_stop_str_in_output
    outputs = []
    for i, beam in enumerate(instance.best()):
        token_ids = generated_tokens(beam, prompt_len, keep_eos)
        outputs.append(CompletionOutput(
            index=i, text=decode(generated_tokens(beam, prompt_len, keep_eos=False)), token_ids=token_ids,
            cumulative_logprob=beam.cum_logprob,
            logprobs=None if num_logprobs is None else [top_logprobs(t, step, num_logprobs)
                                                        for t, step in zip(token_ids, beam.logprobs)],
            finish_reason=beam.finish_reason, stop_reason=beam.stop_reason))
    return RequestOutput(request_id, prompt, list(instance.prompt_token_ids), outputs, finished=True)


def top_logprobs(token_id: int, candidates: dict[int, float], num: int) -> dict[int, float]:
    """A step's entry as the engine writes it for `logprobs=num`: the chosen token, then the num most likely."""
    top = sorted(candidates.items(), key=lambda kv: -kv[1])[:num]
    return {token_id: candidates[token_id], **dict(top)}


class BeamSearchStream:
    """A beam search run as requests on an AsyncLLMEngine, behind a RequestStream's interface: iterating it
    yields one finished RequestOutput (to_request_output: the best beams as its choices, best first), and
    `aclose()` before that aborts the step in flight, freeing its KV blocks. Build it with `start`, which queues
    the first step, so a bad prompt or a full queue raises there, before any response is sent."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, prompt: str | None, instance: BeamSearchInstance,
                 decode: Callable[[list[int]], str], priority: int, num_logprobs: int | None):
        self.engine = engine
        self.request_id = request_id
        self.prompt = prompt
        self.instance = instance
        self.decode = decode
        self.priority = priority
        self.num_logprobs = num_logprobs
        self._step: list[RequestStream] = []  # the step in flight: one stream per live beam
        self.finished = False  # the finished output was handed out
        self.closed = False

    @classmethod
    async def start(cls, engine: AsyncLLMEngine, request_id: str, prompt: dict[str, Any], params: BeamSearchParams,
                    decode: Callable[[list[int]], str], priority: int = 0,
                    num_logprobs: int | None = None) -> "BeamSearchStream":
        """`prompt`: {"prompt_token_ids": [...], "prompt": text or None, "cache_salt": ...}. `decode` turns the
        returned beams' token ids into their text; `num_logprobs` (at most 2 x beam_width, a step's candidates):
        the alternatives returned per token (None: no logprobs). Raises ValueError for bad parameters or a bad
        prompt, and whatever AsyncLLMEngine.add_request raises."""
        params.validate(engine.config.max_logprobs)
        if num_logprobs is not None and not 0 <= num_logprobs <= 2 * params.beam_width:
            raise ValueError(f"logprobs must be in [0, {2 * params.beam_width}] with beam search (each step's "
                             f"candidates: 2 x the beam width), got {num_logprobs}")
        ids = list(prompt["prompt_token_ids"])
        instance = BeamSearchInstance(ids, params, engine.engine.eos_token_id, engine.max_model_len,
                                      prompt.get("cache_salt"))
        stream = cls(engine, request_id, prompt.get("prompt"), instance, decode, priority, num_logprobs)
        await stream._launch_step()
        return stream

    async def _launch_step(self) -> None:
        params, step = self.instance.step_params(), self.instance.num_steps
        try:
            for i, prompt in enumerate(self.instance.step_prompts()):
                self._step.append(await self.engine.add_request(f"{self.request_id}-beam{step}-{i}", prompt,
                                                                params, self.priority))
        except BaseException:
            await self._close_step()
            raise

    async def _close_step(self) -> None:
        streams, self._step = self._step, []
        for s in streams:
            await s.aclose()

    async def _search(self) -> RequestOutput:
        while True:
            finals = []
            for s in self._step:
                last = None
                async for out in s:
                    last = out
                finals.append(last.outputs[0] if last is not None else None)
            self._step = []
            self.instance.advance(finals)
            if self.instance.done:
                return to_request_output(self.request_id, self.prompt, self.instance, self.decode,
                                         self.num_logprobs)
            await self._launch_step()

    def __aiter__(self) -> "BeamSearchStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.closed:
            raise StopAsyncIteration
        try:
            output = await self._search()
        except BaseException:
            await self.aclose()
            raise
        self.finished = self.closed = True
        return output

    async def aclose(self) -> None:
        """Stop; a step still in flight is aborted (its blocks freed)."""
        if not self.closed:
            self.closed = True
            await self._close_step()
