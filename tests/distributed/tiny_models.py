"""Tiny model shapes the multi-process tests share, as overrides."""

# DeepSeek-V3's decoder: a dense first block and a sparse one (8 routed experts, top 2 of 2 groups), a
# low-rank key/value latent; each test adds its query rank and value width.
DEEPSEEK_V3 = [
    "model=deepseek_v3_671b",
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=4",
    "model.vocab_size=256",
    "model.ffn_dim=96",
    "model.moe.num_experts=8",
    "model.moe.top_k=2",
    "model.moe.expert_dim=32",
    "model.moe.n_group=2",
    "model.moe.topk_group=1",
    "model.moe.dense_layers=[0]",
    "model.kv_lora_rank=16",
    "model.qk_nope_head_dim=12",
    "model.qk_rope_head_dim=8",
    "model.max_seq_len=128",
]
