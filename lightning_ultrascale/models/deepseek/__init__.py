"""The DeepSeek family's own part: multi-head latent attention (``mla``: DeepSeek-V2/V3), with its
tensor-parallel plan. A DeepSeek model is a :class:`~lightning_ultrascale.models.llama.Llama` whose
config carries an ``MLAConfig`` (and an ``MoEConfig``)."""
