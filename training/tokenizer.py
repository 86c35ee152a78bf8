"""Train m3-mini's tokenizer: a 4,096-entry byte-level BPE with every M3 marker as one token.

    python -m training.tokenizer --corpus data/corpus --out data/tokenizer

The special tokens keep the preset tokenizer's ids (0-8: turn start, BOS, EOS, `<mm:think>`, `</mm:think>`, the
tool-call namespace, `<tool_call>`, `</tool_call>`, padding), so BOS is 1 and EOS is 2 in every nanoserve model.
Digits are split one per token before BPE (arithmetic then sees every digit), and the chat format's fixed texts
(the tool instructions of chat_template.jinja) are part of the training text, so a tools prompt costs few tokens.
Deterministic: the same corpus gives the same merges.
"""

from __future__ import annotations

import argparse
import os

from nanoserve.presets.tokenizer import BOS, BOS_ID, CHAT_TEMPLATE, EOS, EOS_ID, SPECIAL_TOKENS
from training.corpus import read_docs

VOCAB_SIZE = 4096
SOURCES = ("python_docs", "fortunes", "wordnet", "stdlib_docstrings")


def template_texts() -> list[str]:
    """The chat template's fixed strings, rendered once with a tool, as tokenizer training text."""
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city.",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    rendered, _ = render_jinja_template(
        conversations=[[{"role": "user", "content": "What is the weather in Paris?"}]], tools=tools,
        chat_template=CHAT_TEMPLATE, add_generation_prompt=True)
    text = rendered[0]
    for s in SPECIAL_TOKENS:
        text = text.replace(s, " ")
    return [text]


def build(corpus: str):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    texts = []
    for name in SOURCES:
        texts.extend(read_docs(os.path.join(corpus, f"{name}.txt")))
    texts.extend(template_texts() * 200)
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(BOS) == BOS_ID and tok.token_to_id(EOS) == EOS_ID
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="data/corpus")
    ap.add_argument("--out", default="data/tokenizer")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tok = build(args.corpus)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    print(f"wrote {args.out}/tokenizer.json ({tok.get_vocab_size()} entries)")


if __name__ == "__main__":
    main()
