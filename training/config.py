"""m3-mini's architecture: MiniMax M3 unchanged, at small widths.

One dense layer (dense attention + dense MLP) then three MSA + MoE layers, as the released model has three dense
layers then 57 sparse ones. MSA blocks of 64 tokens with the top 16 kept (1,024 tokens visible per query and KV
group): a chat of a few hundred tokens is attended densely, a prompt of a few thousand really drops blocks, and
what it keeps is the indexer's choice. 8 routed experts, 2 per token, plus the shared expert.
"""

from nanoserve.model.m3_config import DENSE, SPARSE, M3Config
from nanoserve.presets.tokenizer import BOS_ID, EOS_ID
from training.tokenizer import VOCAB_SIZE

LAYERS = 4
MINI = M3Config(
    vocab_size=VOCAB_SIZE, hidden_size=256, num_hidden_layers=LAYERS, num_attention_heads=8,
    num_key_value_heads=4, head_dim=32, rotary_dim=16, rope_theta=10_000.0, max_position_embeddings=16_384,
    intermediate_size=192, dense_intermediate_size=768, shared_intermediate_size=192,
    num_local_experts=8, num_experts_per_tok=2, index_n_heads=4, index_head_dim=32,
    index_block_size=64, index_topk_blocks=16, index_local_blocks=1,
    attn_layer_types=[DENSE] + [SPARSE] * (LAYERS - 1), mlp_layer_types=[DENSE] + [SPARSE] * (LAYERS - 1),
    bos_token_id=BOS_ID, eos_token_id=EOS_ID,
)
