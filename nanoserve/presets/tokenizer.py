"""A small byte-level BPE tokenizer with M3's special tokens and chat format, for the preset models.

The real M3 tokenizer ships with its checkpoint; presets have random weights, so any tokenizer works as long as it
round-trips any text, has M3's special tokens and renders M3-format chats. This one is
trained deterministically on a short embedded text: ids 0-8 are the special tokens, then the 256 byte symbols
(so every string is encodable, and a rare character spans several tokens - which the incremental detokeniser
must handle), then BPE merges up to VOCAB_SIZE, so a random model's output still decodes to word pieces.
"""

from __future__ import annotations

import json
import os

VOCAB_SIZE = 512
SPECIAL_TOKENS = [
    "]~b]",            # 0: role start ("]~b]user\n")
    "]~!b[",           # 1: BOS
    "[e~[",            # 2: EOS / end of turn
    "<mm:think>",      # 3
    "</mm:think>",     # 4
    "]<]minimax[>[",   # 5: tool-call namespace
    "<tool_call>",     # 6
    "</tool_call>",    # 7
    "]!p~[",           # 8: padding
]
BOS_ID, EOS_ID = 1, 2
VISION_TOKENS = ["]<]image[>[", "]<]video[>[", "]<]start of image[>[", "]<]end of image[>["]
"""M3's image and video markers (placeholder, video placeholder, the brackets around a run), added after the BPE
vocabulary by presets that see (ids VOCAB_SIZE .. VOCAB_SIZE + 3), so a text preset's ids stay as they were."""
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = VOCAB_SIZE, VOCAB_SIZE + 1

# The training text: a few paragraphs of plain English about serving language models.
CORPUS = """
A serving engine turns a trained language model into a service. Requests arrive over HTTP, each with a prompt and
sampling parameters. The engine tokenizes the prompt, schedules it beside the requests already running, and runs
the model one step at a time. Each step computes the next token of every running sequence, so the batch changes
from step to step: this is continuous batching. New requests join as soon as there is room, and finished ones
leave at once, which keeps the accelerator busy.

The attention layers need the keys and values of every earlier token. They live in a cache split into blocks of
fixed size, like pages of virtual memory. A block table maps each sequence to its blocks, so memory is taken only
as a sequence grows, and sequences with the same beginning can share the blocks of that prefix. When memory runs
out, the newest sequence is preempted and computed again later.

Long prompts are split into chunks that fit the token budget of a step, so a long prefill never stalls the
decoding of other sequences. The sampler reads the logits of the last position and picks a token: the most likely
one when the temperature is zero, otherwise a draw after temperature, top k, top p and min p filtering. Stop
strings, stop tokens and a maximum length decide when a sequence is done. Tokens are turned back into text as they
come, and streamed to the client.

MiniMax M3 is a mixture of experts: each token is routed to a few experts out of many, plus one shared expert. Most
of its layers use sparse attention: an indexer scores blocks of earlier tokens and each query attends only to the
best blocks and its own. Kernels written in Triton fuse the small operations and run on NVIDIA and AMD alike.
Tensor parallelism splits every layer across several devices and joins the partial results with an all reduce.
"""


BOS, EOS = "]~!b[", "[e~["

# M3's chat format (chat_template.jinja beside this file): a system turn, a developer turn with the client's system
# message and the tools, then the conversation; tool calls as namespaced XML, tool results as <response>s, the
# thinking_mode variable (enabled / disabled / adaptive) deciding how the assistant's turn opens.
with open(os.path.join(os.path.dirname(__file__), "chat_template.jinja"), encoding="utf-8") as _f:
    CHAT_TEMPLATE = _f.read()

# generation_config.json: the sampling defaults quoted for MiniMax M3 (temperature 1.0, top_p 0.95, top_k 40),
# which the server applies to requests that leave them unset (--generation-config auto)
GENERATION_CONFIG = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID], "temperature": 1.0, "top_p": 0.95,
                     "top_k": 40, "do_sample": True}


def build_tokenizer(vision: bool = False):
    """Train the byte-level BPE on CORPUS (deterministic: same merges every time); `vision`: with M3's image and
    video markers after it (VISION_TOKENS)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.train_from_iterator([CORPUS], trainer=trainer)
    assert tok.token_to_id(BOS) == BOS_ID and tok.token_to_id(EOS) == EOS_ID
    if vision:
        add_vision_tokens(tok)
    return tok


def add_vision_tokens(tok) -> None:
    """Append M3's image and video markers to a trained tokenizer, as special tokens of their own."""
    from tokenizers import AddedToken

    first = tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    assert [tok.token_to_id(t) for t in VISION_TOKENS] == list(range(first, first + len(VISION_TOKENS)))


def write_tokenizer(out_dir: str, vision: bool = False) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja and
    generation_config.json (`vision`: the tokenizer with M3's image and video markers)."""
    write_tokenizer_files(out_dir, build_tokenizer(vision), GENERATION_CONFIG, 1 << 20)


def write_tokenizer_files(out_dir: str, tok, generation_config: dict, model_max_length: int) -> None:
    """A checkpoint's tokenizer files for `tok` (a `tokenizers.Tokenizer` with M3's special tokens), with M3's
    chat template and `generation_config`."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": "]!p~[",
        "add_bos_token": False, "add_eos_token": False,
        "model_max_length": model_max_length, "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": "]!p~["}, f, indent=2)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(generation_config, f, indent=2)
