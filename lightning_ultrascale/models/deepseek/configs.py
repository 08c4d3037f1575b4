"""The DeepSeek family's presets: DeepSeek-V2-Lite and V3 as published, and the CPU MoE model built
on DeepSeek-V3's design."""

from lightning_ultrascale.models.common.decoder import LlamaConfig
from lightning_ultrascale.models.common.mla import MLAConfig, YarnScaling
from lightning_ultrascale.models.common.moe import MoEConfig

__all__ = ["CONFIGS"]

CONFIGS: dict[str, LlamaConfig] = {
    # The CPU default for MoE: DeepSeek-V3's design in miniature (sigmoid router over 4 groups of 2,
    # top-2 of 2 groups, one shared expert, a dense first block, aux-loss-free balancing).
    "moe_tiny": LlamaConfig(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=320, ffn_hidden_dim=192,
        max_seq_len=256, name="moe_tiny",
        moe=MoEConfig(
            n_routed_experts=8, top_k=2, moe_ffn_dim=64, n_shared_experts=1, first_k_dense=1,
            router="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=1.0,
            aux_loss="sequence", aux_loss_coeff=1e-4, bias_update_rate=1e-3,
        ),
    ),
    # deepseek-ai/DeepSeek-V2-Lite config.json: 15.7B total, 2.4B active parameters (DeepSeek count
    # the active ones without the input embedding, a lookup). The mid-size MoE: trains on 8 H100s.
    # Softmax router without renormalisation (DeepSeek-V2's "greedy" top-k), full-rank queries.
    "deepseek_v2_lite": LlamaConfig(
        dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, vocab_size=102400, ffn_hidden_dim=10944,
        norm_eps=1e-6, rope_theta=10000.0, max_seq_len=163840, name="deepseek_v2_lite",
        moe=MoEConfig(
            n_routed_experts=64, top_k=6, moe_ffn_dim=1408, n_shared_experts=2, first_k_dense=1,
            router="softmax", norm_topk_prob=False, aux_loss="sequence", aux_loss_coeff=1e-3,
        ),
        mla=MLAConfig(
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            yarn=YarnScaling(
                factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707
            ),
        ),
    ),
    # deepseek-ai/DeepSeek-V3 config.json: 671B total, 37B active parameters (without the input
    # embedding). Its multi-token-prediction module (14B more, num_nextn_predict_layers=1) is left out.
    "deepseek_v3": LlamaConfig(
        dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, vocab_size=129280, ffn_hidden_dim=18432,
        norm_eps=1e-6, rope_theta=10000.0, max_seq_len=163840, name="deepseek_v3",
        moe=MoEConfig(
            n_routed_experts=256, top_k=8, moe_ffn_dim=2048, n_shared_experts=1, first_k_dense=3,
            router="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5,
            aux_loss="sequence", aux_loss_coeff=1e-4, bias_update_rate=1e-3,
        ),
        mla=MLAConfig(
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536,
            yarn=YarnScaling(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0),
        ),
    ),
}  # fmt: skip
