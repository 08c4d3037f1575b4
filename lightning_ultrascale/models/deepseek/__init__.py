"""The DeepSeek family's own part: its Hugging Face translation (``hf``). A DeepSeek model is a
:class:`~lightning_ultrascale.models.llama.Llama` whose config carries an ``MLAConfig`` (multi-head
latent attention, in :mod:`lightning_ultrascale.models.common.mla` beside the other attention, with its
tensor-parallel plan) and an ``MoEConfig``."""
