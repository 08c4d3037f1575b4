"""The Hugging Face config keys every family we convert spells the same way."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_ultrascale.models.common.decoder import LlamaConfig

__all__ = ["common_to_hf", "hf_field"]


def common_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    """The config keys every architecture we convert spells the same way."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
    }


def hf_field(hf_config: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` that ``hf_config`` has (transformers configs alias some; config.json does not)."""
    for name in names:
        value = getattr(hf_config, name, None)
        if value is not None:
            return value
    return default
