"""The MiniMax M3 text model (m3.py, layers/), its configuration, presets and checkpoint loader."""
