"""The picture tasks for an m3-mini that reads images (training/vision_tasks.py) and its training loop
(training/train_vision.py): the examples are deterministic and answerable, the held-out seeds are never trained on,
and two steps of the loop on the CPU export a checkpoint that nanoserve loads and serves with an image."""

from __future__ import annotations

import json
import os

import numpy as np

from nanoserve import LLM, SamplingParams
from tests.helpers.engine_utils import engine_opts
from training import vision_tasks


def marked_tokenizer(tmp_path) -> tuple[int, tuple[str, str]]:
    """m3-mini's tokenizer with M3's image markers, saved under tmp_path: (its vocabulary size, the (tokenizer
    file, chat template) pair Batcher.load and the batch workers take)."""
    from tokenizers import Tokenizer

    from nanoserve.presets.tokenizer import add_vision_tokens

    tok = Tokenizer.from_file("nanoserve/presets/m3_mini/tokenizer.json")
    add_vision_tokens(tok)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tok.get_vocab_size(), (str(tmp_path / "tokenizer.json"), "nanoserve/presets/m3_mini/chat_template.jinja")


def test_examples_are_deterministic_and_answerable():
    for task in vision_tasks.TASKS:
        a, b = vision_tasks.sample(task, 7), vision_tasks.sample(task, 7)
        assert (a.question, a.answer) == (b.question, b.answer)
        assert np.array_equal(np.asarray(a.image), np.asarray(b.image))
        assert 112 <= min(a.image.size) and max(a.image.size) <= 224
        assert vision_tasks.grade(f"It is {a.answer}.", a.answer) is False  # the first word must be the answer
        assert vision_tasks.grade(f"{a.answer}.", a.answer)
    counts = {vision_tasks.sample("count", s).answer for s in range(60)}
    assert counts == {str(n) for n in range(1, 10)}


def test_heldout_seeds_are_never_trained_on():
    keys = vision_tasks.keys(0)  # what train_vision draws its examples from
    trained = {(e.task, e.question, e.answer, np.asarray(e.image).tobytes())
               for e in (vision_tasks.sample(*next(keys)) for _ in range(50))}
    held = {(e.task, e.question, e.answer, np.asarray(e.image).tobytes()) for e in vision_tasks.heldout(10)}
    assert not trained & held


def test_two_training_steps_export_a_checkpoint_nanoserve_serves(tmp_path):
    from training.train_vision import main

    out = tmp_path / "run"
    # rehearsal data in prepare.py's layout: two chats of 40 tokens, the second half of each trained
    ids = np.random.default_rng(0).integers(10, 4000, size=80)
    trains = np.tile(np.r_[np.zeros(20), np.ones(20)], 2).astype(np.uint8)
    np.savez(tmp_path / "chats.npz", ids=ids, trains=trains, starts=np.array([0, 40]))
    # and the corpora's plain text (every token trained): one window of the two rehearsed each step
    np.savez(tmp_path / "text.npz", ids=ids[::-1].copy(), trains=np.ones(80, np.uint8), starts=np.array([0, 40]))
    main(["--init", "nanoserve/presets/m3_mini", "--out", str(out), "--steps", "2", "--batch", "2",
          "--eval-per-task", "1", "--device", "cpu", "--text-data", str(tmp_path), "--text-batch", "2",
          "--text-seq", "32", "--corpus-frac", "0.5", "--workers", "0"])
    log = [json.loads(line) for line in open(out / "train_log.jsonl")]
    assert [r["step"] for r in log] == [1, 2] and set(log[-1]["heldout"]) == set(vision_tasks.TASKS)
    assert all(r["text_loss"] > 0 for r in log)  # random ids: the rehearsed chats' loss is far from zero
    checkpoint = str(out / "checkpoint")
    assert os.path.isfile(os.path.join(checkpoint, "preprocessor_config.json"))
    example = vision_tasks.sample("digits", 3)
    with LLM(checkpoint, optimizations=engine_opts(), max_model_len=512) as llm:
        assert llm.engine.vision_config.image_token_id == 4096
        out = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": example.image},
                                                     {"type": "text", "text": example.question}]}],
                       SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        assert out[0].outputs[0].token_ids and llm.engine.stats.encoder_items == 1


def test_worker_processes_make_the_same_batches_in_the_same_order(tmp_path):
    import torch

    from training.train_vision import Batcher, batches

    _, args = marked_tokenizer(tmp_path)
    batcher = Batcher.load(*args, torch.device("cpu"))
    inline = batches(batcher, vision_tasks.keys(3), 3, 0, *args)
    spread = batches(batcher, vision_tasks.keys(3), 3, 2, *args)
    for _ in range(3):
        a, b = next(inline), next(spread)
        assert all(torch.equal(x, y) for x, y in zip(a[:4], b[:4])) and a[4] == b[4]
    spread.close()  # the pool ends with the generator


def test_worker_processes_stay_a_bounded_number_of_batches_ahead(tmp_path):
    """The workers make batches far faster than a GPU step uses them: at most AHEAD_PER_WORKER per worker are made
    ahead (an unbounded read-ahead held every finished batch and ran the host out of memory)."""
    import time

    import torch

    from training.train_vision import AHEAD_PER_WORKER, Batcher, batches

    _, args = marked_tokenizer(tmp_path)
    batcher = Batcher.load(*args, torch.device("cpu"))
    drawn = []
    keys = vision_tasks.keys(3)

    def counted():
        while True:
            drawn.append(1)
            yield next(keys)

    spread = batches(batcher, counted(), 2, 2, *args)
    for _ in range(2):
        next(spread)
    time.sleep(1.0)  # (an unbounded read-ahead keeps drawing meanwhile)
    assert len(drawn) <= 2 * (2 + AHEAD_PER_WORKER * 2), len(drawn)
    spread.close()


def test_a_fresh_tower_tells_patches_apart_at_the_embeddings_size(tmp_path):
    """At init the image features must differ from patch to patch (at N(0, 0.02) matrices every image token was
    nearly the same vector and the answer loss stalled at guessing) and have the root-mean-square size of the
    batch's other token embeddings (fp32: equal within 1e-4 relative)."""
    import torch

    from nanoserve.presets.tokenizer import VISION_TOKENS
    from training.train_vision import Batcher, build_vision, encode, load_text_model, match_embeddings, vision_config

    vocab, args = marked_tokenizer(tmp_path)
    cpu = torch.device("cpu")
    batcher = Batcher.load(*args, cpu)
    image_id = batcher.tokenizer.convert_tokens_to_ids(VISION_TOKENS[0])
    model = load_text_model("nanoserve/presets/m3_mini", vocab, cpu)
    vision = build_vision(vision_config(model.cfg.hidden_size, image_id), cpu, seed=0)
    batch = batcher([vision_tasks.sample(task, 7) for task in vision_tasks.TASKS])
    match_embeddings(vision, model, batch)
    ids, _, _, pixels, grids = batch
    with torch.no_grad():
        features = encode(vision, pixels, grids)
        embeds = model.embed_tokens(ids[ids != image_id])
    rms = features.pow(2).mean().sqrt()
    assert abs(float(rms) / float(embeds.pow(2).mean().sqrt()) - 1) < 1e-4
    assert float(features.std(0).mean()) > 0.3 * float(rms)  # patches differ by about as much as they are large


def test_a_run_can_train_and_grade_some_tasks_only(tmp_path, capsys):
    """--tasks picks what is trained and graded (an easier start than all five); an unknown task is an error."""
    import pytest

    from training.train_vision import main

    out = tmp_path / "run"
    main(["--out", str(out), "--steps", "1", "--batch", "2", "--eval-per-task", "2", "--device", "cpu",
          "--workers", "0", "--tasks", "digits,count"])
    log = [json.loads(line) for line in open(out / "train_log.jsonl")]
    assert set(log[-1]["heldout"]) == {"digits", "count"}
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(out), "--tasks", "digits,faces", "--device", "cpu"])
    assert exit_.value.code == 2 and "faces" in capsys.readouterr().err


def test_the_readout_loss_reaches_the_tower_only(tmp_path):
    """--readout: each picture's mean feature should name its answer's first token (a number's first digits, a
    count, a bar's letter); the loss's gradient reaches every vision tensor and no text-model tensor."""
    import torch

    from nanoserve.presets.tokenizer import VISION_TOKENS
    from training.train_vision import (
        Batcher,
        answer_first_tokens,
        build_vision,
        load_text_model,
        loss_of,
        vision_config,
    )

    vocab, args = marked_tokenizer(tmp_path)
    cpu = torch.device("cpu")
    batcher = Batcher.load(*args, cpu)
    examples = [vision_tasks.sample(task, 11) for task in vision_tasks.TASKS]
    batch = batcher(examples)
    firsts = [batcher.tokenizer.decode([t]) for t in answer_first_tokens(batch[0], batch[1]).tolist()]
    assert all(ex.answer.startswith(first) and first for ex, first in zip(examples, firsts)), firsts
    model = load_text_model("nanoserve/presets/m3_mini", vocab, cpu)
    vision = build_vision(vision_config(model.cfg.hidden_size, batcher.tokenizer.convert_tokens_to_ids(
        VISION_TOKENS[0])), cpu, seed=0)
    _, readout = loss_of(model, vision, batch, readout=True)
    readout.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in vision.parameters())
    assert all(p.grad is None for p in model.parameters())
    assert loss_of(model, vision, batch)[1] is None  # off by default
