"""The Llama family (Llama 3.x; Qwen2's q/k/v biases): its presets (``configs``) and Hugging Face
translation (``hf``). Its model is the shared decoder of :mod:`lightning_ultrascale.models.common.decoder`
with its tensor-parallel plan (:mod:`lightning_ultrascale.models.common.tp_plan`), re-exported here
under the names it has always had here.
"""

from lightning_ultrascale.models.common.decoder import (
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
from lightning_ultrascale.models.common.tp_plan import llama_tp_plan
from lightning_ultrascale.models.llama.configs import CONFIGS

__all__ = [
    "CONFIGS",
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
