"""What metrics and tests read of a layout, as a part of :class:`~lightning_ultrascale.UltraScaleStrategy`.

Sums over the ranks that see different tokens (each counted once),
the averaged gradients a sharded optimizer keeps away from ``param.grad``, the playbook's
model-state bytes of this layout, and Lightning's ``reduce`` (``self.log(..., sync_dist=True)``)
of a DTensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_ultrascale.utils.memory import ModelStateBytes, model_state_bytes

if TYPE_CHECKING:
    from lightning_ultrascale.parallel.dims import ParallelDims
    from lightning_ultrascale.parallel.layout import Layout


class LayoutStatistics(ModelParallelStrategy):
    """The strategy's part: statistics over its ``layout`` (see the module docstring)."""

    layout: Layout
    parallel_dims: ParallelDims

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Lightning's reduce, of a DTensor too: under ``TensorParallel(loss_parallel=True)`` a
        model's loss is a DTensor (cross-entropy on vocabulary shards), which c10d cannot reduce;
        its full value is reduced like any tensor (``self.log(loss, sync_dist=True)`` works)."""
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        return super().reduce(tensor, group, reduce_op)

    def sum_over_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a statistic over the ranks that see different tokens (and pipeline stages), each counted once.

        Tensor-parallel ranks hold the same tokens, so they are left out (Lightning's ``reduce``
        would count them ``tp`` times). E.g. the loss's sums over the global batch; not a folded MoE
        layer's tokens per expert (each tp rank counts its own share: sum those over every rank).
        """
        torch.distributed.all_reduce(tensor, group=self.batch_group())
        return tensor

    def batch_group(self) -> Any:
        """The ranks that see different tokens (and the pipeline stages): every rank but its tensor-parallel peers."""
        return self.layout.mesh.over(("pp", "dp_replicate", "dp_shard", "cp")).get_group()

    def reduced_gradients(self) -> dict[nn.Parameter, torch.Tensor] | None:
        """Averaged gradients where an engine keeps them away from ``param.grad`` (a sharded optimizer), else None."""
        grads: dict[nn.Parameter, torch.Tensor] = {}
        for sync in self.layout.grad_syncs:
            grads.update(sync.reduced_gradients() or {})
        return grads or None

    def master_weights(self) -> dict[nn.Parameter, torch.Tensor]:
        """Each parameter's fp32 master copy where the layout keeps one (``bf16-mixed``, ZeRO 0-2; a collective)."""
        masters: dict[nn.Parameter, torch.Tensor] = {}
        for sync in self.layout.grad_syncs:
            masters.update(sync.master_weights())
        return masters

    def model_state_bytes(self) -> ModelStateBytes:
        """This rank's parameters, gradients and optimizer states, engines' gradient buckets included."""
        assert self.lightning_module is not None
        held = [t for sync in self.layout.grad_syncs for t in sync.grad_buffers()]
        return model_state_bytes(self.lightning_module, self.optimizers, extra_grad_buffers=held)

    def expected_model_state_bytes(self, n_params: int, k_optimizer: int) -> ModelStateBytes | None:
        """The playbook's per-rank model state for this layout: each engine's formula for its share."""
        syncs = self.layout.grad_syncs
        counts = [sum(p.numel() for p in sync.params) for sync in syncs]
        parts = [s.expected_bytes(round(n_params * c / sum(counts)), k_optimizer) for s, c in zip(syncs, counts) if c]
        if not parts:
            return None
        return ModelStateBytes(*(sum(getattr(p, f) for p in parts) for f in ("params", "grads", "optimizer_states")))
