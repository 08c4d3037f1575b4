"""The Llama family's Hugging Face config translation: ``LlamaConfig``, ``Qwen2Config`` (q/k/v biases) and
``MixtralConfig`` (MoE)."""

from __future__ import annotations

from typing import Any

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.common.hf import common_to_hf
from lightning_ultrascale.models.common.moe import MoEConfig
from lightning_ultrascale.models.llama.model import LlamaConfig, RopeScaling

__all__ = ["llama_from_hf", "llama_to_hf"]


def llama_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    """``transformers.LlamaConfig`` (with MoE: ``MixtralConfig``) keyword arguments of ``cfg``."""
    s = cfg.rope_scaling
    return (
        {
            **common_to_hf(cfg),
            "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "rope_scaling": None
            if s is None
            else {
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            },
            "mlp_bias": False,
        }
        | _moe_to_hf(cfg)
        | ({"use_sliding_window": False} if cfg.qkv_bias else {})
    )


def _moe_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    if cfg.moe is None:
        return {}
    return {
        "intermediate_size": cfg.moe.moe_ffn_dim,
        "num_local_experts": cfg.moe.n_routed_experts,
        "num_experts_per_tok": cfg.moe.top_k,
        "router_aux_loss_coef": cfg.moe.aux_loss_coeff,
    }


def llama_from_hf(hf_config: Any) -> tuple[Any, RopeScaling | None, MoEConfig | None]:
    """RoPE theta, Llama-3 scaling and (Mixtral) the MoE part of a Llama or Mixtral config."""
    rope_theta, scaling = _rope_from_hf(hf_config)
    moe = None
    if getattr(hf_config, "num_local_experts", None):  # Mixtral
        moe = MoEConfig(
            n_routed_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            moe_ffn_dim=hf_config.intermediate_size,
            aux_loss="switch",
            aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0)),
        )
    return rope_theta, scaling, moe


def _rope_from_hf(hf_config: Any) -> tuple[Any, RopeScaling | None]:
    """RoPE theta and Llama-3 scaling of a transformers config."""
    # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x in `rope_theta` / `rope_scaling`.
    rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    rope_theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ConfigError(f"hf rope_type={rope_type!r} is not supported; valid: 'default', 'llama3'")
    if rope_type != "llama3":
        return rope_theta, None
    return rope_theta, RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )
