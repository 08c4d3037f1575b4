"""The Qwen3 family's presets (our decoder with ``qk_norm`` and ``attention_head_dim``)."""

from lightning_ultrascale.models.common.decoder import LlamaConfig
from lightning_ultrascale.models.common.moe import MoEConfig

__all__ = ["CONFIGS"]

#: Qwen3-MoE's router: softmax over the experts, top-k renormalised, the global-batch balancing loss (0.001).
_ROUTED = {"router": "softmax", "norm_topk_prob": True, "aux_loss": "switch", "aux_loss_coeff": 0.001}

CONFIGS: dict[str, LlamaConfig] = {
    # Qwen/Qwen3-30B-A3B config.json: 30.5B total, 3.3B active parameters; every block MoE.
    "qwen3_30b_a3b": LlamaConfig(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, attention_head_dim=128, qk_norm=True, vocab_size=151936,
        ffn_hidden_dim=6144, norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960, name="qwen3_30b_a3b",
        moe=MoEConfig(n_routed_experts=128, top_k=8, moe_ffn_dim=768, **_ROUTED),
    ),
    # Qwen/Qwen3-235B-A22B config.json: 235B total, 22B active parameters; every block MoE.
    "qwen3_235b_a22b": LlamaConfig(
        dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, attention_head_dim=128, qk_norm=True, vocab_size=151936,
        ffn_hidden_dim=12288, norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960, name="qwen3_235b_a22b",
        moe=MoEConfig(n_routed_experts=128, top_k=8, moe_ffn_dim=1536, **_ROUTED),
    ),
}  # fmt: skip
