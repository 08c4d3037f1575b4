"""The DeepSeek family: its presets (``configs``) and Hugging Face translation (``hf``). A DeepSeek
model is the shared decoder (:class:`~lightning_ultrascale.models.common.decoder.Llama`) whose config
carries an ``MLAConfig`` (multi-head latent attention, in :mod:`lightning_ultrascale.models.common.mla`
beside the other attention, with its tensor-parallel plan) and an ``MoEConfig``."""

from lightning_ultrascale.models.deepseek.configs import CONFIGS

__all__ = ["CONFIGS"]
