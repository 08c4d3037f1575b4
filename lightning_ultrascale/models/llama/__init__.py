"""The Llama family (Llama 3.x; with MoE blocks, Mixtral and DeepSeek-style MoE; with MLA, DeepSeek-V2/V3).

``model``: the config and the module; ``parallel``: its tensor-parallel plan. Its Hugging Face
state-dict adapter is :mod:`lightning_ultrascale.models.hf.convert`; the layers it shares with other
families live in :mod:`lightning_ultrascale.models.common`, MLA in :mod:`lightning_ultrascale.models.common.mla`.
"""

from lightning_ultrascale.models.llama.model import (
    Attention,
    FeedForward,
    Llama,
    LlamaConfig,
    RMSNorm,
    RopeScaling,
    TransformerBlock,
    apply_rope,
    param_seed,
    rope_inv_freq,
)
from lightning_ultrascale.models.llama.parallel import llama_tp_plan

__all__ = [
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "RopeScaling",
    "TransformerBlock",
    "apply_rope",
    "llama_tp_plan",
    "param_seed",
    "rope_inv_freq",
]
