"""A narrated trace of a few chats through the engine, step by step, on the CPU.

    python -m nanoserve.walkthrough                      # every mechanism in one run, on m3-mini
    python -m nanoserve.walkthrough --scenario prefix    # or: chunk, preempt
    python -m nanoserve.walkthrough --pause -v           # wait for Enter between steps; show everything
    python -m nanoserve.walkthrough --model m3-tiny      # another model: a preset or a checkpoint directory
    python -m nanoserve.walkthrough --scenario image     # images: m3-tiny-vl (m3-mini reads no pictures)

It builds a real engine on the trained m3-mini (docs/m3_mini.md), sends a handful of chats chosen to make each
mechanism happen, and after every engine step prints what happened in plain words. Nothing in the narration is
scripted: every line is derived from the engine's real state -

- the engine's observer events (LLMEngine.add_observer): admit, chunk, preempt, finish, allocate, free, evict,
  prefix_hit and step;
- the block manager's tables and reference counts, and the scheduler's queues;
- the model's tracing hook (M3ForCausalLM.set_trace): which KV blocks an MSA layer selected, which experts an MoE
  layer routed each token to;
- engine.stats, whose counters the closing summary compares with what was narrated.

The scenarios only choose the inputs: the chats (rendered with the model's chat template), when each arrives,
the token budget and the KV pool size. Lengths are in KV blocks, so a scenario holds for any model: the long
document is fit to the model's MSA top-k plus three blocks, so that MSA really drops blocks. The pool of a
scenario that shows a preemption is sized by a silent rehearsal of the same run, to be exactly full once the last
request is admitted. The engine runs with the plain reference kernels (no Triton), which are fast at this size on
any CPU.
"""

from __future__ import annotations

import argparse
import bisect
import math
import os
import random
import sys
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

import torch
from PIL import Image, ImageDraw

from nanoserve.chat_template import MediaPart, render_chat, template_messages
from nanoserve.config import EngineConfig, Optimizations
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.tokenizer import load_tokenizer
from nanoserve.kernels import reference
from nanoserve.model.loader import has_vision_model, read_config, read_vision_config
from nanoserve.model.m3_config import M3Config
from nanoserve.multimodal.features import process_prompt
from nanoserve.multimodal.processor import MultiModalProcessor
from nanoserve.presets.catalog import DEFAULT_MODEL, MODEL_NAMES, PRESETS, get_preset
from nanoserve.presets.resolve import resolve_model_dir
from nanoserve.sampling import SamplingParams

DETAILS = ("low", "normal", "high")
IMAGE_MODEL = "m3-tiny-vl"
"""The image scenario's model when the one asked for has no vision tower: m3-tiny with a tiny random one."""
ANSWER_CHARS = 100  # how much of an answer to quote
RULE_WIDTH = 110
INDENT = 15  # the column where the text after a [tag] starts


# ------------------------------------------------------------------------------------------------------------
# Scenarios: the inputs only (the chats, their arrivals, the budget, the pool). Lengths are in KV blocks (the KV
# block size is the MSA block size: 64 tokens on m3-mini, 16 on m3-tiny).
# ------------------------------------------------------------------------------------------------------------

SYSTEM_PROMPT = "You are a friendly assistant. Keep answers short."
CHAT_KWARGS = {"thinking_mode": "disabled"}  # answers without a <mm:think> block: short, and easy to read
DOC_INTRO = "Read the text below and answer the question."
PASS_KEYS = (("Alice Smith", "482913"), ("Kenji Tanaka", "105276"), ("Grace Okafor", "639048"),
             ("Omar Haddad", "771530"))
KEY_AT = (0.2, 0.45, 0.65, 0.85)  # where in the filler each pass key is written (fraction of its sentences)


def _filler() -> list[str]:
    """Plain sentences (fixed: seed 0) for the document the pass keys hide in."""
    rng = random.Random(0)
    adjectives = ("quiet", "small", "old", "bright", "narrow", "wooden", "green", "cold", "busy", "calm", "golden",
                  "hidden")
    nouns = ("river", "bridge", "library", "garden", "market", "tower", "harbor", "orchard", "lantern", "station",
             "museum", "meadow", "bakery", "mirror", "ladder", "violin")
    cities = ("Lisbon", "Oslo", "Vienna", "Prague", "Dublin", "Kyoto", "Lima", "Seville", "Bergen", "Porto",
              "Naples", "Tunis")
    months = ("March", "April", "May", "June", "July", "August")
    people = ("Nina", "Oscar", "Paula", "Leo", "Vera", "Theo")
    shapes = ("The {a} {n} is near the {n2}.", "A {a} {n} stood beside the {n2} in {c}.",
              "Every {m}, the {n} of {c} becomes {a}.", "{p} found a {a} {n} behind the {n2}.",
              "People in {c} talk about the {n} and the {n2}.", "Nobody expected the {n} to be so {a}.",
              "In {m}, {p} went to {c} to see the {n}.")
    return [rng.choice(shapes).format(a=rng.choice(adjectives), n=rng.choice(nouns), n2=rng.choice(nouns),
                                      c=rng.choice(cities), m=rng.choice(months), p=rng.choice(people))
            for _ in range(400)]


FILLER = _filler()


@dataclass(frozen=True)
class Document:
    """`sentences` sentences of filler from sentence `start` on, with every pass key written between two of
    them (at KEY_AT), then the first `tail` words of the sentences after them (so that a length in tokens can be
    met exactly)."""

    sentences: int
    tail: int = 0
    start: int = 0

    @property
    def text(self) -> str:
        body = FILLER[self.start: self.start + self.sentences]
        parts, prev = [], 0
        for f, (name, key) in zip(KEY_AT, PASS_KEYS):
            cut = round(f * len(body))
            parts += body[prev:cut] + [f"The pass key of {name} is {key}."]
            prev = cut
        parts += body[prev:]
        if self.tail:
            parts.append(" ".join(" ".join(FILLER[self.start + self.sentences:]).split()[: self.tail]))
        return " ".join(parts)

    @property
    def words(self) -> int:
        return len(self.text.split())


def ask_key(name: str) -> str:
    return f"What is the pass key of {name}?"


@dataclass
class Ask:
    """One request: a chat the scenario sends - a question, after the scenario's document when `doc` is set."""

    name: str  # the request id, one letter so block maps stay readable
    role: str  # why the scenario sends it (printed once, before step 1)
    question: str
    max_tokens: int
    arrives: int = 1  # added to the engine just before this step ...
    doc: bool = False
    after_prefill: str | None = None  # ... but only once this request's prompt is all in the KV cache
    after_finish: tuple[str, ...] = ()  # ... and only once these requests have finished (a client's next chat)
    image: int | None = None  # the picture it sends (a seed of `picture`), in its user turn ...
    lead: str = ""  # ... after this text (else before its question)


@dataclass
class Scenario:
    name: str
    title: str
    asks: list[Ask]
    doc_blocks: int  # the first chat with the document is fit to this many KV blocks, less one token
    budget_share: float  # max_num_batched_tokens: this share of the longest chat's blocks, rounded up, but
    # never less than what a chat without a document needs (so that only the document is chunked)
    kv_blocks: int | None = None  # the KV pool, in blocks; None: sized by a rehearsal (full_after)
    full_after: str | None = None  # the pool is exactly full once this request is admitted
    max_num_seqs: int = 4


SCENARIOS = {
    "all": "every mechanism in one run: a prefix-cache hit, a chunked prefill, MSA dropping blocks, a preemption",
    "image": "images: the placeholder run, the vision model encoding with the prefill, the encoder cache and the "
             "prefix cache keyed by the picture",
    "prefix": "prefix caching: shared blocks, and cached blocks revived after their owner finished",
    "chunk": "chunked prefill: a long prompt split across steps, beside a running decode",
    "preempt": "preemption: a KV pool too small for two growing sequences",
}


def scenario(name: str, cfg: M3Config) -> Scenario:
    """The scenario `name` for a model: the long document is the MSA top-k plus three blocks, so that its
    queries really drop blocks."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}")
    long = cfg.index_topk_blocks + 3
    title = SCENARIOS[name]
    hello = "Hello! Who are you?"
    if name == "all":
        return Scenario(name, title, [
            Ask("A", "a greeting", hello, max_tokens=32),
            Ask("L", "a question after a long document: more than one step's token budget, so it is chunked, and "
                     "more blocks than MSA keeps, so MSA drops some", ask_key("Kenji Tanaka"), max_tokens=24,
                arrives=2, doc=True),
            Ask("B", "another question about the same document, once L's prompt is cached: a long prefix-cache "
                     "hit; the pool is then full, so the next block anyone needs preempts B",
                ask_key("Grace Okafor"), max_tokens=24, arrives=3, doc=True, after_prefill="L")],
            doc_blocks=long, budget_share=0.4, full_after="B")
    if name == "image":
        look = "What is in this picture?"
        return Scenario(name, title, [
            Ask("P", "a picture and a question; the step's token budget ends inside the picture's placeholders, so "
                     "its features are made in one step and used in two", look, max_tokens=8, image=1),
            Ask("Q", "another question about the same picture, with new text before it: no prefix-cache hit on "
                     "the picture's blocks, but its features are still in the encoder cache", "What colour is it?",
                max_tokens=8, arrives=2, image=1, lead="One more question.", after_finish=("P",)),
            Ask("R", "P's chat with another picture: the same tokens, but the blocks holding the picture hash its "
                     "content, so only the blocks before it are found in the prefix cache", look, max_tokens=8,
                arrives=3, image=2, after_finish=("Q",))],
            doc_blocks=0, budget_share=0.0, kv_blocks=24)
    if name == "prefix":
        return Scenario(name, title, [
            Ask("A", "a question after a short document", ask_key("Alice Smith"), max_tokens=16, doc=True),
            Ask("B", "the same document while A still runs: shares A's full blocks", ask_key("Omar Haddad"),
                max_tokens=16, arrives=2, doc=True),
            Ask("C", "the same document after A and B finished: revives their freed, cached blocks",
                ask_key("Grace Okafor"), max_tokens=16, arrives=3, doc=True, after_finish=("A", "B"))],
            doc_blocks=4, budget_share=1.5, kv_blocks=16)
    if name == "chunk":
        return Scenario(name, title, [
            Ask("A", "a short chat that is decoding while the long one arrives", hello, max_tokens=24),
            Ask("L", "a question after a long document, several times the token budget: computed in chunks",
                ask_key("Kenji Tanaka"), max_tokens=8, arrives=2, doc=True)],
            doc_blocks=long, budget_share=0.25, kv_blocks=2 * long + 4)
    return Scenario(name, title, [
        Ask("A", "a question after a short document, one token short of a block boundary: its second new token "
                 "needs a new block", ask_key("Alice Smith"), max_tokens=16, doc=True),
        Ask("B", "a greeting, arriving next: the pool is full once it is admitted", hello, max_tokens=16,
            arrives=2)],
        doc_blocks=2, budget_share=1.5, full_after="B")


@dataclass
class Prompt:
    """A request's rendered chat: its token ids, and what the narration says about it."""

    ask: Ask
    ids: list[int]
    doc_words: int  # words in its document (0: none)
    key_block: int | None  # the KV block (entry of its block table) where the asked pass key is written
    features: list = field(default_factory=list)  # its picture, as the engine takes it (MultiModalFeature)


def _chat_ids(tok: Any, question: str, doc: str | None) -> tuple[str, list[int]]:
    user = f"{DOC_INTRO}\n\n{doc}\n\n{question}" if doc is not None else question
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    text = render_chat(tok, messages, chat_template_kwargs=CHAT_KWARGS)
    return text, tok.encode(text, add_special_tokens=False)


def _fit_document(tok: Any, question: str, blocks: int, block_size: int) -> Document:
    """The document that makes the chat exactly `blocks` KV blocks less one token (or the longest below that
    when none lands exactly); at least one block more than the shortest document needs."""
    def length(doc: Document) -> int:
        return len(_chat_ids(tok, question, doc.text)[1])

    target = max(blocks, -(-length(Document(0)) // block_size) + 1) * block_size - 1
    best = Document(0)
    for start in range(8):  # another stretch of the filler tokenizes to other lengths
        most = bisect.bisect_left(range(len(FILLER) // 2), target, key=lambda n: length(Document(n, 0, start))) - 1
        for doc in (Document(n, tail, start) for n in (most, most - 1) if n >= 0 for tail in range(25)):
            size = length(doc)
            if size == target:
                return doc
            if length(best) < size < target:
                best = doc
    return best


def _key_block(tok: Any, text: str, name: str, block_size: int) -> int:
    """The KV block in which the pass key of `name` is written."""
    at = text.index(f"The pass key of {name} is")
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    token = next(i for i, (start, end) in enumerate(offsets) if end > at)
    return token // block_size


def picture(seed: int) -> Image.Image:
    """A small drawing (112 x 140 px: 20 image tokens): a disc and a bar on a plain background."""
    rng = random.Random(seed)
    image = Image.new("RGB", (140, 112), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    x, y = rng.randrange(10, 70), rng.randrange(10, 50)
    draw.ellipse((x, y, x + 50, y + 50), fill=tuple(rng.randrange(256) for _ in range(3)))
    draw.rectangle((10, 95, 130, 102), fill=tuple(rng.randrange(256) for _ in range(3)))
    return image


def _image_chat(model_dir: str, tok: Any, ask: Ask) -> tuple[list[int], list]:
    """The chat of an image request: its user turn holds the picture (rendered as ]<]image[>[ by the template,
    expanded by the processor) - the ids and the engine's features."""
    parts = [{"type": "text", "text": ask.lead}] if ask.lead else []
    parts += [{"type": "image_pil", "image_pil": picture(ask.image)}, {"type": "text", "text": ask.question}]
    media: list[MediaPart] = []
    messages = template_messages([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": parts}],
                                 media)
    text = render_chat(tok, messages, chat_template_kwargs=CHAT_KWARGS)
    vision = read_vision_config(model_dir)
    return process_prompt(MultiModalProcessor.from_model_dir(model_dir), tok, text, vision,
                          [m.source for m in media])


def build_prompts(tok: Any, sc: Scenario, block_size: int, model_dir: str | None = None) -> dict[str, Prompt]:
    """Render every chat of the scenario. The document is fit to the first chat that reads it; the others read
    the same document (so that they share its KV blocks), whatever their question's length."""
    doc = None
    prompts = {}
    for ask in sc.asks:
        if ask.image is not None:
            ids, features = _image_chat(model_dir, tok, ask)
            prompts[ask.name] = Prompt(ask, ids, 0, None, features)
            continue
        if not ask.doc:
            prompts[ask.name] = Prompt(ask, _chat_ids(tok, ask.question, None)[1], 0, None)
            continue
        if doc is None:
            doc = _fit_document(tok, ask.question, sc.doc_blocks, block_size)
        text, ids = _chat_ids(tok, ask.question, doc.text)
        name = next((n for n, _ in PASS_KEYS if ask.question == ask_key(n)), None)
        prompts[ask.name] = Prompt(ask, ids, doc.words, _key_block(tok, text, name, block_size) if name else None)
    return prompts


def reference_optimizations() -> Optimizations:
    """Every kernel switch off (plain PyTorch reference kernels); the scheduling switches stay on, but for
    overlap_scheduling: the narration reports each step's sampled tokens when that step returns."""
    return Optimizations.reference_kernels().replace(cuda_graphs=False, overlap_scheduling=False)


def build_engine(model: str, sc: Scenario, prompts: dict[str, Prompt], kv_blocks: int, block_size: int
                 ) -> LLMEngine:
    """A CPU engine on `model` whose KV pool and token budget are the scenario's; a sequence may be as long as
    the longest chat plus its answer."""
    longest = max(len(p.ids) + p.ask.max_tokens for p in prompts.values())
    budget = budget_blocks(sc, prompts, block_size) * block_size
    first = next((p.features[0] for p in prompts.values() if p.features), None)
    if first is not None:  # the first chunk ends halfway into the first picture's placeholders
        budget = first.offset + first.num_tokens // 2
    return LLMEngine(EngineConfig(
        model=model, device="cpu", optimizations=reference_optimizations(),
        max_model_len=min(longest, kv_blocks * block_size), max_num_batched_tokens=budget,
        num_gpu_blocks_override=kv_blocks, max_num_seqs=sc.max_num_seqs))


def budget_blocks(sc: Scenario, prompts: dict[str, Prompt], block_size: int) -> int:
    """The scenario's token budget, in blocks (Scenario.budget_share)."""
    blocks = [-(-len(p.ids) // block_size) for p in prompts.values()]
    short = [b for b, p in zip(blocks, prompts.values()) if not p.doc_words]
    return max(math.ceil(max(blocks) * sc.budget_share), max(short, default=0) + 1)


def _line(tag: str, text: str) -> str:
    """'  [tag]        text', wrapped under the text."""
    label = f"[{tag}]" if tag else ""
    return textwrap.fill(text, RULE_WIDTH, initial_indent=f"  {label:<{INDENT - 2}}", subsequent_indent=" " * INDENT,
                         break_on_hyphens=False)


# ------------------------------------------------------------------------------------------------------------
# The narrator. Each event is put into words the moment it happens, while the state it describes (free blocks,
# reference counts, a sequence's progress) is still true; the words are printed once engine.step() returns.
# ------------------------------------------------------------------------------------------------------------


@dataclass
class Narrated:
    """Totals of what the narration reported, to set against engine.stats (the summary and the test do)."""

    steps: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    chunks: int = 0
    evictions: int = 0
    msa_selections: int = 0
    moe_routings: int = 0
    finished: int = 0
    encoded: int = 0  # pictures the vision model encoded
    encoder_hits: int = 0  # pictures whose features came from the encoder cache


@dataclass
class Row:
    """One sequence of the batch being run, as the step event saw it (before the step advanced it)."""

    seq: Sequence
    name: str
    start: int  # tokens already in the KV cache
    num_new: int  # tokens computed this step
    token_ids: list[int]  # those new tokens
    samples: bool  # does this step end with a new token sampled for it?


_SAMPLED = object()  # where, among a step's lines, the sampled tokens are reported


class Narrator:
    """Engine observer (LLMEngine.add_observer) and model trace hook (M3ForCausalLM.set_trace) in one."""

    def __init__(self, engine: LLMEngine, detail: str, out: TextIO, key_blocks: dict[str, int] | None = None):
        """`key_blocks`: request -> the block where the pass key it asks for is written (the MSA lines say
        which KV groups kept it)."""
        self.engine = engine
        self.key_blocks = key_blocks or {}
        self.bm = engine.block_manager
        self.tok = engine.tokenizer
        self.detail = DETAILS.index(detail)  # 0 low, 1 normal, 2 high
        self.out = out
        self.count = Narrated()
        self.lines: list[Any] = []  # this step's (level, text) lines, and the _SAMPLED marker
        self.rows: list[Row] = []  # this step's batch
        self.owner: dict[int, str] = {}  # block id -> the request it was last handed to
        self._last_free: tuple[Sequence | None, int] = (None, -1)  # (sequence, line index) of the latest free
        cfg = engine.model_config
        # One layer of each kind is narrated: the first MSA layer and the first MoE layer.
        self.msa_layer = next((i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_attention(i)), None)
        self.moe_layer = next((i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)), None)
        self.topk = cfg.index_topk_blocks
        self.said_dense: set[str] = set()  # sequences whose dense MSA (no more than top-k blocks) was narrated
        self.num_experts = cfg.num_local_experts

    # -- words ----------------------------------------------------------------------------------------------
    def tag(self, tag: str, text: str, level: int = 0) -> None:
        """Queue a line shown at detail >= level (0 low, 1 normal, 2 high)."""
        self.lines.append((level, _line(tag, text)))

    def print(self, text: str = "") -> None:
        print(text, file=self.out)

    def quote(self, ids: list[int], chars: int = ANSWER_CHARS) -> str:
        text = self.tok.decode(ids, skip_special_tokens=True)
        return repr(text if len(text) <= chars else text[:chars] + "...")

    def token(self, token_id: int) -> str:
        """One token as text; a piece of a multi-byte character (or a control character) by its id instead."""
        text = self.tok.decode([token_id])
        return repr(text) if text.isprintable() and "\ufffd" not in text else f"<token {token_id}>"

    @staticmethod
    def ids(blocks: list[int]) -> str:
        return " ".join(map(str, blocks))

    # -- engine events --------------------------------------------------------------------------------------
    def on_event(self, event: str, **p: Any) -> None:
        """LLMEngine observer: one handler per event, `_<event>(**payload)`. Handlers take **_ so the engine
        may add payload keys (or events) without breaking the narration."""
        if self.rows and event != "step" and _SAMPLED not in self.lines:
            self.lines.append(_SAMPLED)  # the model has run: report the sampled tokens before what follows
        handler = getattr(self, f"_{event}", None)
        if handler is not None:
            handler(**p)

    def _before_free(self, seq: Sequence, tag: str, text: str) -> None:
        """Add a line that explains why seq's blocks were just freed. The block manager reports the free first;
        the line goes before it, so the cause reads before the effect."""
        self.tag(tag, text)
        freed, at = self._last_free
        if freed is seq and at == len(self.lines) - 2:
            self.lines[at], self.lines[at + 1] = self.lines[at + 1], self.lines[at]

    def _allocate(self, seq: Sequence, blocks: list[int], **_: Any) -> None:
        first = len(seq.block_table) - len(blocks)  # the new blocks are the table's last entries
        bs = self.bm.block_size
        for b in blocks:
            self.owner[b] = seq.request_id
        free = self.bm.num_free_blocks
        self.tag("allocate", f"{seq.request_id} gets block{'s' * (len(blocks) > 1)} {self.ids(blocks)} for its "
                 f"tokens {first * bs}-{(first + len(blocks)) * bs - 1}; {free} block{'s' * (free != 1)} free "
                 f"left", level=1)

    def _prefix_hit(self, seq: Sequence, blocks: list[int], tokens: int, **_: Any) -> None:
        self.count.prefix_hit_tokens += tokens
        revived = [b for b in blocks if self.bm.blocks[b].ref_count == 1]  # nobody else holds it: was free
        shared = [b for b in blocks if b not in revived]
        owners = sorted({self.owner[b] for b in blocks if b in self.owner})
        whose = ("its own, from before its preemption" if owners == [seq.request_id] else
                 f"computed for {', '.join(owners)}")
        how = []
        if shared:
            how.append(f"{self.ids(shared)} now shared (ref count > 1)")
        if revived:
            how.append(f"{self.ids(revived)} revived from the free list, where {'it' if len(revived) == 1 else 'they'}"
                       f" kept {'its' if len(revived) == 1 else 'their'} content")
        self.tag("prefix hit", f"{seq.request_id}: reuses {tokens} cached tokens, blocks {self.ids(blocks)}"
                 + (f" ({whose})" if owners else "") + f": {'; '.join(how)}. "
                 f"Those tokens are not computed again.")

    def _evict(self, block: int, **_: Any) -> None:
        self.count.evictions += 1
        was = self.owner.get(block)
        self.tag("evict", f"block {block}{f' (last used by {was})' if was else ''} was free but still held a "
                 f"cached prefix; the pool hands it out again, so that prefix is forgotten")

    def _admit(self, seq: Sequence, num_new_tokens: int, num_cached_tokens: int, **_: Any) -> None:
        again = seq.num_preemptions > 0
        what = f"{num_new_tokens} tokens to {'recompute' if again else 'compute'}"
        if num_cached_tokens:
            what += f", {num_cached_tokens} more found in the prefix cache"
        self.tag("admit", f"{seq.request_id}{' (again, after its preemption)' if again else ''}: first in the "
                 f"waiting queue, and the budget and the pool have room: {what}")
        for f in seq.mm_features:
            (_, h, w), bs = f.grid_thw[0], self.bm.block_size
            self.tag("image", f"{seq.request_id}'s picture is {f.num_tokens} placeholder tokens, tokens "
                     f"{f.offset}-{f.end - 1} (]<]image[>[ x {f.num_tokens} between ]<]start of image[>[ and "
                     f"]<]end of image[>[): {h} x {w} patches of 14 px, one token per 2 x 2 of them. Its content "
                     f"hash {f.identifier[:8]} keys its encoder-cache entry and the KV blocks "
                     f"{f.offset // bs}-{(f.end - 1) // bs} that hold it")

    def _chunk(self, seq: Sequence, num_new_tokens: int, remaining: int, **_: Any) -> None:
        self.count.chunks += 1
        start = seq.num_computed_tokens
        self.tag("chunk", f"{seq.request_id}: only tokens {start}-{start + num_new_tokens - 1} fit this step's "
                 f"token budget; the other {remaining} wait for the next step (chunked prefill)")

    def _preempt(self, seq: Sequence, needed_by: Sequence | None = None, **_: Any) -> None:
        self.count.preemptions += 1
        need = needed_by or seq
        cause = (f"{need.request_id} needs another KV block and the pool is empty, so the newest running "
                 f"sequence, {seq.request_id}, gives way" if need is not seq else
                 f"{seq.request_id} needs more KV blocks than are free, and no newer sequence can give way")
        self._before_free(seq, "preempt", f"{cause}. {seq.request_id} returns its blocks and goes back to the front "
                          f"of the waiting queue; its tokens will be computed again later (preemption by recompute).")

    def _free(self, seq: Sequence, blocks: list[int], **_: Any) -> None:
        self._last_free = (seq, len(self.lines))
        held = [b for b in blocks if self.bm.blocks[b].ref_count > 0]
        cached = [b for b in blocks if b not in held and self.bm.blocks[b].hash is not None]
        text = f"{seq.request_id} returns blocks {self.ids(blocks)}; {self.bm.num_free_blocks} free now"
        if held:
            text += f"; {self.ids(held)} still in use by another sequence"
        if cached:
            text += f"; {self.ids(cached)} keep their cached prefix until handed out again"
        self.tag("free", text, level=1)

    def _finish(self, seq: Sequence, reason: str, **_: Any) -> None:
        self.count.finished += 1
        self._before_free(seq, "finish", f"{seq.request_id}: {len(seq.output_token_ids)} tokens generated (finish "
                          f"reason '{reason}'): {self.quote(seq.output_token_ids)}")

    def _step(self, scheduled: list[Any], preempted: list[Sequence], model_input: Any, **_: Any) -> None:
        self.rows, i = [], 0
        for s in scheduled:
            ids = model_input.input_ids[i: i + s.num_new_tokens]
            i += s.num_new_tokens
            self.rows.append(Row(s.seq, s.seq.request_id, s.seq.num_computed_tokens, s.num_new_tokens, ids, s.samples))
        budget = self.engine.max_num_batched_tokens
        used = sum(r.num_new for r in self.rows)
        parts = []
        for s, r in zip(scheduled, self.rows):
            if s.is_decode:
                parts.append(f"{r.name} decodes 1")
            else:
                last = " (its last chunk)" if r.samples and r.start > s.seq.num_cached_tokens else ""
                parts.append(f"{r.name} prefills {r.num_new} (tokens {r.start}-{r.start + r.num_new - 1}){last}")
        self.tag("batch", f"{used} of the {budget}-token budget: {'; '.join(parts)}")
        self.tag("", "(decodes first, then prefills; running sequences are served before waiting ones)", level=2)
        self._vision(scheduled, model_input)
        for name, why in self._waiting_reasons(preempted, budget - used):
            self.tag("waiting", f"{name}: {why}")

    def _vision(self, scheduled: list[Any], model_input: Any) -> None:
        """What the step's images do: the ones the vision model encodes, the ones whose features come from the
        encoder cache, the entries the runner drops."""
        encoded = {e.key for e in model_input.encoder_inputs}
        for s in scheduled:
            end = s.seq.num_computed_tokens + s.num_new_tokens
            for key, f in s.features:
                rest = f" (this step computes its tokens up to {end - 1}: the rest of its features wait in the " \
                    f"encoder cache for the next chunk)" if f.end > end else ""
                if key in encoded:
                    self.count.encoded += 1
                    self.tag("encode", f"the vision model encodes {s.seq.request_id}'s picture in this step, before "
                             f"the text model: {f.num_tokens} feature rows, which replace the embeddings of its "
                             f"placeholder tokens{rest}")
                    encoded.discard(key)
                elif f.offset >= s.seq.num_computed_tokens:
                    self.count.encoder_hits += 1
                    self.tag("features", f"{s.seq.request_id}'s picture (hash {f.identifier[:8]}) was encoded "
                             f"before and its features are still in the encoder cache: the vision model does not "
                             f"run for it")
        for key in model_input.encoder_frees:
            self.tag("features", f"the encoder cache drops the entry {key[:8]} to make room", level=1)

    def _waiting_reasons(self, preempted: list[Sequence], left: int) -> list[tuple[str, str]]:
        """Why each waiting sequence was not admitted, from the state right after scheduling (this mirrors the
        admission loop of Scheduler.schedule)."""
        sched, bm = self.engine.scheduler, self.bm
        waiting = list(sched.waiting)
        if not waiting:
            return []
        head = waiting[0]
        if preempted:
            why = "a step that had to preempt admits no one"
        elif left <= 0:
            why = "this step's token budget is spent"
        elif len(sched.running) >= sched.config.max_num_seqs:
            why = f"max_num_seqs={sched.config.max_num_seqs} sequences are running already"
        else:
            computed = bm.computed_blocks(head)
            cached = len(computed) * bm.block_size
            n = min(head.num_tokens - cached, left)
            revive = sum(1 for b in computed if bm.blocks[b].ref_count == 0)  # cached but free: comes off the list
            need = bm.blocks_needed(cached + n) - len(computed) + revive
            why = (f"its next {n} tokens need {need} free block{'s' * (need != 1)}"
                   + (f" ({revive} of them cached blocks of its own, to revive)" if revive else "")
                   + f", but the pool has {bm.num_free_blocks}")
        return [(head.request_id, why)] + [(s.request_id, f"queued behind {head.request_id} (first come, first "
                                                           f"served)") for s in waiting[1:]]

    # -- model trace ----------------------------------------------------------------------------------------
    def on_trace(self, event: str, layer: int, **p: Any) -> None:
        """Model trace hook: narrate one MSA layer and one MoE layer (the first of each)."""
        if event == "msa_select" and layer == self.msa_layer:
            self._msa(layer, **p)
        elif event == "moe_route" and layer == self.moe_layer:
            self._moe(layer, **p)

    def _msa(self, layer: int, index_q: torch.Tensor, index_cache: torch.Tensor, meta: Any,
             selection: torch.Tensor, **_: Any) -> None:
        """For each sequence's newest query: the blocks each KV group dropped, and the scores of those it kept
        (recomputed for that one query with the reference indexer; the own block is forced in, whatever its
        score)."""
        self.count.msa_selections += 1
        bs = meta.block_size
        end = 0
        dense = []  # sequences whose query sees no more than top-k blocks
        for s, row in enumerate(self.rows):
            end += row.num_new
            t = end - 1
            seq_len = meta.seq_lens_cpu[s]
            pos = meta.positions[t: t + 1]
            n_blocks = -(-seq_len // bs)
            if n_blocks <= self.topk:
                dense.append(f"{row.name} ({n_blocks} block{'s' * (n_blocks > 1)})")
                continue
            keys = reference.gather_context(index_cache, meta.block_tables[s], seq_len)
            scores = reference.msa_block_scores(index_q[t: t + 1], keys, pos, bs)[:, 0].tolist()  # [G][block]
            own = int(pos) // bs
            groups = [[b for b in sel if b >= 0] for sel in selection[t].tolist()]
            table = meta.block_tables[s][:n_blocks].tolist()
            where = f" (block b = entry b of {row.name}'s block table {table})" if self.detail >= 2 else ""
            self.tag("MSA", f"layer {layer}, {row.name}'s newest query (position {int(pos)}) sees {n_blocks} blocks, "
                     f"keeps {self.topk} per KV group{where}:")
            for g, kept in enumerate(groups):
                if g > 0 and self.detail < 2:  # group 0 in full (every group at high detail)
                    continue
                dropped = ", ".join(f"{b} ({scores[g][b]:.2f})" for b in range(n_blocks) if b not in kept)
                others = sorted((b for b in kept if b != own), key=lambda b: -scores[g][b])
                text = (f"group {g} drops {dropped}; keeps its own block {own} (forced) and {len(others)} more, "
                        f"scoring {scores[g][others[-1]]:.2f} to {scores[g][others[0]]:.2f}")
                if self.detail >= 2:
                    text += ": " + ", ".join(f"{b} ({scores[g][b]:.2f})" for b in others)
                self.tag("", text)
            if len(groups) > 1 and self.detail < 2:
                self.tag("", "; ".join(f"group {g} drops {self.ids([b for b in range(n_blocks) if b not in kept])}"
                                       for g, kept in enumerate(groups) if g > 0), level=1)
            key = self.key_blocks.get(row.name)
            if key is not None:
                kept_by = [g for g, kept in enumerate(groups) if key in kept]
                self.tag("", f"the pass key {row.name} asks for is written in block {key}: "
                         + ("kept by every group" if len(kept_by) == len(groups) else
                            f"kept by group{'s' * (len(kept_by) != 1)} {self.ids(kept_by)} of {len(groups)}"
                            if kept_by else "dropped by every group"))
        dense = [d for d in dense if d.split()[0] not in self.said_dense]  # said once per sequence
        self.said_dense.update(d.split()[0] for d in dense)
        if dense:
            self.tag("MSA", f"layer {layer}: the newest query of {', '.join(dense)} sees no more than {self.topk} "
                     f"blocks, so the top-{self.topk} selection keeps them all: MSA equals dense attention there",
                     level=1)

    def _moe(self, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor, **_: Any) -> None:
        self.count.moe_routings += 1
        ids, weights = topk_ids.tolist(), topk_weights.tolist()
        load = Counter(e for row in ids for e in row)
        busiest = ", ".join(f"e{e} x{c}" for e, c in load.most_common(3))
        idle = self.num_experts - len(load)
        shown = "" if self.detail >= 2 or len(ids) == len(self.rows) else \
            " Below, the newest token of each sequence (-v: every token):"
        self.tag("MoE", f"layer {layer}: {len(ids)} token{'s' * (len(ids) > 1)}, each sent to {len(ids[0])} of "
                 f"{self.num_experts} experts (and the shared expert); busiest {busiest}; {idle} "
                 f"expert{'s' * (idle != 1)} idle.{shown if self.detail >= 1 else ''}")
        t = 0
        for row in self.rows:
            for j, token in enumerate(row.token_ids):
                if self.detail >= 2 or j == row.num_new - 1:
                    route = ", ".join(f"e{e} {w:.2f}" for e, w in sorted(zip(ids[t], weights[t]), key=lambda x: -x[1]))
                    self.tag("", f"{row.name} {self.token(token):>11} -> {route}", level=1)
                t += 1

    # -- after the step -------------------------------------------------------------------------------------
    def flush(self, number: int, arrivals: list[Prompt]) -> None:
        """Print step `number`: arrivals, the buffered lines, the sampled tokens, block tables and the pool."""
        self.count.steps += 1
        self.print(f"--- step {number} " + "-" * (RULE_WIDTH - 10 - len(str(number))))
        for p in arrivals:
            doc = f"a {p.doc_words}-word document with {len(PASS_KEYS)} pass keys, then " if p.doc_words else \
                "a picture, then " if p.features else ""
            self.print(_line("arrive", f"{p.ask.name}: a {len(p.ids)}-token chat: {doc}{p.ask.question!r}; up to "
                             f"{p.ask.max_tokens} new tokens"))
        if _SAMPLED not in self.lines:
            self.lines.append(_SAMPLED)
        for item in self.lines:
            if item is _SAMPLED:
                self._sampled()
            elif self.detail >= item[0]:
                self.print(item[1])
        if not self.rows:
            self.print("  (nothing could run this step)")
        self._tables()
        self.lines, self.rows = [], []

    def _sampled(self) -> None:
        toks = [f"{r.name} {self.token(r.seq.output_token_ids[-1])}" for r in self.rows if r.samples]
        if toks and self.detail >= 1:
            self.print(_line("sample", f"one new token each: {', '.join(toks)}"))

    def _tables(self) -> None:
        if self.detail < 1:
            return
        running = self.engine.scheduler.running
        shared = {b for s in running for b in s.block_table if self.bm.blocks[b].ref_count > 1}
        for i, seq in enumerate(running):
            table = " ".join(f"{b}*" if b in shared else str(b) for b in seq.block_table)
            self.print(_line("tables" if i == 0 else "", f"{seq.request_id} [{table}]  {seq.num_computed_tokens} "
                             f"of {seq.num_tokens} tokens in the KV cache"))
        if shared:
            self.print(_line("", "(* = shared: the same physical block in several block tables)"))
        cached = sum(1 for b in self.bm.free if self.bm.blocks[b].hash is not None)
        self.print(_line("pool", f"{self.bm.num_free_blocks} of {self.bm.num_blocks} blocks free"
                         + (f", {cached} of them still holding a cached prefix" if cached else "")))
        if self.detail >= 2:
            self.print(_line("", f"by block id: {self._pool_map()}   (letter = owner, * = shared, o = free but "
                                 f"cached, . = free)"))

    def _pool_map(self) -> str:
        owners: dict[int, set[str]] = {}
        for seq in self.engine.scheduler.running:
            for b in seq.block_table:
                owners.setdefault(b, set()).add(seq.request_id)
        cells = []
        for blk in self.bm.blocks:
            o = owners.get(blk.block_id)
            cells.append(("*" if len(o) > 1 else next(iter(o))) if o else "o" if blk.hash is not None else ".")
        return "".join(cells)


# ------------------------------------------------------------------------------------------------------------
# The run: add each request when it is due, step the engine, narrate.
# ------------------------------------------------------------------------------------------------------------


@dataclass
class Result:
    engine: LLMEngine
    narrated: Narrated
    prompts: dict[str, Prompt] = field(default_factory=dict)


def load(model: str) -> tuple[M3Config, Any]:
    """The model's config and tokenizer, to render the chats before the engine is built."""
    if model in PRESETS and get_preset(model).draw_on_device:
        raise ValueError(f"{model} is too large for the CPU walkthrough; choose m3-mini, m3-tiny or a directory")
    path = resolve_model_dir(model)
    return read_config(path), load_tokenizer(path)


def run(scenario: str = "all", detail: str = "normal", pause: bool = False, delay: float = 0.0,
        out: TextIO | None = None, wait: Callable[[], Any] = input, model: str = DEFAULT_MODEL) -> Result:
    """Run one scenario on `model` and narrate it to `out` (stdout by default). Returns the engine, whose counters
    can be set against the narrated totals. `pause` waits for `wait()` (Enter) between steps; `delay` sleeps."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose one of {', '.join(SCENARIOS)}")
    if detail not in DETAILS:
        raise ValueError(f"unknown detail {detail!r}; choose one of {', '.join(DETAILS)}")
    out = out or sys.stdout
    # The matrices are small: with several threads, synchronising them costs more than the math.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(scenario, model, detail, pause, delay, out, wait)
    finally:
        torch.set_num_threads(threads)


class Arrivals:
    """The requests not yet sent, and when each is due: at its step, once the requests it waits for are there."""

    def __init__(self, engine: LLMEngine, sc: Scenario, prompts: dict[str, Prompt]):
        self.engine, self.prompts = engine, prompts
        self.pending = sorted(sc.asks, key=lambda a: a.arrives)
        self.seqs: dict[str, Sequence] = {}

    def _ready(self, ask: Ask, step: int) -> bool:
        prefilled = ask.after_prefill is None or ask.after_prefill in self.seqs and (
            self.seqs[ask.after_prefill].num_computed_tokens >= self.seqs[ask.after_prefill].num_prompt_tokens
            or self.seqs[ask.after_prefill].is_finished)
        finished = all(n in self.seqs and self.seqs[n].is_finished for n in ask.after_finish)
        return ask.arrives <= step and prefilled and finished

    def add_due(self, step: int) -> list[Prompt]:
        """Add the requests due before `step`; returns their prompts."""
        due = [a for a in self.pending if self._ready(a, step)]
        for ask in due:
            self.pending.remove(ask)
            prompt = self.prompts[ask.name]
            self.engine.add_request(ask.name, {"prompt_token_ids": prompt.ids, "mm_features": prompt.features},
                                    SamplingParams(temperature=0.0, max_tokens=ask.max_tokens))
            self.seqs[ask.name] = self.engine.requests[ask.name].seqs[0]
        return [self.prompts[a.name] for a in due]

    def next_step(self, step: int) -> int:
        """The next step to run: when nothing runs, skip the idle steps up to the next arrival."""
        if self.engine.has_unfinished_requests() or not self.pending:
            return step + 1
        return max(step + 1, min(a.arrives for a in self.pending))


def rehearse(model: str, sc: Scenario, prompts: dict[str, Prompt], block_size: int) -> int:
    """The pool size that is exactly full once `sc.full_after` is admitted: the same requests, silently, on a
    pool that is never short, until then; the blocks in use at that moment. (Greedy decoding on the same model
    repeats the same steps.)"""
    ample = sum(-(-(len(p.ids) + p.ask.max_tokens) // block_size) for p in prompts.values())
    engine = build_engine(model, sc, prompts, ample, block_size)
    admitted: list[str] = []
    engine.add_observer(lambda event, **p: admitted.append(p["seq"].request_id) if event == "admit" else None)
    arrivals, step = Arrivals(engine, sc, prompts), 0
    try:
        while sc.full_after not in admitted:
            if not arrivals.pending and not engine.has_unfinished_requests():
                raise RuntimeError(f"scenario {sc.name!r}: {sc.full_after} was never admitted")
            step = arrivals.next_step(step)
            arrivals.add_due(step)
            engine.step()
        return engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    finally:
        engine.shutdown()


def _run(name: str, model: str, detail: str, pause: bool, delay: float, out: TextIO, wait: Callable[[], Any]
         ) -> Result:
    if name == "image" and not has_vision_model(resolve_model_dir(model)):
        model = IMAGE_MODEL  # (m3-mini has no vision tower)
    cfg, tok = load(model)
    block_size = cfg.index_block_size  # the KV block size is the MSA block size
    sc = scenario(name, cfg)
    prompts = build_prompts(tok, sc, block_size, resolve_model_dir(model))
    kv_blocks = sc.kv_blocks or rehearse(model, sc, prompts, block_size)
    engine = build_engine(model, sc, prompts, kv_blocks, block_size)
    narrator = Narrator(engine, detail, out, {p.ask.name: p.key_block for p in prompts.values()
                                              if p.key_block is not None})
    engine.add_observer(narrator.on_event)
    engine.executor.runner.model.set_trace(narrator.on_trace)
    try:
        _intro(engine, model, sc, prompts, out)
        arrivals, step = Arrivals(engine, sc, prompts), 0
        while arrivals.pending or engine.has_unfinished_requests():
            step = arrivals.next_step(step)
            arrived = arrivals.add_due(step)
            engine.step()
            narrator.flush(step, arrived)
            engine.block_manager.check_integrity()
            if pause:
                try:
                    wait()
                except EOFError:
                    pause = False
            elif delay:
                time.sleep(delay)
        _summary(engine, narrator.count, out)
    finally:
        engine.executor.runner.model.set_trace(None)
    return Result(engine, narrator.count, prompts)


def _intro(engine: LLMEngine, model: str, sc: Scenario, prompts: dict[str, Prompt], out: TextIO) -> None:
    cfg, bs = engine.model_config, engine.block_size

    def say(text: str = "") -> None:
        out.write(textwrap.fill(text, RULE_WIDTH, subsequent_indent="    ", break_on_hyphens=False) + "\n")

    layers = range(cfg.num_hidden_layers)
    weights = " (random weights: the text it writes is noise)" if model in PRESETS else ""
    say(f"nanoserve walkthrough - scenario '{sc.name}': {sc.title}")
    say(f"model {model}{weights}, {cfg.num_hidden_layers} layers: "
        f"{'/'.join('MSA' if cfg.is_sparse_attention(i) else 'dense' for i in layers)} attention, "
        f"{'/'.join('MoE' if cfg.is_moe(i) else 'MLP' for i in layers)} FFN")
    pool = f"KV pool {engine.block_manager.num_blocks} blocks of {bs} tokens (a block = an MSA block"
    pool += f"; sized to be full once {sc.full_after} is admitted)" if sc.full_after else ")"
    say(f"{pool}; token budget {engine.max_num_batched_tokens} per step; at most "
        f"{engine.scheduler.config.max_num_seqs} sequences; MSA keeps the top {cfg.index_topk_blocks} blocks per "
        f"query; MoE routes each token to {cfg.num_experts_per_tok} of {cfg.num_local_experts} experts")
    say(f"chats (system prompt {SYSTEM_PROMPT!r}, thinking off; greedy, so every run is the same):")
    for p in prompts.values():
        a = p.ask
        when = f"arrives before step {a.arrives}"
        if a.after_prefill:
            when += f", once {a.after_prefill}'s prompt is in the KV cache"
        if a.after_finish:
            when += f", once {' and '.join(a.after_finish)} have finished"
        key = f" (the pass key it asks for is in block {p.key_block})" if p.key_block is not None else ""
        say(f"  {a.name}  {when}, {len(p.ids)} prompt tokens{key}: {a.role}")
    say()


def _summary(engine: LLMEngine, n: Narrated, out: TextIO) -> None:
    st = engine.stats
    rule = "=" * RULE_WIDTH
    print(f"{rule}\nsummary (engine.stats, and what the narration reported)", file=out)
    rows = [("engine steps", st.num_steps, n.steps),
            ("prefix-cache hit tokens", st.prefix_cache_hits, n.prefix_hit_tokens),
            ("preemptions", st.num_preemptions, n.preemptions),
            ("finished sequences", sum(st.finished.values()), n.finished)]
    for name, stat, told in rows:
        print(f"  {name:<26}engine {stat:<6}narrated {told}", file=out)
    print(f"  {'chunked prefill steps':<26}narrated {n.chunks}", file=out)
    print(f"  {'prefix evictions':<26}narrated {n.evictions}", file=out)
    print(f"  {'MSA / MoE layers traced':<26}narrated {n.msa_selections} / {n.moe_routings}", file=out)
    if engine.vision_config is not None:
        print(f"  {'pictures encoded':<26}engine {st.encoder_items:<6}narrated {n.encoded}", file=out)
        print(f"  {'encoder-cache hits':<26}engine {st.encoder_cache_hits:<6}narrated {n.encoder_hits}", file=out)
    print(f"  prompt tokens {st.num_prompt_tokens}, computed {st.num_computed_prefill_tokens} (hits skip some, "
          f"preemptions recompute some), generated {st.num_generation_tokens}", file=out)
    print("  block manager integrity checked after every step: ok", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanoserve.walkthrough",
                                 description="Narrate a few requests through the nanoserve engine, step by step.")
    ap.add_argument("--scenario", choices=list(SCENARIOS), default="all",
                    help="which mechanism to show (default: all of them in one run)")
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help=f"a shipped model, a preset or a checkpoint directory (default: {DEFAULT_MODEL})")
    ap.add_argument("--pause", action="store_true", help="wait for Enter between steps")
    ap.add_argument("--delay", type=float, default=0.0, metavar="SECONDS", help="sleep between steps")
    ap.add_argument("--detail", choices=DETAILS, default=None, help="how much to show (default: normal)")
    ap.add_argument("-v", "--verbose", action="store_true", help="same as --detail high")
    ap.add_argument("-q", "--quiet", action="store_true", help="same as --detail low")
    args = ap.parse_args(argv)
    if sum(map(bool, (args.detail, args.verbose, args.quiet))) > 1:
        ap.error("choose one of --detail, -v, -q")
    detail = args.detail or ("high" if args.verbose else "low" if args.quiet else "normal")
    if args.delay < 0:
        ap.error("--delay must be >= 0")
    if args.model not in MODEL_NAMES and not os.path.isdir(args.model):
        ap.error(f"--model {args.model!r} is neither a model nanoserve knows ({', '.join(MODEL_NAMES)}) nor a "
                 f"checkpoint directory")
    wait = lambda: input("  (Enter for the next step) ")  # noqa: E731
    try:
        run(args.scenario, detail, args.pause, args.delay, wait=wait, model=args.model)
    except BrokenPipeError:  # piped into `head` and the reader has seen enough: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's recipe, so exit stays quiet
    return 0


if __name__ == "__main__":
    sys.exit(main())
