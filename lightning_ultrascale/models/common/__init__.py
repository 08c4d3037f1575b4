"""What every model family shares: the decoder (``decoder``: Llama's, with MoE and MLA blocks where a
config asks) and its tensor-parallel plan (``tp_plan``); the norm, attention kernels and feed-forward
(``layers``), multi-head latent attention (``mla``), the mixture of experts (``moe``) and packed-document
attention (``documents``). Nothing here imports a family, so every family can import it."""
