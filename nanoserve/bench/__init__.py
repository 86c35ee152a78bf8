"""Benchmarks (W1-W6 of docs/benchmarks.md), the Hugging Face baseline, the A/B ablation and the decode-step
profile: `python -m nanoserve.bench --help`.

    workloads.py   W1-W6: random-token prompts, full size or scaled down for the CPU
    offline.py     nanoserve runs: one model build, a fresh engine per run, engine-timestamp metrics
    floor.py       bytes and FLOPs per step, the physical floor, achieved GB/s and TFLOP/s
    hf.py          transformers' generate() on the same weights (eager, and static-cache compiled)
    ablation.py    every switch off alone (approximations on alone), one table; n/a where a switch cannot act,
                   each row repeated with its spread
    profile.py     torch.profiler over decode steps, grouped per kernel family
    prefill_profile.py   torch.profiler over a whole prefill, per kernel, with its FLOPs, bytes and roof
    serve.py       W3: closed-loop streaming client, vllm-bench-serve metrics
    micro.py       kernel micro-benchmarks (MoE, projections: bf16 vs MXFP8; decode routing) and the card's
                   measured ceilings
    micro_attention.py   the attention kernels' micro-benchmarks (dense and MSA, decode and prefill)
    moe_problem.py one fused-MoE problem at a model's widths with its fp32 oracle (the MoE tuner, the GPU tests)
    accuracy.py    native MXFP8 against the same weights dequantised: logprob differences, top-1 agreement
    report.py      results.json, aligned tables, PNG plots
    compare.py     two runs side by side (--compare BASE NEW)
    results_page.py  docs/results.md, the page of current numbers, from the runs of record in results/ (--report)
    session.py     one guarded, time-budgeted session that ties these together
"""
