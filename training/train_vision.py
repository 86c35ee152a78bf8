"""Teach m3-mini to read pictures: a small vision tower (M3's architecture at small widths) trained with the text
model on the Pillow-drawn tasks of vision_tasks.py, then exported as one checkpoint nanoserve serves with images.

    python -m training.train_vision --init nanoserve/presets/m3_mini --out data/vision-run --device cuda \\
        [--steps 6000] [--batch 64] [--time-budget 3600] [--text-data data/prepared] [--tasks digits,count]

What it does:
- the tokenizer: m3-mini's, with M3's image and video markers appended (ids 4096-4099); the text model grows its
  embedding and LM head by those 4 rows (initialised at the mean row) and keeps every trained weight;
- the vision path: nanoserve's own M3VisionModel (model/vision/) in training mode - 4 layers of 128 (heads of 32),
  projector and 2x2 merger into the text width - so what is trained is exactly what the engine runs;
- each step: a batch of examples (the tasks in turn, each image 112-224 px: 16-64 image tokens), each a chat
  rendered with m3-mini's chat template - the image part as ]<]image[>[, expanded by nanoserve's processor -
  whose answer (`</mm:think>` answer EOS, as m3-mini answers a plain request) is the only thing with a loss; the
  features replace the placeholders' embeddings (`M3Train.forward(embeds=...)`);
- rehearsal (--text-data): each step also takes --text-batch windows of what train.py learns from, packed chats
  (prepare.py's chats.npz) and, a --corpus-frac share of them, plain text of the corpora (text.npz), with their
  next-token and MTP losses, so fine-tuning on pictures does not wear away what the text model could do (tool
  calls, retrieval, arithmetic, its perplexity on text);
- the host: drawing and processing a picture takes about 5 ms of a CPU thread, so --workers processes (default:
  every core but one, at most 15) make the batches ahead of the steps;
- the optimiser: AdamW, the vision path at --lr, the text model at --text-lr (fine-tuned gently, so its text skills
  stay), warm-up then cosine; every --eval-every steps and at the end, greedy answers to a held-out set (seeds the
  training stream never draws) graded per task (vision_tasks.grade);
- the checkpoint: `<out>/checkpoint`, m3-mini's text tensors with the vision tensors under their released names,
  config.json with the vision config, preprocessor_config.json (images at most 224 x 224 px), the tokenizer.

Nothing here runs on its own in CI: tests/training/test_vision_tasks.py checks the tasks and runs two steps of this
loop on the CPU, export included, and serves the result with an image.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from nanoserve.chat_template import MediaPart, load_chat_template, render_chat, template_messages
from nanoserve.config import Optimizations
from nanoserve.model.checkpoint_names import VISION_WEIGHT_NAMES, name_map
from nanoserve.model.vision.config import VisionConfig
from nanoserve.model.vision.model import M3VisionModel
from nanoserve.multimodal.image import ProcessorConfig
from nanoserve.multimodal.processor import MultiModalProcessor
from nanoserve.presets.tokenizer import EOS, VISION_TOKENS, add_vision_tokens
from training import vision_tasks
from training.config import MINI
from training.export import GENERATION_CONFIG, export
from training.model import M3Train
from training.train import Docs, batch, losses, packed_rows, text_rows

IMAGE_PIXELS = 224 * 224
"""The processor's max_pixels for m3-mini: the tasks' images are at most 224 px a side (64 tokens)."""


def vision_config(text_hidden: int, image_token_id: int) -> VisionConfig:
    return VisionConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                        projector_hidden_size=text_hidden, text_hidden_size=text_hidden,
                        image_token_id=image_token_id, video_token_id=image_token_id + 1)


def load_text_model(init: str, vocab: int, device: torch.device) -> M3Train:
    """m3-mini's weights in an M3Train whose vocabulary has `vocab` rows (the new rows at the mean embedding)."""
    saved = load_file(os.path.join(init, "model.safetensors"))
    with open(os.path.join(init, "config.json")) as f:
        mtp = bool(json.load(f)["text_config"].get("num_mtp_modules", 0))
    model = M3Train(MINI.replace(vocab_size=vocab), mtp=mtp)
    for name, param in model.checkpoint_tensors().items():  # views of the parameters: copy_ fills them
        value = saved[name].float()
        if value.shape != param.shape:  # the embedding and LM head: the old rows, then the mean row
            value = torch.cat([value, value.mean(0, keepdim=True).expand(param.shape[0] - value.shape[0], -1)])
        param.copy_(value)
    return model.to(device)


def build_vision(cfg: VisionConfig, device: torch.device, seed: int) -> M3VisionModel:
    """The vision path with random weights, trainable: matrices N(0, 1/fan_in), biases 0, LayerNorm weights 1.

    Why that scale: with every matrix at N(0, 0.02) (the text model's init) the four matrices between the tower and
    the text model each shrink what passes through, the biases win, and every image token starts as nearly the
    same vector (its spread across patches about 2 % of a token embedding's size). The text model then learns to
    answer from the question alone and the answer loss stalls at guessing. At 1/fan_in the patches differ at init
    as much as they are large; `match_embeddings` then sets their size to the embeddings'."""
    vision = M3VisionModel(cfg, Optimizations.reference(), torch.float32, device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in vision.named_parameters():
        if "layer_norm" in name or "layrnorm" in name:
            p.data.fill_(1.0 if name.endswith("weight") else 0.0)
        elif p.dim() >= 2:
            fan_in = p[0].numel()
            p.data.copy_(torch.randn(p.shape, generator=gen) * fan_in ** -0.5)
        else:
            p.data.zero_()
        p.requires_grad_(True)
    return vision


@torch.no_grad()
def match_embeddings(vision: M3VisionModel, model: M3Train, batch) -> float:
    """Scale the merger's last matrix so that the features of `batch` have the root-mean-square size of the token
    embeddings beside them (every other token of the same batch, padding included); returns the factor."""
    ids, _, _, pixels, grids = batch
    rms = lambda x: float(x.float().pow(2).mean().sqrt())  # noqa: E731
    text = rms(model.embed_tokens(ids[ids != vision.cfg.image_token_id]))
    factor = text / rms(encode(vision, pixels, grids))
    vision.merger.linear_2.weight.mul_(factor)
    return factor


def encode(vision: M3VisionModel, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
    """M3VisionModel.forward without its inference mode: tower -> projector -> 2x2 merger, with gradients."""
    x = vision.projector(vision.tower(pixels, grids))
    return vision.merger(x.reshape(x.shape[0] // vision.cfg.merge_unit, -1))


class Batcher:
    """Examples -> padded token ids, the answer mask, and the images' pixels (one chat per row from position 0)."""

    def __init__(self, tokenizer, processor: MultiModalProcessor, template: str, device: torch.device):
        self.tokenizer, self.processor, self.template, self.device = tokenizer, processor, template, device
        self.eos = tokenizer.convert_tokens_to_ids(EOS)
        self.rendered: dict[str, str] = {}  # question -> the rendered user turn (the template is slow; questions few)

    @classmethod
    def load(cls, tokenizer_json: str, template_path: str, device: torch.device) -> "Batcher":
        """The batcher of a run: the tokenizer with the image markers (tokenizer_json), m3-mini's chat template,
        images of at most IMAGE_PIXELS."""
        from transformers import PreTrainedTokenizerFast

        return cls(PreTrainedTokenizerFast(tokenizer_file=tokenizer_json),
                   MultiModalProcessor(ProcessorConfig(max_pixels=IMAGE_PIXELS)), load_chat_template(template_path),
                   device)

    def prompt(self, example: vision_tasks.Example):
        """The user turn with its image, rendered and expanded: (ids, pixel values, grid)."""
        text = self.rendered.get(example.question)
        if text is None:
            media: list[MediaPart] = []
            messages = template_messages(vision_tasks.chat(example)[:1], media)
            text = self.rendered[example.question] = render_chat(self.tokenizer, messages,
                                                                 chat_template=self.template)
        mm = self.processor(text, images=[example.image], tokenizer=self.tokenizer, add_special_tokens=False)
        return mm.input_ids, mm.pixel_values, mm.images[0].grid_thw

    def __call__(self, examples: list[vision_tasks.Example]):
        return self.to_device(self.rows(examples))

    def rows(self, examples: list[vision_tasks.Example]):
        """The batch on the CPU: token rows, answer masks, the images' pixels, their grids (what a worker sends)."""
        rows, masks, pixels, grids = [], [], [], []
        for ex in examples:
            ids, pix, grid = self.prompt(ex)
            answer = self.tokenizer.encode("</mm:think>" + ex.answer, add_special_tokens=False) + [self.eos]
            rows.append(ids + answer)
            masks.append([False] * len(ids) + [True] * len(answer))
            pixels.append(pix)
            grids.append(grid)
        return rows, masks, torch.cat(pixels), grids

    def to_device(self, batch):
        rows, masks, pixels, grids = batch
        t = max(map(len, rows))
        ids = torch.tensor([r + [0] * (t - len(r)) for r in rows], device=self.device)
        mask = torch.tensor([m + [False] * (t - len(m)) for m in masks], device=self.device)
        lengths = torch.tensor([len(r) for r in rows], device=self.device)
        return ids, mask, lengths, pixels.to(self.device), grids


_worker_batcher: Batcher | None = None


def _start_worker(tokenizer_json: str, template_path: str) -> None:
    global _worker_batcher
    torch.set_num_threads(1)
    _worker_batcher = Batcher.load(tokenizer_json, template_path, torch.device("cpu"))


def _worker_rows(keys: list[tuple[str, int]]):
    """In a worker process: draw the examples of `keys` and make their batch (Batcher.rows)."""
    return _worker_batcher.rows([vision_tasks.sample(task, seed) for task, seed in keys])


def batches(batcher: Batcher, keys, size: int, workers: int, tokenizer_json: str, template_path: str):
    """The training batches on the device, in the order of `keys`: drawing and processing the pictures is the
    run's host work (about 5 ms an example), so `workers` processes make them ahead of the steps (0: in this
    process). Either way the same batches, in the same order."""
    chunks = ([next(keys) for _ in range(size)] for _ in iter(int, 1))
    if workers <= 0:
        for chunk in chunks:
            yield batcher([vision_tasks.sample(task, seed) for task, seed in chunk])
        return
    import multiprocessing
    from collections import deque

    # spawned, not forked: this process has the GPU open. At most AHEAD_PER_WORKER batches per worker are made
    # ahead of the steps, taken in order: the workers make batches far faster than the steps use them, and
    # Pool.imap's unbounded read-ahead kept every finished batch (tens of MB of pixels each) until the host ran
    # out of memory.
    with multiprocessing.get_context("spawn").Pool(workers, _start_worker, (tokenizer_json, template_path)) as pool:
        pending = deque(pool.apply_async(_worker_rows, (next(chunks),)) for _ in range(AHEAD_PER_WORKER * workers))
        while True:
            rows = pending.popleft().get()
            pending.append(pool.apply_async(_worker_rows, (next(chunks),)))
            yield batcher.to_device(rows)


AHEAD_PER_WORKER = 2
"""Batches made ahead of the training steps per worker process (bounds the host memory the batches hold)."""


def embeddings(model: M3Train, vision: M3VisionModel, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The token embeddings of `ids` with the images' features (`encode`'s output) at the placeholders."""
    embeds = model.embed_tokens(ids)
    features = features.to(embeds.dtype)
    where = (ids == vision.cfg.image_token_id)[..., None].expand_as(embeds)
    return embeds.masked_scatter(where, features)


def loss_of(model: M3Train, vision: M3VisionModel, batch, readout: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The answers' next-token loss, and with `readout` the readout loss: each image's mean feature, scored against
    the (fixed) token embeddings, should name its answer's first token - a training-only signal that reaches the
    tower directly rather than through the text model, and leaves no tensor in the checkpoint."""
    ids, mask, lengths, pixels, grids = batch
    heads = mask[:, 1:]  # position t predicts token t + 1: the rows whose next token is part of an answer
    features = encode(vision, pixels, grids)
    logits, _, _ = model(ids[:, :-1], lengths - 1, mtp=False, heads=(heads, heads[:, 1:]),
                         embeds=embeddings(model, vision, ids[:, :-1], features))
    loss = F.cross_entropy(logits.float(), ids[:, 1:][heads])
    if not readout:
        return loss, None
    pooled = torch.stack([f.mean(0) for f in features.split(vision.tokens_per_item(grids))])
    scores = pooled.float() @ model.embed_tokens.weight.detach().t().float()
    return loss, F.cross_entropy(scores, answer_first_tokens(ids, mask))


def answer_first_tokens(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's first answer token after `</mm:think>` (the first token of its answer mask)."""
    return ids[torch.arange(len(ids), device=ids.device), mask.int().argmax(1) + 1]


@torch.no_grad()
def evaluate(model: M3Train, vision: M3VisionModel, batcher: Batcher, examples: list, max_new: int = 8
             ) -> dict[str, float]:
    """Greedy answers to held-out examples (no KV cache: each token one whole forward), graded per task."""
    model.eval()
    right: dict[str, list[bool]] = {}
    for ex in examples:
        ids, pix, grid = batcher.prompt(ex)
        out: list[int] = []
        features = encode(vision, pix.to(batcher.device), [grid])  # once per picture, not once per token
        for _ in range(max_new):
            x = torch.tensor([ids + out], device=batcher.device)
            logits, _, _ = model(x, torch.tensor([x.shape[1]], device=batcher.device), mtp=False,
                                 embeds=embeddings(model, vision, x, features))
            token = int(logits[0, -1].argmax())
            if token == batcher.eos:
                break
            out.append(token)
        text = batcher.tokenizer.decode(out, skip_special_tokens=False).replace("</mm:think>", "")
        right.setdefault(ex.task, []).append(vision_tasks.grade(text, ex.answer))
    model.train()
    return {task: sum(r) / len(r) for task, r in right.items()}


def vision_tensors(vision: M3VisionModel) -> dict[str, torch.Tensor]:
    """The vision path's tensors under the released names and shapes (q, k, v split out of the fused projection;
    the patch embedding as its 5-D Conv3d weight, fp32; the rest bf16)."""
    cfg = vision.cfg
    out = {}
    for name, target in name_map(vision, VISION_WEIGHT_NAMES, prefix="").items():
        t = vision.get_parameter(target.param).detach()
        if target.shard:
            r0, r1 = vision.get_submodule(target.param.rsplit(".", 1)[0]).offsets[target.shard]
            t = t[r0:r1]
        if "patch_embedding" in name:
            t = t.reshape(cfg.hidden_size, cfg.num_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
            out[name] = t.float().cpu().contiguous()
        else:
            out[name] = t.to("cpu", torch.bfloat16).contiguous()
    return out


def export_vl(model: M3Train, vision: M3VisionModel, out: str, tokenizer_json: str) -> None:
    """export.py's checkpoint, plus the vision tensors, the vision config and the processor's settings."""
    export(model, out, tokenizer_json)
    weights = load_file(os.path.join(out, "model.safetensors"))
    weights.update(vision_tensors(vision))
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config.update(vision.cfg.to_dict())
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
        json.dump({"min_pixels": ProcessorConfig().min_pixels, "max_pixels": IMAGE_PIXELS}, f, indent=2)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init", default="nanoserve/presets/m3_mini", help="the text model to start from")
    ap.add_argument("--out", default="data/vision-run")
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4,
                    help="the vision path's peak learning rate (3e-4 learned digits more slowly; docs/vision.md)")
    ap.add_argument("--text-lr", type=float, default=1e-4, help="the text model's peak learning rate")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--time-budget", type=float, default=3600.0, help="seconds: the schedule ends by then")
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--eval-per-task", type=int, default=40)
    ap.add_argument("--text-data", default=None, metavar="DIR",
                    help="prepare.py's arrays: rehearse the text chats (chats.npz) beside the pictures")
    ap.add_argument("--text-batch", type=int, default=8, help="rehearsed windows per step")
    ap.add_argument("--text-seq", type=int, default=1024, help="tokens per rehearsed window")
    ap.add_argument("--corpus-frac", type=float, default=0.25,
                    help="the share of the rehearsed windows taken from the plain-text corpora (text.npz in "
                         "--text-data) instead of the chats; 0: chats only")
    ap.add_argument("--workers", type=int, default=max(0, min(15, (os.cpu_count() or 1) - 1)),
                    help="processes drawing the pictures ahead of the steps (0: in this process)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--readout", type=float, default=0.0,
                    help="weight of a training-only readout loss on the tower (each image's mean feature names its "
                         "answer's first token); 0: off")
    ap.add_argument("--tasks", default=",".join(vision_tasks.TASKS),
                    help="the tasks trained and evaluated, a comma list (default: all)")
    args = ap.parse_args(argv)
    tasks = tuple(args.tasks.split(","))
    if not tasks or set(tasks) - set(vision_tasks.TASKS):
        ap.error(f"--tasks {args.tasks!r}: each must be one of {', '.join(vision_tasks.TASKS)}")
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(args.init, "tokenizer.json"))
    add_vision_tokens(tok)
    tokenizer_json = os.path.join(args.out, "tokenizer.json")
    tok.save(tokenizer_json)
    template_path = os.path.join(args.init, "chat_template.jinja")
    batcher = Batcher.load(tokenizer_json, template_path, device)
    image_id = batcher.tokenizer.convert_tokens_to_ids(VISION_TOKENS[0])
    model = load_text_model(args.init, tok.get_vocab_size(), device).train()
    vision = build_vision(vision_config(model.cfg.hidden_size, image_id), device, args.seed).train()
    opt = torch.optim.AdamW([{"params": list(vision.parameters()), "lr": args.lr, "peak": args.lr},
                             {"params": list(model.parameters()), "lr": args.text_lr, "peak": args.text_lr}],
                            weight_decay=0.01, betas=(0.9, 0.95))
    heldout = vision_tasks.heldout(args.eval_per_task, tasks)
    source = batches(batcher, vision_tasks.keys(args.seed, tasks), args.batch, args.workers, tokenizer_json,
                     template_path)
    first = next(source)
    print(f"features scaled by {match_embeddings(vision, model, first):.4f} to the embeddings' size", flush=True)
    pictures = itertools.chain([first], source)
    chats = Docs(args.text_data, "chats") if args.text_data else None
    # the corpora too: with the chats alone the text model's perplexity on held-out text rose 1.7-2x in a run
    corpus = Docs(args.text_data, "text") if args.text_data and args.corpus_frac > 0 else None
    n_corpus = round(args.text_batch * args.corpus_frac) if corpus is not None else 0
    rng = np.random.default_rng(args.seed)
    log = open(os.path.join(args.out, "train_log.jsonl"), "a")  # noqa: SIM115 - one line per step, closed at the end
    start = time.monotonic()
    for step in range(1, args.steps + 1):
        progress = max(step / args.steps, (time.monotonic() - start) / args.time_budget)
        scale = min(1.0, step / args.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))
        for group in opt.param_groups:
            group["lr"] = group["peak"] * scale
        loss, readout = loss_of(model, vision, next(pictures), args.readout > 0)
        record = {"step": step, "loss": round(float(loss.detach()), 4)}
        if readout is not None:
            record["readout_loss"] = round(float(readout.detach()), 4)
            loss = loss + args.readout * readout
        if chats is not None:
            rows = packed_rows(chats, rng, args.text_batch - n_corpus, args.text_seq)
            if n_corpus:
                rows += text_rows(corpus, rng, n_corpus, args.text_seq)
            main_l, mtp_l, _ = losses(model, *batch(rows, device), mode="dense", kl_rows=0)
            record["text_loss"] = round(float(main_l.detach()), 4)
            loss = loss + main_l + 0.3 * mtp_l
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*vision.parameters(), *model.parameters()], 1.0)
        opt.step()
        record["seconds"] = round(time.monotonic() - start, 1)
        last = step == args.steps or progress >= 1.0
        if step % args.eval_every == 0 or last:
            record["heldout"] = evaluate(model, vision, batcher, heldout)
        print(json.dumps(record), flush=True)
        log.write(json.dumps(record) + "\n")
        if last:
            break
    log.close()
    source.close()  # the workers end with the generator
    export_vl(model, vision, os.path.join(args.out, "checkpoint"), tokenizer_json)
    with open(os.path.join(args.out, "checkpoint", "generation_config.json"), "w") as f:
        json.dump(GENERATION_CONFIG, f, indent=2)
    print(f"wrote {args.out}/checkpoint")


if __name__ == "__main__":
    main()
