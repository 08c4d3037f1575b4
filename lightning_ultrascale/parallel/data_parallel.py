"""Data parallelism (the playbook's DP): ``ZeRO(stage=0)`` under the name users look for.

Every rank of ``dp_replicate`` holds the whole model and reads its own slice of the global batch;
gradients are averaged over the data dims by :class:`~lightning_ultrascale.parallel.buckets.BucketedAllReduce`,
overlapped with backward. Per step each rank moves 2·Ψ·(N-1)/N gradient bytes with a ring all-reduce.
"""

from __future__ import annotations

from lightning_ultrascale.parallel.zero import ZeRO


class DataParallel(ZeRO):
    """Plain data parallelism over the ``dp_replicate`` mesh dim (``ZeRO(stage=0)``).

    Args:
        size: number of model replicas; ``None`` (default) takes whatever ranks the other plugins
            leave (world size / (tp x cp x pp)).
        bucket_mb: gradient bucket size in MiB (DDP's default is 25): larger buckets mean fewer,
            more efficient all-reduces; smaller ones start communicating earlier in backward.

    Example:
        >>> import lightning as L
        >>> from lightning_ultrascale import UltraScaleStrategy, DataParallel
        >>> strategy = UltraScaleStrategy(DataParallel(bucket_mb=25))
        >>> trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2)  # doctest: +SKIP
    """

    def __init__(self, size: int | None = None, bucket_mb: float = 25.0) -> None:
        super().__init__(stage=0, size=size, bucket_mb=bucket_mb)
