"""The Qwen3 family: its presets (``configs``) and Hugging Face config translation (``hf``). A Qwen3 model is the
shared decoder (:class:`~lightning_ultrascale.models.common.decoder.Llama`) with per-head query and key norms
(``qk_norm``), heads wider than ``dim / n_heads`` (``attention_head_dim``) and, for Qwen3-MoE, a softmax-routed
``MoEConfig`` in every block; its tensor-parallel plan is the decoder's. Its Hugging Face directories train
through ``model=hf`` (transformers' own modules), or convert to these models (``load_hf_pretrained``,
``model.init_from=hf:DIR``), and these models export to them (``ultrascale-export``)."""

from lightning_ultrascale.models.qwen3.configs import CONFIGS

__all__ = ["CONFIGS"]
