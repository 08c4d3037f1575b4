"""Tensor parallelism and sequence parallelism (the playbook's TP/SP chapter), over DTensor.

Megatron's split, as the model declares it (``ModelSpec.tp_plan``): attention and MLP input
projections are column-parallel (each ``tp`` rank holds a slice of the heads / hidden units),
output projections row-parallel, so a block costs one all-reduce in forward and one in backward
per sub-layer. The embedding is vocabulary-parallel and the output projection leaves logits sharded
over the vocabulary: with ``loss_parallel`` the cross-entropy runs on the shards and ``[b, s, V]``
logits never exist in full on a rank.

With ``sequence_parallel`` the residual stream between sub-layers is sharded over the sequence:
norms work on ``s/tp`` tokens and each all-reduce becomes a reduce-scatter (after the row-parallel
projection) plus an all-gather (before the column-parallel one): the same bytes, and the
norm/residual activations divided by ``tp``. TP needs fast links: keep it inside a node.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from lightning_ultrascale.errors import ConfigError, nearby_multiples, require_positive_int
from lightning_ultrascale.models.spec import ModelSpec, require_spec
from lightning_ultrascale.parallel.dims import ParallelDims
from lightning_ultrascale.parallel.mesh import ParallelMesh
from lightning_ultrascale.parallel.plugin import ParallelPlugin


class TensorParallel(ParallelPlugin):
    """Shard attention, MLP, embedding and head over the ``tp`` mesh dim.

    Args:
        size: tensor-parallel degree; must divide the model's heads and kv-heads.
        sequence_parallel: shard norms and the residual stream over the sequence (Megatron SP).
        loss_parallel: compute the cross-entropy on vocabulary shards (no full logits).

    Example:
        >>> from lightning_ultrascale import TensorParallel, UltraScaleStrategy, ZeRO
        >>> strategy = UltraScaleStrategy(TensorParallel(2, sequence_parallel=True), ZeRO(stage=3))
    """

    applies_at = "tensor"

    def __init__(self, size: int, sequence_parallel: bool = True, loss_parallel: bool = True) -> None:
        require_positive_int("parallel.tp", size)
        self.size = size
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel

    def mesh_sizes(self) -> dict[str, int | None]:
        return {"tp": self.size}

    def validate(self, dims: ParallelDims, spec: ModelSpec) -> None:
        if self.size > 1 and spec.tp_plan is None:
            raise ConfigError(
                f"parallel.tp={self.size}, but model {spec.name} declares no tensor-parallel plan (ModelSpec.tp_plan)"
            )

    def validate_data(self, seq_len: int, micro_batch_size: int) -> None:
        self.validate_sequence(seq_len)

    def validate_sequence(self, seq_len: int) -> None:
        """Sequence parallelism splits the sequence: it must divide by ``tp``."""
        if self.size > 1 and self.sequence_parallel and seq_len % self.size:
            raise ConfigError(
                f"data.seq_len={seq_len} must be divisible by parallel.tp={self.size} with sequence parallelism; "
                f"valid nearby: {nearby_multiples(seq_len, self.size)} (or parallel.sequence_parallel=false)"
            )

    def apply(self, model: nn.Module, mesh: ParallelMesh) -> nn.Module:
        if self.size == 1:
            return model
        spec = require_spec(model)
        assert spec.tp_plan is not None
        tp_mesh = mesh["tp"]
        top, block_plan = spec.tp_plan(self.sequence_parallel)
        # A pipeline stage may lack the embedding or the head (set to None): nothing to shard there.
        top = {name: style for name, style in top.items() if _present(model, name)}
        parallelize_module(model, tp_mesh, top)
        for block in model.get_submodule(spec.layers).values():
            parallelize_module(block, tp_mesh, block_plan)
        # parallelize_module swaps the embedding and head weights for two separate DTensors; a
        # tied model ties them again (both are sharded the same way: over the vocabulary).
        tie = getattr(model, "tie_weights", None)
        if tie is not None:
            tie()
        return model

    @contextlib.contextmanager
    def step_context(self) -> Iterator[None]:
        # Around the loss AND its backward (torchtitan does the same): cross-entropy on vocab shards.
        with loss_parallel() if self.size > 1 and self.loss_parallel else contextlib.nullcontext():
            yield


def _present(model: nn.Module, name: str) -> bool:
    try:
        return model.get_submodule(name) is not None
    except AttributeError:
        return False
