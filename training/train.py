"""Train m3-mini from the prepared arrays, then export it as a checkpoint nanoserve serves.

    python -m training.train --data data/prepared --out data/run [--time-budget 840] [--device cuda]

One loop, three losses: next-token cross-entropy (on the corpus everywhere, on chats only on the assistant turns),
the MTP module's next-next-token cross-entropy (weight 0.3), and each MSA layer's indexer KL toward the dense
attention (weight 0.5; model.py). A step is either --batch windows of --seq corpus tokens (share --text-frac) or
whole chats of similar length, one per row from position 0, padded to the longest. Every `--long-every`-th step
trains retrieval chats instead (as many of similar length as fit --long-tokens, at least one; or, for a
`--long-text-frac` share of those steps, corpus windows of --long-seq tokens); in the last
`--sparse-frac` of training those run through MSA's real block selection (`attention="sparse"`), so the model
learns to answer from the blocks its indexer picks. The MoE stays balanced by
the auxiliary-loss-free bias update after every step.

The learning-rate schedule (warm-up, then cosine to 10 %) follows progress = max(step / --steps, elapsed /
--time-budget), so the same command finishes its schedule on a GPU in minutes or on a CPU in an hour. At the end
(and every --save-every seconds) the weights are exported with export.py to `<out>/checkpoint`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from nanoserve.presets.tokenizer import EOS_ID
from training.config import MINI
from training.model import M3Train


class Docs:
    """A token array with per-token `trains` flags and document starts (prepare.py's files)."""

    def __init__(self, data: str, name: str):
        with np.load(os.path.join(data, f"{name}.npz")) as z:
            self.ids, self.trains, self.starts = z["ids"], z["trains"], z["starts"]
        self.ends = np.append(self.starts[1:], len(self.ids))

    def __len__(self) -> int:
        return len(self.starts)

    def doc(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        s, e = self.starts[i], self.ends[i]
        return self.ids[s:e], self.trains[s:e]


def chat_rows(docs: Docs, rng: np.random.Generator, budget: int, t: int):
    """Whole chats of similar length, as many as fit `budget` tokens once padded to the longest (at most t)."""
    cand = [i for i in rng.integers(len(docs), size=64) if docs.ends[i] - docs.starts[i] <= t]
    if not cand:
        raise SystemExit(f"no document of at most {t} tokens among 64 drawn; raise --seq or --long-seq")
    cand.sort(key=lambda i: docs.ends[i] - docs.starts[i])
    start = int(rng.integers(len(cand)))
    picked = [cand[start]]
    j = start + 1
    while j < len(cand) and (len(picked) + 1) * (docs.ends[cand[j]] - docs.starts[cand[j]]) <= budget:
        picked.append(cand[j])
        j += 1
    return [docs.doc(int(i)) for i in picked]


def text_rows(docs: Docs, rng: np.random.Generator, n: int, t: int):
    """n windows of t tokens of the corpus stream at random offsets (documents end with EOS)."""
    starts = rng.integers(len(docs.ids) - t, size=n)
    return [(docs.ids[s:s + t], docs.trains[s:s + t]) for s in starts]


def packed_rows(docs: Docs, rng: np.random.Generator, n: int, t: int):
    """n windows of exactly t tokens, each from a random document's start on through the documents after it (the
    usual packing: a later chat in a row also sees the ones before it). Every step then has the same shape, which
    is what lets --compile build its kernels once."""
    ok = docs.starts[docs.starts <= len(docs.ids) - t]
    starts = ok[rng.integers(len(ok), size=n)]
    return [(docs.ids[s:s + t], docs.trains[s:s + t]) for s in starts]


def batch(rows, device):
    """Rows of (ids, trains) padded to the longest: ids, trains, lengths."""
    t = max(len(r[0]) for r in rows)
    ids = np.full((len(rows), t), EOS_ID, np.int64)
    trains = np.zeros((len(rows), t), np.float32)
    for i, (r_ids, r_tr) in enumerate(rows):
        ids[i, :len(r_ids)], trains[i, :len(r_tr)] = r_ids, r_tr
    lengths = np.array([len(r[0]) for r in rows])
    return (torch.as_tensor(ids).to(device), torch.as_tensor(trains).to(device),
            torch.as_tensor(lengths).to(device))


def losses(model, ids, trains, lengths, mode: str, kl_rows: int):
    """Next-token and MTP (next-next-token) cross-entropy on the trained tokens, and the indexer KL. The LM head
    runs only on the positions whose next (or next-next) token trains."""
    w1 = torch.zeros_like(trains, dtype=torch.bool)
    w1[:, :-1] = trains[:, 1:] > 0
    w2 = torch.zeros_like(trains[:, :-1], dtype=torch.bool)
    w2[:, :-1] = trains[:, 2:] > 0
    logits, mtp_logits, aux = model(ids, lengths, mode=mode, kl_rows=min(kl_rows, ids.shape[1]), heads=(w1, w2))
    # summed, then divided by at least 1: a packed window may hold no trained token (a chat longer than the
    # window), and the mean over nothing would be NaN
    main = F.cross_entropy(logits.float(), ids[:, 1:][w1[:, :-1]], reduction="sum") / max(logits.shape[0], 1)
    mtp = torch.zeros((), device=ids.device)
    if mtp_logits is not None and mtp_logits.shape[0]:
        mtp = F.cross_entropy(mtp_logits.float(), ids[:, 2:][w2[:, :-1]], reduction="sum") / mtp_logits.shape[0]
    return main, mtp, aux["index_kl"]


def load_checkpoint(model: M3Train, path: str) -> None:
    """Fill `model` from a checkpoint directory written by export.py (every tensor by its released name)."""
    from safetensors.torch import load_file

    saved = load_file(os.path.join(path, "model.safetensors"))
    names = model.checkpoint_tensors()
    missing = sorted(set(names) - set(saved))
    if missing:
        raise SystemExit(f"--init {path}: {len(missing)} tensors missing, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, t in names.items():
            t.copy_(saved[name].to(t.dtype))  # checkpoint_tensors() returns views of the parameters and buffers


def start_profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    prof.__enter__()
    prof.started = time.time()
    return prof


def report_profile(prof, device: torch.device, steps: int, tokens: int) -> None:
    """Where `steps` training steps spent their time: wall time per step, then the operators by self time (on a
    GPU, device time first; a step far longer than its kernels' sum is waiting on the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.time() - prof.started
    t = time.time()
    prof.__exit__(None, None, None)
    events = prof.key_averages()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=key, row_limit=30))
    kernels = sum(getattr(e, key) for e in events) / 1e6
    print(f"profile: {steps} steps, {tokens} tokens, {wall:.2f} s traced ({wall / steps * 1e3:.0f} ms/step), "
          f"self {key.split('_')[1]} time {kernels:.2f} s; profiler report {time.time() - t:.1f} s")


def param_groups(model, wd: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/prepared")
    ap.add_argument("--tokenizer", default="data/tokenizer/tokenizer.json")
    ap.add_argument("--out", default="data/run")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--time-budget", type=float, default=840.0, help="seconds; the schedule ends by then")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--long-seq", type=int, default=8192, help="longest retrieval chat trained (tokens)")
    ap.add_argument("--long-tokens", type=int, default=8192, help="padded tokens per retrieval step")
    ap.add_argument("--long-every", type=int, default=8)
    ap.add_argument("--sparse-frac", type=float, default=0.2)
    ap.add_argument("--text-frac", type=float, default=0.35, help="share of short rows from the corpus")
    ap.add_argument("--long-text-frac", type=float, default=0.0, help="share of long steps that are corpus windows "
                    "of --long-seq tokens instead of retrieval chats")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--kl-rows", type=int, default=64)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--save-every", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-steps", type=int, default=0, metavar="N",
                    help="profile N steps after 10 warm-up steps, print where the time went (torch.profiler) and stop "
                         "without exporting")
    ap.add_argument("--pack", action="store_true", help="fixed-shape steps: every chat step is --batch packed "
                    "windows of --seq tokens, every retrieval step --long-tokens / --long-seq windows of --long-seq")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder block (dynamic in batch "
                    "and length: one graph per kind of block for every step shape, then no Python overhead)")
    ap.add_argument("--init", default=None, metavar="DIR", help="start from a checkpoint export.py wrote (its "
                    "weights and router biases; the optimizer starts afresh)")
    args = ap.parse_args()

    from training.export import export

    if args.threads:
        torch.set_num_threads(args.threads)
    if not os.path.isfile(args.tokenizer):  # the export at the first save needs it; fail before training, not after
        raise SystemExit(f"--tokenizer {args.tokenizer}: no such file (python -m training.tokenizer writes it)")
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    device = torch.device(args.device)
    text, chat, long = (Docs(args.data, n) for n in ("text", "chats", "long"))
    model = M3Train(MINI)
    if args.init:
        load_checkpoint(model, args.init)
    model = model.to(device)
    if args.compile:
        model.compile_blocks()
        # the last --sparse-frac's retrieval steps (every --long-every-th step) run eagerly: compiling every block
        # once more for them took 74 s of a 550 s H100 run, which left that phase about 600 steps
        model.eager_modes = {"sparse"}
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    print(f"m3-mini: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters; "
          f"text {len(text.ids) / 1e6:.1f} M tokens, chats {len(chat.ids) / 1e6:.1f} M, long {len(long)} chats")
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "train_log.jsonl"), "a")
    t0 = last_save = time.time()
    tokens = 0
    step = 0
    prof, tokens_at_10 = None, 0
    last: dict[str, torch.Tensor] = {}  # the latest short and long step's main loss, for the log
    while True:
        progress = max(step / args.steps, (time.time() - t0) / args.time_budget)
        if progress >= 1.0:
            break
        if args.profile_steps and step == 10:
            prof, tokens_at_10 = start_profiler(device), tokens
        elif prof is not None and step == 10 + args.profile_steps:
            report_profile(prof, device, args.profile_steps, tokens - tokens_at_10)
            return
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        is_long = args.long_every and step % args.long_every == args.long_every - 1
        if is_long:
            windows = max(1, args.long_tokens // args.long_seq)
            if rng.random() < args.long_text_frac:
                # long corpus windows: the indexer's KL (and, late, the sparse selection) also on plain text at
                # the distances MSA drops blocks, not only on retrieval filler
                rows = text_rows(text, rng, windows, args.long_seq)
            elif args.pack:
                rows = packed_rows(long, rng, windows, args.long_seq)
            else:
                rows = chat_rows(long, rng, args.long_tokens, args.long_seq)
            mode = "sparse" if progress >= 1.0 - args.sparse_frac else "dense"
        elif rng.random() < args.text_frac:
            rows, mode = text_rows(text, rng, args.batch, args.seq), "dense"
        else:
            rows = (packed_rows(chat, rng, args.batch, args.seq) if args.pack
                    else chat_rows(chat, rng, args.batch * args.seq, args.seq))
            mode = "dense"
        ids, trains, lengths = batch(rows, device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            main_l, mtp_l, kl = losses(model, ids, trains, lengths, mode, args.kl_rows)
            loss = main_l + 0.3 * mtp_l + 0.5 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for moe in model.moe_layers():
            moe.update_bias(args.bias_rate)
        tokens += int(ids.numel())
        step += 1
        last["long" if is_long else "short"] = main_l
        if step % 20 == 0:
            # the latest short and long step's loss both: with --long-every 4, every 20th step is a long one
            rec = {"step": step, "s": round(time.time() - t0, 1), "tokens": tokens, "lr": lr, "mode": mode,
                   "long": bool(is_long), "loss": round(main_l.item(), 4), "mtp": round(mtp_l.item(), 4),
                   "index_kl": round(kl.item(), 4), **{f"{k}_loss": round(v.item(), 4) for k, v in last.items()}}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(rec, flush=True)
        if time.time() - last_save > args.save_every:
            export(model, os.path.join(args.out, "checkpoint"), args.tokenizer)
            last_save = time.time()
    export(model, os.path.join(args.out, "checkpoint"), args.tokenizer)
    print(f"done: {step} steps, {tokens / 1e6:.1f} M tokens, {time.time() - t0:.0f} s -> {args.out}/checkpoint")


if __name__ == "__main__":
    main()
