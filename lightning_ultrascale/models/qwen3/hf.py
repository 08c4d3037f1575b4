"""The Qwen3 family's Hugging Face config translation: ``Qwen3Config`` (dense) and ``Qwen3MoeConfig``.

Qwen3 is ``LlamaConfig``'s keys (:mod:`lightning_ultrascale.models.llama.hf`) with an RMSNorm over each query
and key head (our ``qk_norm``) and heads of their own width (``head_dim``: our ``attention_head_dim``);
Qwen3-MoE adds softmax-routed experts, every block sparse (``decoder_sparse_step=1``, no ``mlp_only_layers``),
no shared experts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.common.hf import hf_field
from lightning_ultrascale.models.common.moe import MoEConfig

if TYPE_CHECKING:
    from lightning_ultrascale.models.common.decoder import LlamaConfig

__all__ = ["QWEN3_TYPES", "qwen3_from_hf", "qwen3_to_hf"]

#: transformers ``model_type`` of the dense and the MoE model.
QWEN3_TYPES = ("qwen3", "qwen3_moe")


def qwen3_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    """The keys ``Qwen3Config`` / ``Qwen3MoeConfig`` add to Llama's (:func:`~lightning_ultrascale.models.llama.hf.
    llama_to_hf`) for ``cfg``."""
    keys: dict[str, Any] = {"use_sliding_window": False}
    moe = cfg.moe
    if moe is not None:
        keys |= {
            "moe_intermediate_size": moe.moe_ffn_dim,
            "num_experts": moe.n_routed_experts,
            "num_experts_per_tok": moe.top_k,
            "norm_topk_prob": moe.norm_topk_prob,
            "router_aux_loss_coef": moe.aux_loss_coeff,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    return keys


def qwen3_from_hf(hf_config: Any) -> tuple[int | None, MoEConfig | None]:
    """``(attention_head_dim, moe)`` of a Qwen3 or Qwen3-MoE config: the head width where it is not
    ``hidden_size / num_attention_heads`` (None otherwise), and the experts of a Qwen3-MoE one (None: dense).

    Raises :class:`ConfigError` for dense blocks among the sparse ones (``decoder_sparse_step`` other than 1,
    ``mlp_only_layers``), which our decoder does not place.
    """
    width = getattr(hf_config, "head_dim", None)
    head_dim = None if not width or width == hf_config.hidden_size // hf_config.num_attention_heads else int(width)
    if getattr(hf_config, "model_type", None) != "qwen3_moe":
        return head_dim, None
    step, dense = getattr(hf_config, "decoder_sparse_step", 1), list(getattr(hf_config, "mlp_only_layers", None) or [])
    if step != 1 or dense:
        raise ConfigError(
            f"hf qwen3_moe decoder_sparse_step={step!r}, mlp_only_layers={dense!r}: dense blocks among the sparse ones "
            "are not supported; valid: decoder_sparse_step=1, mlp_only_layers=[] (every block MoE, as Qwen3-MoE is)"
        )
    return head_dim, MoEConfig(
        # Qwen's config.json spells it num_experts; transformers 5 writes its alias num_local_experts
        n_routed_experts=hf_field(hf_config, "num_experts", "num_local_experts"),
        top_k=hf_config.num_experts_per_tok,
        moe_ffn_dim=hf_config.moe_intermediate_size,
        router="softmax",
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
        aux_loss="switch",
        aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0)),
    )
