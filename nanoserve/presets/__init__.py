"""Preset models with random weights, and the tooling that makes them look like real checkpoints.

    catalog.py            the named presets (m3-tiny, m3-slice): an M3Config plus how to draw its weights
    checkpoint_layout.py  every tensor of an M3 text checkpoint by its released name, and seeded random values
    tokenizer.py          a small byte-level BPE with M3's special tokens and chat template
    make_checkpoint.py    write a preset as a checkpoint directory (`python -m nanoserve.presets.make_checkpoint`)
    resolve.py            a model name the user gave (preset or directory) -> a loaded model

The model loader (nanoserve/model/loader.py) reads checkpoint directories only and never imports this package;
the engine's model runner resolves a preset name here first.
"""
