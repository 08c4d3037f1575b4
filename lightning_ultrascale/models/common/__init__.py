"""What every model family shares: the norm, attention kernels and feed-forward (``layers``), the
mixture of experts (``moe``) and packed-document attention (``documents``). Nothing here imports a
family, so every family can import it."""
