"""The DeepSeek family's Hugging Face config translation: ``DeepseekV3Config`` (MLA, DeepSeek MoE)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.common.hf import common_to_hf, hf_field
from lightning_ultrascale.models.common.mla import MLAConfig, YarnScaling
from lightning_ultrascale.models.common.moe import MoEConfig

if TYPE_CHECKING:
    from lightning_ultrascale.models.common.decoder import LlamaConfig

__all__ = ["deepseek_v3_from_hf", "deepseek_v3_to_hf"]


def deepseek_v3_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    """``DeepseekV3Config`` keyword arguments (and ``config.json`` keys, DeepSeek's spelling)."""
    moe, mla = cfg.moe, cfg.mla
    assert moe is not None and mla is not None
    y = mla.yarn
    return {
        **common_to_hf(cfg),
        "moe_intermediate_size": moe.moe_ffn_dim,
        "num_key_value_heads": cfg.n_heads,
        "n_shared_experts": moe.n_shared_experts,
        "n_routed_experts": moe.n_routed_experts,
        "num_experts_per_tok": moe.top_k,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "norm_topk_prob": moe.norm_topk_prob,
        "first_k_dense_replace": moe.first_k_dense,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_scaling": None if y is None else {"type": "yarn", **dataclasses.asdict(y)},
        "rope_interleave": True,  # MLAttention reads DeepSeek's interleaved rotary rows
        "num_nextn_predict_layers": cfg.mtp_depth,  # (transformers 5 reads it as num_mtp_layers)
    }


def deepseek_v3_from_hf(hf_config: Any) -> tuple[MoEConfig, MLAConfig]:
    """The MoE and MLA parts of a ``DeepseekV3Config`` (or of its ``config.json``)."""
    unsupported = {
        "scoring_func": (hf_field(hf_config, "scoring_func", default="sigmoid"), "sigmoid"),
        "topk_method": (hf_field(hf_config, "topk_method", default="noaux_tc"), "noaux_tc"),
        "moe_layer_freq": (hf_field(hf_config, "moe_layer_freq", default=1), 1),
        "rope_interleave": (hf_field(hf_config, "rope_interleave", default=True), True),
    }
    for option, (value, supported) in unsupported.items():
        if value != supported:
            raise ConfigError(f"hf {option}={value!r} is not supported; valid: {supported!r}")
    if getattr(hf_config, "quantization_config", None):
        raise ConfigError(
            "hf quantization_config is set (DeepSeek's released weights are FP8 blocks with scales): "
            "dequantize them to bf16 first; valid: an unquantized checkpoint"
        )
    rope = dict(hf_field(hf_config, "rope_parameters", "rope_scaling", default={}))
    yarn = None
    if rope.get("rope_type", rope.get("type", "default")) == "yarn":
        fields = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
        yarn = YarnScaling(**{k: rope[k] for k in fields if rope.get(k) is not None})
    moe = MoEConfig(
        n_routed_experts=hf_field(hf_config, "n_routed_experts", "num_local_experts"),
        top_k=hf_config.num_experts_per_tok,
        moe_ffn_dim=hf_config.moe_intermediate_size,
        n_shared_experts=hf_field(hf_config, "n_shared_experts", default=0),
        first_k_dense=hf_field(hf_config, "first_k_dense_replace", default=0),
        router="sigmoid",
        n_group=hf_field(hf_config, "n_group", default=1),
        topk_group=hf_field(hf_config, "topk_group", default=1),
        norm_topk_prob=bool(hf_field(hf_config, "norm_topk_prob", default=True)),
        routed_scaling_factor=float(hf_field(hf_config, "routed_scaling_factor", default=1.0)),
        # DeepSeek-V3's training settings (its config.json keeps none): sequence-wise aux loss 1e-4, bias step 1e-3.
        aux_loss="sequence",
        aux_loss_coeff=1e-4,
        bias_update_rate=1e-3,
    )
    mla = MLAConfig(
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_nope_head_dim=hf_config.qk_nope_head_dim,
        qk_rope_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        q_lora_rank=hf_config.q_lora_rank,
        yarn=yarn,
    )
    return moe, mla
