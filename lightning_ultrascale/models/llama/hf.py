"""The Llama family's Hugging Face config translation: ``LlamaConfig`` and ``Qwen2Config`` (q/k/v biases);
``MixtralConfig`` adds its MoE keys (:mod:`lightning_ultrascale.models.mixtral.hf`)."""

from __future__ import annotations

from typing import Any

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.common.decoder import LlamaConfig, RopeScaling
from lightning_ultrascale.models.common.hf import common_to_hf

__all__ = ["llama_from_hf", "llama_to_hf"]


def llama_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    """``transformers.LlamaConfig`` (``Qwen2Config``) keyword arguments of ``cfg``."""
    s = cfg.rope_scaling
    return {
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
    } | ({"use_sliding_window": False} if cfg.qkv_bias else {})


def llama_from_hf(hf_config: Any) -> tuple[Any, RopeScaling | None]:
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
