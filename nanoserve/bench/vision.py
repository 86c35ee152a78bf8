"""What an image costs a request: TTFT per image size, and the text TPOT of a batch whose requests carry images.

    python -m nanoserve.bench --vision                 # m3-slice-vl on a GPU (m3-tiny-vl on the CPU)
    python -m nanoserve.bench --vision --vision-concurrency 16 --vision-sizes 224,448,672,1344

The model is a preset that sees: m3-slice-vl (m3-slice's text model with the released 32-layer vision tower, random
weights drawn on the device) on a GPU, m3-tiny-vl on the CPU. The engine is built once and warmed up as the server
is (engine/warmup.py), then:

**TTFT per image size.** One request at a time: a short question (about 30 text tokens) with one square image of
S x S pixels, one output token. The processor resizes an image to M3's grid (28 px per merged token, at most
672 x 672 = 576 tokens by default), so sizes past 672 cost the same tokens and only the resize more. Every image is
new (its pixels drawn from a seeded generator), so neither the encoder cache nor the prefix cache hits. Per size:
the image's tokens, the vision model's time (the engine's encoder_seconds), TTFT (mean of --vision-repeats).

**TPOT with images.** `--vision-concurrency` requests at once, each a prompt of --prompt-len text tokens (default
256) and 128 output tokens (ignore_eos, greedy): once text only, once with one new 1344 x 1344 image each
(`measure_vision`'s tpot_size: 576 image tokens). TPOT is each request's (last token - first token) / (tokens - 1),
so the images' encoding (part of the prefill) is in TTFT, not TPOT; what an image adds to TPOT is its tokens in the
KV cache that every decode step reads. The ratio is the table's last column (the target: within 10 %). A third
batch is the control: text only, its prompts as long as the image requests' (their image tokens included), so the
ratio against it is what an image costs beyond its context.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from nanoserve.bench.env import environment
from nanoserve.bench.offline import latencies_ms, stats

SIZES = (224, 448, 672, 1344)
"""Square image sides (pixels) timed for TTFT: 64, 256, 576 and (resized to 672) 576 image tokens."""
QUESTION = "Describe this picture in one short sentence, naming the main colours you see."


def _image(rng: np.random.Generator, size: int):
    from PIL import Image

    return Image.fromarray(rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8))


LENGTH_MATCHED = "text only, as long as the image prompts"
"""The TPOT batch's control: text prompts of the image requests' mean prompt length (image tokens included)."""


def _words_for(tokenizer, words: int, tokens: int) -> int:
    """The filler words that bring a text prompt (of request 0) to `tokens` tokens, from `words` up."""
    def count(n: int) -> int:
        return len(tokenizer.encode(_prompt("", n) + " request 0"))

    base = count(words)
    step = count(words + 100) - base
    return max(words, words + round((tokens - base) * 100 / max(step, 1)))


def _prompt(image_marker: str, words: int = 0) -> str:
    filler = " ".join(["context"] * words)
    return (f"{image_marker}{QUESTION} {filler}").strip()


def measure_vision(model: str, device: str, dtype: str = "auto", sizes: tuple[int, ...] = SIZES,
                   repeats: int = 3, concurrency: int = 16, prompt_len: int = 256, output_len: int = 128,
                   tpot_size: int = 1344, opts=None, seed: int = 0) -> dict:
    """Build the engine, warm it up, time both parts; returns the report (its "table" is printed)."""
    from nanoserve.engine.warmup import DEFAULT_GPU_BUDGET_S, warm_up
    from nanoserve.entrypoints.llm import LLM
    from nanoserve.presets.tokenizer import VISION_TOKENS
    from nanoserve.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    llm = LLM(model=model, device=device, dtype=dtype, max_model_len=4096, max_num_seqs=max(concurrency, 4), seed=seed,
              **({"optimizations": opts} if opts else {}))
    engine = llm.engine
    on_gpu = engine.executor.device.type != "cpu"
    if on_gpu:
        print(warm_up(engine, DEFAULT_GPU_BUDGET_S).summary(), flush=True)
    marker = VISION_TOKENS[0]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    # one untimed request with an image: the encoder's kernels built before anything is timed
    llm.generate({"prompt": _prompt(marker), "multi_modal_data": {"image": _image(rng, 224)}}, one, use_tqdm=False)

    ttft_rows = []
    for size in sizes:
        ttfts, enc_s, tokens = [], [], 0
        for _ in range(repeats):
            before_s, before_tok = engine.stats.encoder_seconds, engine.stats.encoder_tokens
            out = llm.generate({"prompt": _prompt(marker), "multi_modal_data": {"image": _image(rng, size)}}, one,
                               use_tqdm=False)[0]
            m = out.metrics
            ttfts.append((m.first_token_time - m.arrival_time) * 1e3)
            enc_s.append((engine.stats.encoder_seconds - before_s) * 1e3)
            tokens = engine.stats.encoder_tokens - before_tok
        ttft_rows.append({"size": size, "image_tokens": tokens, "prompt_tokens": len(out.prompt_token_ids),
                          "encoder_ms": statistics.mean(enc_s), "ttft_ms": statistics.mean(ttfts),
                          "ttft_ms_all": ttfts})

    # the batch: the same text prompt length with and without an image each, then text only as long as the image
    # requests' prompts (the control: what their longer context alone costs a decode step)
    words = max(prompt_len - 30, 0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    batches = {}
    image_name = f"one {tpot_size} x {tpot_size} image each"
    for name in ("text only", image_name, LENGTH_MATCHED):
        with_image = name == image_name
        n_words = words if name != LENGTH_MATCHED else \
            _words_for(llm.get_tokenizer(), words, round(batches[image_name]["prompt_tokens_mean"]))
        prompts = [{"prompt": _prompt(marker if with_image else "", n_words) + f" request {i}",
                    **({"multi_modal_data": {"image": _image(rng, tpot_size)}} if with_image else {})}
                   for i in range(concurrency)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        ttft, tpot, _ = (stats(v) for v in latencies_ms(outs))
        batches[name] = {"requests": concurrency, "prompt_tokens_mean": statistics.mean(len(o.prompt_token_ids)
                                                                                         for o in outs),
                         "tpot_ms_mean": tpot["mean"], "tpot_ms_p50": tpot["p50"], "ttft_ms_mean": ttft["mean"],
                         "output_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall}
    env = environment(engine.executor.device)
    llm.shutdown()
    text, image, matched = batches.values()
    report = {"model": model, "device": env["device"], "ttft": ttft_rows, "tpot": batches,
              "tpot_ratio": image["tpot_ms_mean"] / text["tpot_ms_mean"],
              "tpot_ratio_length_matched": image["tpot_ms_mean"] / matched["tpot_ms_mean"], "environment": env}
    report["table"] = table(report, concurrency, output_len)
    return report


def table(report: dict, concurrency: int, output_len: int) -> str:
    lines = [f"## Images through the engine: {report['model']} on {report['device']}", "",
             "TTFT of one request with one image (mean of the repeats; every image new)", "",
             "| image (px) | image tokens | prompt tokens | vision model ms | TTFT ms |", "|---|---|---|---|---|"]
    for r in report["ttft"]:
        lines.append(f"| {r['size']} x {r['size']} | {r['image_tokens']} | {r['prompt_tokens']} | "
                     f"{r['encoder_ms']:.1f} | {r['ttft_ms']:.1f} |")
    lines += ["", f"{concurrency} requests at once, {output_len} output tokens each (greedy, ignore_eos)", "",
              "| requests | prompt tokens (mean) | TTFT ms (mean) | TPOT ms (mean / p50) | output tok/s "
              "| TPOT vs text |",
              "|---|---|---|---|---|---|"]
    base = next(iter(report["tpot"].values()))["tpot_ms_mean"]
    for name, b in report["tpot"].items():
        lines.append(f"| {name} | {b['prompt_tokens_mean']:.0f} | {b['ttft_ms_mean']:.1f} | {b['tpot_ms_mean']:.2f} / "
                     f"{b['tpot_ms_p50']:.2f} | {b['output_tok_s']:.0f} | {b['tpot_ms_mean'] / base:.2f}x |")
    if "tpot_ratio_length_matched" in report:
        lines += ["", f"TPOT of the image requests against text requests as long: "
                      f"{report['tpot_ratio_length_matched']:.2f}x"]
    return "\n".join(lines)
