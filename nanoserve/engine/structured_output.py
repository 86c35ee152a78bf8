"""Structured outputs: constrain what a sequence may generate to a JSON schema, a regex, a choice, an EBNF grammar
or a structural tag, with xgrammar (the grammar engine vLLM and SGLang use).

    StructuredOutputManager.compile(params)   spec -> CompiledGrammar (cached per spec; raises ValueError)
    StructuredOutputManager.new_grammar(cg)   one SequenceGrammar (an xgrammar GrammarMatcher) per sequence
    StructuredOutputManager.bitmask(seqs)     the step's token bitmask, filled for the constrained rows only (the
                                              runner applies it: runner/grammar_mask.py, the sampler's first step)
    StructuredOutputManager.verify_masks(...) a verify step's masks, one per verified position
    StructuredOutputManager.cut_drafts(...)   the longest prefix of a draft the grammar allows
    StructuredOutputManager.accept(seq)       the newest appended token advances seq's matcher (overlap_grammar off)
    StructuredOutputManager.catch_up(seqs)    every unseen token advances its matcher, batched (overlap_grammar on)

The life of a constrained request: `LLMEngine.add_request` compiles its spec (in the caller's thread; the server
compiles it earlier, while converting the request, so that a schema xgrammar rejects is an HTTP 400) and gives each of
its n sequences its own matcher. Each step, after the forward is queued, the engine fills one bitmask row per
constrained sequence (on the host, while the device computes the forward) and the runner's sampler applies it to the
logits before anything else, so penalties, temperature, top-k/p and the logprobs all see the masked logits (vLLM's
order); unconstrained rows of the same batch are left alone. The matcher accepts each appended token: at once (switch
overlap_grammar off), or, with it on, in one batched catch-up after the next forward is launched, so that this host
work too runs while the device computes (an EOS, which can end the format, is still accepted at once); a matcher that
reaches its end (it accepts EOS only where the grammar may end) finishes the sequence with "stop". max_tokens ends a
constrained sequence like any other, so nothing waits for a token the mask forbids.

Overlap scheduling needs no special case: step N+1 is scheduled after step N's tokens were appended (and accepted
by the matchers), so the N+1 mask is filled from the current state. `bitmask` checks that every matcher has
accepted exactly the sequence's output tokens, so a change that breaks this fails loudly instead of masking with
a stale state. Preemption (recompute) keeps a sequence's output tokens, hence its matcher state.

xgrammar is imported on first use, so an engine that never sees a constrained request does not pay for it.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from nanoserve.sampling import StructuredOutputsParams
from nanoserve.step import GrammarMask


class ConstrainedSeq(Protocol):
    """What the manager reads of an engine Sequence (a protocol, so that sequence.py, which holds a
    SequenceGrammar, and this module do not import each other)."""

    request_id: str
    output_token_ids: list[int]
    grammar: "SequenceGrammar | None"

logger = logging.getLogger(__name__)

CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first); a compiled JSON schema is tens of KB."""

# xgrammar's C++ errors start with "[HH:MM:SS] /path/file.cc:LINE: "; the client needs only the message
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _clean_error(e: Exception) -> str:
    return _CPP_PREFIX.sub("", str(e).strip()).strip() or type(e).__name__


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices`: root ::= "a" | "b" | ..."""
    def literal(s: str) -> str:
        out = []
        for ch in s:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\x{ord(ch):02x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    return "root ::= " + " | ".join(literal(c) for c in choices)


def _forbid_additional_properties(schema: Any) -> Any:
    """disable_additional_properties: every object schema without an explicit additionalProperties gets false."""
    if isinstance(schema, list):
        return [_forbid_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _forbid_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


NOT_SCHEMAS = frozenset(("const", "enum", "default", "examples", "required", "pattern", "format", "type", "$ref"))
"""Schema keywords whose values are data or names, not subschemas: json_strings leaves them as they are."""
NAMED_SCHEMAS = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"))
"""Schema keywords whose values map names to subschemas."""


def json_strings(schema: Any) -> Any:
    """`schema` with every string whose length it bounds (minLength / maxLength, and no pattern, format, enum or
    const of its own) held by a pattern of the same bounds instead. xgrammar writes such a string as `"`, up to
    maxLength characters other than `"`, `\\`, CR and LF, then `"` - which admits the raw control characters JSON
    forbids (json.loads refuses a tab or U+0001 inside a string) - while a pattern's characters are JSON's (no
    control character; as with any pattern, no escape either). Nor a surrogate: UTF-8 cannot carry one (its bytes
    decode to three U+FFFD, over the length). Every subschema is rewritten alike (properties, items, $defs,
    propertyNames, anyOf, ...)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: json_strings(sub) for name, sub in value.items()}
        elif key in NOT_SCHEMAS:
            out[key] = value
        elif isinstance(value, list):  # anyOf, oneOf, allOf, prefixItems
            out[key] = [json_strings(sub) for sub in value]
        else:  # items, additionalProperties, propertyNames, not, if / then / else, ...; or a plain value
            out[key] = json_strings(value)
    kind = out.get("type")
    stringy = kind == "string" or (isinstance(kind, list) and "string" in kind) or kind is None
    bounds = {"minLength", "maxLength"} & out.keys()
    if stringy and bounds and not ({"pattern", "format", "enum", "const"} & out.keys()):
        low = out.get("minLength", 0)
        high = out.get("maxLength")
        low = low if isinstance(low, int) and low > 0 else 0
        high = high if isinstance(high, int) and high >= low else None
        out["pattern"] = rf"^[^\uD800-\uDFFF]{{{low},{'' if high is None else high}}}$"
        for key in bounds:  # the pattern holds them (xgrammar ignores them beside a pattern, with a warning)
            del out[key]
    return out


def _structural_json_strings(fmt: Any) -> Any:
    """json_strings on every json_schema element of a structural tag's format."""
    if isinstance(fmt, list):
        return [_structural_json_strings(f) for f in fmt]
    if not isinstance(fmt, dict):
        return fmt
    out = {k: _structural_json_strings(v) for k, v in fmt.items() if k != "json_schema"}
    if "json_schema" in fmt:
        out["json_schema"] = json_strings(fmt["json_schema"]) if fmt.get("type") == "json_schema" else \
            fmt["json_schema"]
    return out


@dataclass(frozen=True)
class GrammarKey:
    """What a compiled grammar depends on: the kind, the spec as canonical text, and the whitespace option."""

    kind: str  # json | regex | grammar | structural_tag (choice becomes grammar, json_object becomes json)
    spec: str
    any_whitespace: bool = True


def _parsed(value: Any, field: str) -> Any:
    """A spec field given as a JSON string or as the parsed object, parsed. ValueError names the field."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.{field} is not valid JSON: {e}") from None


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    """Normalise a spec into its cache key. Raises ValueError for a JSON schema that is not JSON."""
    params.validate()
    any_ws = not params.disable_any_whitespace
    kind = params.kind
    if kind == "json":
        schema = _parsed(params.json, "json")
        if params.disable_additional_properties:
            schema = _forbid_additional_properties(schema)
        return GrammarKey("json", json.dumps(json_strings(schema)), any_ws)
    if kind == "json_object":
        return GrammarKey("json", json.dumps({"type": "object"}), any_ws)
    if kind == "choice":
        return GrammarKey("grammar", choice_grammar(list(params.choice)))
    if kind == "structural_tag":
        return GrammarKey("structural_tag", json.dumps(_structural_json_strings(
            _parsed(params.structural_tag, "structural_tag"))))
    return GrammarKey(kind, getattr(params, kind))  # regex, grammar


def format_element(params: StructuredOutputsParams) -> dict[str, Any]:
    """The constraint as one element of an xgrammar structural tag, so that a larger format can hold it (the
    server's thinking_token_budget puts it after the bounded thinking)."""
    import xgrammar as xgr

    key = grammar_key(params)
    if key.kind == "json":  # as EBNF: a structural tag's own JSON element has no whitespace option
        return {"type": "grammar", "grammar": str(xgr.Grammar.from_json_schema(key.spec,
                                                                              any_whitespace=key.any_whitespace))}
    if key.kind == "structural_tag":
        return json.loads(key.spec)["format"]
    if key.kind == "regex":
        return {"type": "regex", "pattern": key.spec}
    return {"type": "grammar", "grammar": key.spec}


class SequenceGrammar:
    """One sequence's grammar state: an xgrammar GrammarMatcher, and how many of the sequence's output tokens it
    has seen.

    With `reasoning_end` set (StructuredOutputsParams.reasoning_end_token_id) the output starts in the model's
    thinking: tokens pass unconstrained and unseen by the matcher up to and including the first `reasoning_end`,
    and the format holds from the next token on (`active`). This is vLLM's rule with a reasoning parser: the end
    of the reasoning is found on the generated token ids, and the grammar advances from the step after it."""

    __slots__ = ("matcher", "num_seen", "reasoning_end", "active", "failed")

    def __init__(self, matcher, reasoning_end: int | None = None):
        self.matcher = matcher
        self.num_seen = 0  # output tokens handled: passed as reasoning, or accepted by the matcher
        self.reasoning_end = reasoning_end
        self.active = reasoning_end is None  # the format holds the next token
        self.failed = False  # the matcher rejected a token (overlap_grammar: the engine ends the sequence)

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar forbids it (the mask should have prevented that)."""
        if not self.active:
            self.num_seen += 1
            self.active = token == self.reasoning_end
            return True
        ok = self.matcher.accept_token(token)
        if ok:
            self.num_seen += 1
        return ok

    @property
    def is_terminated(self) -> bool:
        """The grammar reached its end and accepted a stop token: nothing more may be generated."""
        return self.active and self.matcher.is_terminated()


@functools.lru_cache(maxsize=8)
def _grammar_compiler(tokenizer_path: str, vocab_size: int, stop_token_ids: tuple[int, ...], threads: int):
    """One xgrammar GrammarCompiler per vocabulary, shared by every engine of the process (a benchmark builds a
    fresh engine per run around one model): building the TokenizerInfo of a 200k vocabulary takes seconds, and
    the compiler's own cache then serves a spec compiled by an earlier engine."""
    import xgrammar as xgr

    from nanoserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)  # our own copy: fast tokenizers must not be shared across threads
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
    return xgr.GrammarCompiler(info, max_threads=threads)


class StructuredOutputManager:
    """Compiles structured-output specs for one model's vocabulary and fills the per-step token bitmask.

    `tokenizer_path` is loaded into a tokenizer of the compiler's own on first use (a Hugging Face fast tokenizer
    must not be shared between threads, and compilation runs in the caller's thread). `vocab_size` is the width of
    the model's logits (its embedding rows), which may exceed the tokenizer's vocabulary: the extra ids are never
    allowed. Thread-safe: the server's conversion and the engine thread may compile at the same time."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int], max_batch: int = 256,
                 compile_threads: int = 2):
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.stop_token_ids = [t for t in stop_token_ids if t is not None]
        self.compile_threads = compile_threads
        self._lock = threading.Lock()
        self._compiler = None
        self._batch_matcher = None
        self._cache: OrderedDict[GrammarKey, Any] = OrderedDict()
        self._bitmask: Any = None  # xgrammar's int32 bitmask (a torch tensor on the host), reused step to step
        self._max_batch = max_batch
        self.num_compiled = 0  # compilations actually run (cache misses)

    # -- compilation (any thread) ---------------------------------------------------------------------------
    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                self._compiler = _grammar_compiler(self.tokenizer_path, self.vocab_size, tuple(self.stop_token_ids),
                                                   self.compile_threads)
            return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The CompiledGrammar for `params` (from the cache when this spec was compiled before). Raises ValueError
        with xgrammar's message when the spec cannot be compiled."""
        key = grammar_key(params)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiler = self._get_compiler()
        field = params.kind
        try:
            if key.kind == "json":
                compiled = compiler.compile_json_schema(key.spec, any_whitespace=key.any_whitespace)
            elif key.kind == "regex":
                compiled = compiler.compile_regex(key.spec)
            elif key.kind == "grammar":
                compiled = compiler.compile_grammar(key.spec)
            else:
                compiled = compiler.compile_structural_tag(key.spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{field} cannot be compiled: {_clean_error(e)}") from None
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def new_grammar(self, compiled, reasoning_end: int | None = None) -> SequenceGrammar:
        """A fresh matcher at the start of `compiled` (one per sequence: n > 1 gives each its own); with
        `reasoning_end`, held until the thinking ends (SequenceGrammar)."""
        import xgrammar as xgr

        return SequenceGrammar(xgr.GrammarMatcher(compiled), reasoning_end)

    # -- the step's mask and the tokens drawn with it (engine thread) ---------------------------------------
    @staticmethod
    def accept(seq: ConstrainedSeq) -> bool:
        """seq's newest token was just appended: advance its grammar. False if the grammar rejects the token
        (the mask should make that impossible; the engine then ends the sequence with finish_reason "error")."""
        if seq.grammar is None or seq.grammar.accept(seq.output_token_ids[-1]):
            return True
        logger.error("request %s: the structured-output grammar rejected sampled token %d; ending it",
                     seq.request_id, seq.output_token_ids[-1])
        return False

    @staticmethod
    def catch_up(seqs: list[ConstrainedSeq]) -> None:
        """overlap_grammar: the grammars of `seqs` accept the output tokens they have not seen yet (one per
        sequence after a step), the active ones in one batched xgrammar call. A grammar that rejects its token is
        marked failed (the engine ends its sequence with finish_reason "error" when the step's token comes)."""
        pending = [s for s in seqs if s.grammar is not None and not s.grammar.failed
                   and s.grammar.num_seen < len(s.output_token_ids)]
        while pending:
            batch = [s for s in pending if s.grammar.active]
            for s in pending:
                if not s.grammar.active:  # thinking: passes unseen by the matcher
                    s.grammar.accept(s.output_token_ids[s.grammar.num_seen])
            if batch:
                import xgrammar as xgr

                tokens = [s.output_token_ids[s.grammar.num_seen] for s in batch]
                ok = xgr.BatchGrammarMatcher.batch_accept_token([s.grammar.matcher for s in batch], tokens)
                for s, accepted, token in zip(batch, ok, tokens):
                    if accepted:
                        s.grammar.num_seen += 1
                    else:
                        s.grammar.failed = True
                        logger.error("request %s: the structured-output grammar rejected sampled token %d; ending it",
                                     s.request_id, token)
            pending = [s for s in pending if not s.grammar.failed and s.grammar.num_seen < len(s.output_token_ids)]

    def bitmask(self, seqs: list[ConstrainedSeq]) -> GrammarMask | None:
        """The token bitmask of one step whose sampled rows are `seqs` (in row order), or None when no row is
        constrained. Fills only the constrained rows, in one call (xgrammar fills them in parallel); a sequence
        still in its thinking (SequenceGrammar.active false) is not constrained yet, nor is one whose grammar
        failed (it ends when this step's token comes)."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None and s.grammar.active and not s.grammar.failed]
        if not rows:
            return None
        import xgrammar as xgr

        for i in rows:
            s = seqs[i]
            if s.grammar.num_seen != len(s.output_token_ids):
                raise RuntimeError(f"sequence {s.seq_id}: its grammar saw {s.grammar.num_seen} tokens but "
                                   f"it has {len(s.output_token_ids)}; the mask would be stale")
        if self._batch_matcher is None:
            self._batch_matcher = xgr.BatchGrammarMatcher()
        self._max_batch = max(self._max_batch, len(seqs))
        if self._bitmask is None or self._bitmask.shape[0] < len(seqs):
            self._bitmask = xgr.allocate_token_bitmask(self._max_batch, self.vocab_size)
        self._batch_matcher.batch_fill_next_token_bitmask([seqs[i].grammar.matcher for i in rows], self._bitmask,
                                                          rows)
        return GrammarMask(self._bitmask[: len(seqs)], rows, self.vocab_size)

    # -- speculative decoding under a grammar ---------------------------------------------------------------------
    @staticmethod
    def cut_drafts(seq: ConstrainedSeq, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` that seq's grammar allows (ending at a token that terminates it); the
        grammar is left as it was. A draft token the format forbids could never be accepted, and the masks of the
        positions after it could not be computed. A sequence still in its thinking, or whose grammar failed, gets
        no drafts: its next token is not under the format yet."""
        g = seq.grammar
        if not g.active or g.failed or g.num_seen != len(seq.output_token_ids):
            return []
        matcher = g.matcher
        n = 0
        for token in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return drafts[:n]

    def verify_masks(self, verifying: list[tuple[ConstrainedSeq, list[int]]]) -> GrammarMask | None:
        """The masks of a verify step's rows (each sequence's k + 1 positions in turn, given with its drafts):
        position j's is the grammar's after the first j draft tokens, which it accepts one by one and then rolls
        back. None when no verifying sequence is constrained."""
        constrained = [i for i, (s, _) in enumerate(verifying) if s.grammar is not None]
        if not constrained:
            return None
        import xgrammar as xgr

        starts = [0]
        for _, draft in verifying:
            starts.append(starts[-1] + len(draft) + 1)
        bitmask = xgr.allocate_token_bitmask(starts[-1], self.vocab_size)
        rows = []
        for i in constrained:
            seq, draft = verifying[i]
            matcher = seq.grammar.matcher
            for j in range(len(draft) + 1):
                matcher.fill_next_token_bitmask(bitmask, starts[i] + j)
                rows.append(starts[i] + j)
                if j < len(draft) and not matcher.accept_token(draft[j]):
                    raise RuntimeError(f"sequence {seq.seq_id}: its grammar rejects draft token {draft[j]}, which "
                                       f"cut_drafts let through")
            matcher.rollback(len(draft))
        return GrammarMask(bitmask, rows, self.vocab_size)
