"""Models that declare their parallel plan, and the registry of named configurations.

Example:
    >>> from lightning_ultrascale.models import build_model, get_model_config
    >>> get_model_config("llama3_8b").n_kv_heads
    8
    >>> model = build_model("llama3_70b", device="meta")  # no memory: materialise after sharding
    >>> model.spec.n_layers
    80
"""

from __future__ import annotations

import torch

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.common.mla import MLAConfig, YarnScaling
from lightning_ultrascale.models.common.moe import MoEConfig
from lightning_ultrascale.models.llama import Llama, LlamaConfig, RopeScaling
from lightning_ultrascale.models.spec import ModelSpec, SpecifiedModel, require_spec

__all__ = [
    "MODEL_CONFIGS",
    "Llama",
    "LlamaConfig",
    "MLAConfig",
    "MoEConfig",
    "ModelSpec",
    "RopeScaling",
    "SpecifiedModel",
    "build_model",
    "get_model_config",
    "require_spec",
]

# Published Llama 3.1 / 3.2 architectures (the HF config.json of meta-llama/Llama-3.1-8B etc.);
# tests check the parameter counts against Meta's model cards.
_LLAMA31_ROPE = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA32_ROPE = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_VOCAB = 128256
_CONTEXT = 131072

MODEL_CONFIGS: dict[str, LlamaConfig] = {
    # CPU tests and the default job. The rope scaling is on and its bands are placed so that the
    # head's 8 frequencies fall in all three (kept, interpolated, stretched): tests exercise it.
    "llama_tiny": LlamaConfig(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=320, ffn_hidden_dim=192,
        rope_scaling=RopeScaling(
            factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
        ),
        max_seq_len=256, name="llama_tiny",
    ),
    # llama_tiny widened until every block linear is a multiple of 128 wide, also split over tp=2
    # (FP8 blockwise tiles; so no GQA here: 2 kv heads of 64 would leave wk/wv 64 wide per rank).
    "llama_small": LlamaConfig(
        dim=256, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=320, ffn_hidden_dim=768,
        rope_scaling=RopeScaling(
            factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
        ),
        max_seq_len=256, name="llama_small",
    ),
    "llama3_1b": LlamaConfig(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=_VOCAB, ffn_hidden_dim=8192,
        rope_scaling=_LLAMA32_ROPE, max_seq_len=_CONTEXT, tie_embeddings=True, name="llama3_1b",
    ),
    "llama3_3b": LlamaConfig(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=_VOCAB, ffn_hidden_dim=8192,
        rope_scaling=_LLAMA32_ROPE, max_seq_len=_CONTEXT, tie_embeddings=True, name="llama3_3b",
    ),
    "llama3_8b": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=_VOCAB, ffn_hidden_dim=14336,
        rope_scaling=_LLAMA31_ROPE, max_seq_len=_CONTEXT, name="llama3_8b",
    ),
    "llama3_70b": LlamaConfig(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=_VOCAB, ffn_hidden_dim=28672,
        rope_scaling=_LLAMA31_ROPE, max_seq_len=_CONTEXT, name="llama3_70b",
    ),
    "llama3_405b": LlamaConfig(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=_VOCAB, ffn_hidden_dim=53248,
        rope_scaling=_LLAMA31_ROPE, max_seq_len=_CONTEXT, name="llama3_405b",
    ),
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
    # mistralai/Mixtral-8x7B-v0.1 config.json: 46.7B total, 12.9B active parameters.
    "mixtral_8x7b": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, ffn_hidden_dim=14336,
        rope_theta=1e6, max_seq_len=32768, name="mixtral_8x7b",
        moe=MoEConfig(n_routed_experts=8, top_k=2, moe_ffn_dim=14336, aux_loss="switch", aux_loss_coeff=0.02),
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


def get_model_config(name: str) -> LlamaConfig:
    """The named configuration, or a :class:`ConfigError` listing the known names.

    Example:
        >>> get_model_config("llama_tiny").dim
        64
    """
    try:
        return MODEL_CONFIGS[name]
    except KeyError:
        raise ConfigError(f"model={name} is unknown; valid: {', '.join(MODEL_CONFIGS)}") from None


def build_model(name_or_config: str | LlamaConfig, *, device: str | torch.device = "cpu", seed: int = 0) -> Llama:
    """Build a model on ``device``, initialised from ``seed`` unless ``device`` is meta.

    A meta model has shapes and no storage: shard it first, then ``to_empty(device=...)`` and
    ``init_weights(seed)`` give each rank its part of the same weights a CPU build would have.

    Example:
        >>> model = build_model("llama_tiny", seed=0)
        >>> sum(p.numel() for p in model.parameters())
        238144
    """
    cfg = get_model_config(name_or_config) if isinstance(name_or_config, str) else name_or_config
    device = torch.device(device)
    with torch.device(device):
        model = Llama(cfg)
    if device.type != "meta":
        model.init_weights(seed)
    return model
