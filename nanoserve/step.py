"""What crosses the boundary between the engine and the runner in one step, as plain host data (no tensors, no
torch): the engine sends a `StepInput`, the runner answers with a `StepOutput` - token ids, not logits.

    ModelInput       the forward's batch: plain lists, the part every tensor-parallel rank receives (with the
                     images and videos to encode this step and where their features go)
    MultiModalFeature  one image or video of a prompt: its content hash, its placeholder runs, the tower's input
    StepSeq          one scheduled sequence as the runner sees it: how to sample it, what it verifies
    StepInput        ModelInput + the StepSeqs + prompt-logprob rows + tokens still on the device
    GrammarMasks     the structured-output token bitmasks the engine filled while the forward ran
    StepOutput       per sequence the tokens this step emitted (1, or accepted drafts + 1) with their logprobs,
                     the prompt logprobs, and the next step's draft tokens

A step's batch is one flat run of tokens: sequence 0's new tokens, then sequence 1's, and so on; decodes first.
The runner computes the LM head only on the rows that need it, in this order: one row per sequence that samples a
token (`StepInput.sampled`), then the prompt-logprob rows, then the k + 1 rows of each sequence that verifies k
drafts (`StepInput.verifying`). This module imports nothing but the sampling parameters, so the engine, the runner
and the executors may all use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nanoserve.sampling import SamplingParams


@dataclass
class ModelInput:
    """One step's batch, as plain lists (picklable, cheap to broadcast under tensor parallelism)."""

    input_ids: list[int]  # the new tokens of every sequence, concatenated
    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # context length per sequence after this step
    block_tables: list[list[int]]
    sample_rows: list[int]  # sequences (by batch index) whose last token's logits are wanted
    prompt_rows: list[int] = field(default_factory=list)
    """Tokens (by index into input_ids) whose logits are wanted too: the prompt positions of the requests that
    asked for prompt logprobs, then the positions of a speculative verify step. Their logits follow the sample
    rows' in what the forward returns."""
    encoder_frees: list[str] = field(default_factory=list)
    """Encoder-cache keys whose features the runner drops first (the engine's encoder cache evicted them)."""
    encoder_inputs: list[EncoderInput] = field(default_factory=list)
    """Images and videos to run through the vision model this step; the runner keeps their features by key."""
    placements: list[FeaturePlacement] = field(default_factory=list)
    """Where this step's inputs take vision features instead of their token embeddings, in input order."""


@dataclass
class MultiModalFeature:
    """One image or video of a prompt, as the front end's processor left it (nanoserve/multimodal/features.py):
    the engine schedules its encoding and the runner encodes it. Its placeholder tokens sit in the prompt as runs -
    an image's one run, a video's one per temporal patch (its frame markers between them) - and the i-th row of its
    features replaces the embedding of its i-th placeholder token."""

    modality: str  # "image" or "video"
    identifier: str
    """A hash of the tower's input (pixels, grid): equal identifiers encode to equal features. The encoder cache's
    key, and what a KV block holding its placeholders adds to its prefix-cache hash."""
    runs: list[tuple[int, int]]  # (prompt position of the first placeholder, placeholders) per run, in order
    pixel_values: Any  # the tower's input: a numpy float32 array [patches, patch values]
    grid_thw: list[tuple[int, int, int]]  # (t, h, w) in patches of each attention segment (an image has one)

    @property
    def offset(self) -> int:
        """The prompt position of its first placeholder."""
        return self.runs[0][0]

    @property
    def end(self) -> int:
        """One past the prompt position of its last placeholder."""
        start, length = self.runs[-1]
        return start + length

    @property
    def num_tokens(self) -> int:
        """Its placeholder tokens: the feature rows the encoder makes for it (what the encoder budget counts)."""
        return sum(length for _, length in self.runs)

    def rows_before(self, position: int) -> int:
        """How many of its placeholders sit before prompt position `position`: the feature row that goes there."""
        return sum(min(length, max(0, position - start)) for start, length in self.runs)


@dataclass
class EncoderInput:
    """An image or video the runner encodes in this step, and the key it keeps the features under."""

    key: str
    feature: MultiModalFeature


@dataclass
class FeaturePlacement:
    """Feature rows [row, row + count) of the item kept under `key` replace the embeddings of input positions
    [index, index + count) of the step (indices into ModelInput.input_ids)."""

    key: str
    row: int
    index: int
    count: int


@dataclass
class PromptLogprobRows:
    """Which prompt positions of one sequence a step's extra logits rows belong to: rows [row, row + count) give
    the logprobs of prompt tokens first_token .. first_token + count - 1."""

    seq_id: int
    first_token: int
    count: int
    num_top: int  # top alternatives wanted (prompt_logprobs; -1 resolved to the vocabulary size)
    temperature: float | None = None  # prompt_logprobs_temperature: the logits are divided by it (None: 1)


@dataclass
class StepSeq:
    """One scheduled sequence, as the runner needs it to pick its tokens. The token lists are the engine's own
    (shared, not copied: read them, never change them); they hold the tokens known when the step was built."""

    seq_id: int
    index: int  # which completion of its request (a seeded request's generator depends on it)
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_output_tokens: int  # generated so far, tokens still on the device included (min_tokens counts them)
    start: int  # its first position in this step (the tokens before it are in the KV cache)
    query_len: int  # positions computed this step, drafts included
    samples: bool = False  # this step ends at its newest token: it gets one (or, verifying, 1 + accepted)
    draft: list[int] = field(default_factory=list)  # draft tokens verified this step (its last positions)
    max_drafts: int = 0
    """Speculative decoding: at most this many draft tokens may be proposed for its next step (0: none); the
    runner cuts that to what max_tokens, min_tokens and max_model_len leave once this step's tokens are known."""
    on_device: bool = False
    """Speculative decoding with async scheduling: this step was launched before the previous one's tokens reached
    the host, so its query - the previous step's bonus token, then the drafts the draft chain made - and its first
    position are on the device, where that step's chain left them; `start`, the input ids and `draft` here are
    the host's placeholders (the runner reads the real ones back with the step's tokens)."""

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_draft(self) -> int:
        return len(self.draft)


@dataclass
class StepInput:
    """One step, as the engine hands it to `Executor.execute_model`."""

    model: ModelInput
    seqs: list[StepSeq]  # in batch order, one per sequence of `model`
    prompt_logprobs: list[PromptLogprobRows] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)  # per prompt row, the prompt token it scores
    fed: list[tuple[int, int]] = field(default_factory=list)
    """Async scheduling: (index into input_ids, seq_id) of input tokens still on the device - the token the previous
    step sampled for that sequence, which the runner copies in on the device (the list holds a placeholder)."""
    finished: list[int] = field(default_factory=list)
    """seq_ids that ended since the last step: the runner drops what it keeps for them (their generators)."""
    propose: bool = True
    """Speculative decoding: propose the next drafts after this step (False: a warm-up step of dummy rows)."""
    spec_steps: int = 1
    """Speculative decoding (switch spec_multi_step): run up to this many verify steps back to back on the device,
    each taking its queries from the draft chain of the one before (spec_decode/multi_step.py); the runner runs
    one where that does not apply."""

    @property
    def sampled(self) -> list[StepSeq]:
        """The sequences that sample one token (in batch order): the first logits rows."""
        return [s for s in self.seqs if s.samples and not s.draft]

    @property
    def verifying(self) -> list[StepSeq]:
        """The sequences that verify drafts (in batch order): the last logits rows, k + 1 each."""
        return [s for s in self.seqs if s.draft]


@dataclass
class GrammarMask:
    """A structured-output token bitmask filled on the host (xgrammar's int32 [rows, ceil(V/32)] tensor, bit =
    token allowed) for the logits rows listed in `rows`; the other rows are not constrained."""

    bitmask: Any
    rows: list[int]
    vocab_size: int


@dataclass
class GrammarMasks:
    """A step's masks: `sampled` over the rows of StepInput.sampled (row i = its i-th sequence), `verified` over
    the verify rows (each verifying sequence's k + 1 positions in turn)."""

    sampled: GrammarMask | None = None
    verified: GrammarMask | None = None


@dataclass
class SeqTokens:
    """One sequence's part of a step's output."""

    seq_id: int
    token_ids: list[int]  # 1 token, or a verify step's accepted drafts then the drawn token
    logprobs: list[dict[int, float]] | None = None
    """Per token (when the request asked for logprobs): the chosen token first, then the top alternatives."""
    accepted: list[int] | None = None
    """Several verify steps in one launch (StepInput.spec_steps): the drafts each accepted, in order (token_ids
    holds each step's accepted drafts and drawn token, one step after the other)."""


PromptLogprobEntry = tuple[int, list[tuple[int, float, int]]]
"""One prompt position's logprobs: (position, [(token id, logprob, rank)]), the prompt token first."""


@dataclass
class StepOutput:
    """What one step produced, on the host."""

    seqs: list[SeqTokens] = field(default_factory=list)  # the sequences that got tokens, in StepInput order
    prompt_logprobs: dict[int, list[PromptLogprobEntry]] = field(default_factory=dict)  # by seq_id
    drafts: dict[int, list[int]] = field(default_factory=dict)
    """Speculative decoding: the draft tokens proposed for each sequence's next step, by seq_id."""
    encoder_seconds: float = 0.0
    """Time the vision model took in this step (0: it encoded nothing)."""
