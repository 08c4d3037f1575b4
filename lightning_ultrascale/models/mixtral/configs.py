"""The Mixtral family's presets (its Hugging Face translation is Llama's plus the MoE keys:
:mod:`lightning_ultrascale.models.llama.hf`)."""

from lightning_ultrascale.models.common.decoder import LlamaConfig
from lightning_ultrascale.models.common.moe import MoEConfig

__all__ = ["CONFIGS"]

CONFIGS: dict[str, LlamaConfig] = {
    # mistralai/Mixtral-8x7B-v0.1 config.json: 46.7B total, 12.9B active parameters.
    "mixtral_8x7b": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, ffn_hidden_dim=14336,
        rope_theta=1e6, max_seq_len=32768, name="mixtral_8x7b",
        moe=MoEConfig(n_routed_experts=8, top_k=2, moe_ffn_dim=14336, aux_loss="switch", aux_loss_coeff=0.02),
    ),
}  # fmt: skip
