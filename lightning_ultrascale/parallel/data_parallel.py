"""Data parallelism (the playbook's DP, i.e. ZeRO stage 0): replicate the model, average gradients.

Every rank of the ``dp_replicate`` dim holds the whole model and reads its own slice of the global
batch; gradients are averaged over the data dims (``dp_cp``: context-parallel ranks hold other
tokens of the same samples, so they reduce together) by :class:`BucketedAllReduce`, overlapped
with backward. Per step each rank moves 2·Ψ·(N-1)/N gradient bytes with a ring all-reduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.parallel.buckets import BucketedAllReduce
from lightning_ultrascale.parallel.mesh import ParallelMesh
from lightning_ultrascale.parallel.plugin import ParallelPlugin


class DataParallel(ParallelPlugin):
    """Plain data parallelism over the ``dp_replicate`` mesh dim.

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

    stage = "data"

    def __init__(self, size: int | None = None, bucket_mb: float = 25.0) -> None:
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ConfigError(f"parallel.dp={size!r} must be a positive integer or None (inferred)")
        if not bucket_mb > 0:
            raise ConfigError(f"parallel.bucket_mb={bucket_mb!r} must be > 0 (DDP's default is 25)")
        self.size = size
        self.bucket_mb = bucket_mb
        self.reducer: BucketedAllReduce | None = None
        self._group: DeviceMesh

    def mesh_sizes(self) -> dict[str, int | None]:
        return {"dp_replicate": self.size}

    def apply(self, model: nn.Module, mesh: ParallelMesh) -> nn.Module:
        # Replicas keep the model as it is; only gradients are reduced, over every data dim.
        self._group = mesh["dp_cp"]
        return model

    def on_materialized(self, model: nn.Module) -> None:
        if self.reducer is not None:
            self.reducer.remove()
        if self._group.size() > 1:
            self.reducer = BucketedAllReduce(
                list(model.parameters()), self._group.get_group(), bucket_bytes=int(self.bucket_mb * 2**20)
            )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.reducer.no_sync() if self.reducer is not None else contextlib.nullcontext():
            yield
