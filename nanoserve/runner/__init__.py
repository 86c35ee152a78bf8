"""The per-rank side: one device's model, its KV pools, and a step's lists -> tensors -> logits.

    model_runner   ModelRunner: build the model, size and allocate the KV pools, run one step
    input_prep     ModelInput -> input tensors and AttentionMetadata (vectorised, or the plain reference loop)
    cuda_graphs    GraphRunner: decode steps captured and replayed as CUDA/HIP graphs
    kv_cache       the per-layer K/V pools and per-MSA-layer index-key pools
    multimodal     the vision model, the features it encoded (by encoder-cache key), the embeddings that take them

Every tensor-parallel rank runs one ModelRunner; rank 0's executor calls it, the other ranks' worker loops do.
It knows nothing of requests or scheduling.
"""
