"""The Mixtral family: its presets (``configs``) and the MoE keys of its Hugging Face translation
(``hf``). A Mixtral model is the shared decoder (:class:`~lightning_ultrascale.models.common.decoder.Llama`)
whose config carries a softmax-routed ``MoEConfig``; its tensor-parallel plan is the decoder's."""

from lightning_ultrascale.models.mixtral.configs import CONFIGS

__all__ = ["CONFIGS"]
