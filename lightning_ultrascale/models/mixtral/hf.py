"""The Mixtral family's Hugging Face config translation: ``MixtralConfig`` is ``LlamaConfig``'s keys
(:mod:`lightning_ultrascale.models.llama.hf`) plus these of its experts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_ultrascale.models.common.moe import MoEConfig

if TYPE_CHECKING:
    from lightning_ultrascale.models.common.decoder import LlamaConfig

__all__ = ["mixtral_from_hf", "mixtral_to_hf"]


def mixtral_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    """``MixtralConfig``'s expert keys of ``cfg`` (none for a dense model)."""
    if cfg.moe is None:
        return {}
    return {
        "intermediate_size": cfg.moe.moe_ffn_dim,
        "num_local_experts": cfg.moe.n_routed_experts,
        "num_experts_per_tok": cfg.moe.top_k,
        "router_aux_loss_coef": cfg.moe.aux_loss_coeff,
    }


def mixtral_from_hf(hf_config: Any) -> MoEConfig | None:
    """The MoE part of a Mixtral config (None for a dense Llama or Qwen2 one)."""
    if not getattr(hf_config, "num_local_experts", None):
        return None
    return MoEConfig(
        n_routed_experts=hf_config.num_local_experts,
        top_k=hf_config.num_experts_per_tok,
        moe_ffn_dim=hf_config.intermediate_size,
        aux_loss="switch",
        aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0)),
    )
