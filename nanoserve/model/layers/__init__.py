"""Building blocks of the M3 model, each tensor-parallel-ready (tp_size 1 by default)."""
