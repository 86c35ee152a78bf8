"""M3's vision path: the tower, the projector, the patch merger and the feature scatter (docs/vision.md).

    config.py   VisionConfig: the vision fields of config.json (either dialect)
    grid.py     attention segments, 3-D positions and RoPE angles of a flat batch of patches
    layers.py   linear layers with biases, LayerNorm (fused with the residual add), the patch embedding
    tower.py    VisionTower: the CLIP-style encoder with partial 3-D RoPE, varlen bidirectional attention
    model.py    M3VisionModel (tower + projector + merger) and scatter_features
"""
