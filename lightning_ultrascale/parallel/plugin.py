"""The contract between the strategy and each parallelism technique.

A plugin knows its technique and nothing of the others; :class:`UltraScaleStrategy` knows the order
in which plugins apply and nothing of their insides. The order is fixed by the data flow of
DESIGN.md (build on meta -> FP8 swap -> pipeline split -> experts -> tensor -> context ->
recomputation -> compile -> data-parallel wrapping -> materialise), whatever order a user lists
plugins in: e.g. FSDP must wrap modules that tensor parallel has already turned into DTensors.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from lightning_ultrascale.models.spec import ModelSpec
from lightning_ultrascale.parallel.dims import ParallelDims
from lightning_ultrascale.parallel.mesh import ParallelMesh
from lightning_ultrascale.utils.memory import ModelStateBytes

#: The fixed order in which plugins are applied to the (meta-device) model.
APPLY_ORDER: tuple[str, ...] = (
    "fp8",
    "pipeline",
    "expert",
    "tensor",
    "context",
    "recompute",
    "compile",
    "data",
)


class ParallelPlugin(abc.ABC):
    """Base class of one technique: declares its mesh sizes, validates, and rewrites the model.

    Subclasses set ``applies_at`` (their place in :data:`APPLY_ORDER`) and implement :meth:`mesh_sizes`
    and :meth:`apply`. A size of ``None`` asks the strategy to infer it from the world size (at
    most one plugin may leave its size open).
    """

    applies_at: ClassVar[str]

    @abc.abstractmethod
    def mesh_sizes(self) -> dict[str, int | None]:
        """The mesh dims this plugin owns and their sizes (``None``: infer from the world size)."""

    def validate(self, dims: ParallelDims, spec: ModelSpec) -> None:
        """Raise :class:`~lightning_ultrascale.errors.ConfigError` for a layout this technique cannot run."""

    @abc.abstractmethod
    def apply(self, model: nn.Module, mesh: ParallelMesh) -> nn.Module:
        """Rewrite ``model`` (still on the meta device) for this technique and return it."""

    def validate_data(self, seq_len: int, micro_batch_size: int) -> None:
        """Raise :class:`~lightning_ultrascale.errors.ConfigError` for batch shapes this technique cannot split."""

    def set_precision(self, precision: str) -> None:
        """Told the run's Lightning precision (``"32-true"``, ``"bf16-mixed"``, ...) before :meth:`apply`."""

    def on_materialized(self, model: nn.Module) -> None:
        """Called once the model's parameters have storage and their initial values.

        Materialising (``to_empty``) creates new ``Parameter`` objects, so engines that hook into
        parameters (e.g. gradient bucketing) bind here, not in :meth:`apply`.
        """

    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Called once Lightning has built the optimizers (e.g. to shard their states)."""

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """This rank's state of ``optimizer`` in a DCP-saveable form, if this plugin shards it; else None."""
        return None

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Restore what :meth:`optimizer_state_dict` gave (its tensors already filled in by DCP)."""

    def reduced_gradients(self) -> dict[nn.Parameter, torch.Tensor] | None:
        """Averaged gradients, if this plugin keeps them away from ``param.grad`` (a collective); else None."""
        return None

    def expected_state_bytes(self, n_params: int, k_optimizer: int) -> ModelStateBytes | None:
        """The playbook's per-rank model-state bytes for this plugin's layout, if it has a formula."""
        return None

    @contextlib.contextmanager
    def step_context(self) -> Iterator[None]:
        """Entered around every training/validation step and its backward (e.g. loss parallel)."""
        yield

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient synchronisation inside this block (non-final gradient-accumulation steps)."""
        yield

    def shard_batch(self, batch: Any) -> Any:
        """This rank's part of a batch every rank of its data-parallel group received (context parallel)."""
        return batch

    @property
    def runs_step(self) -> bool:
        """Whether this plugin runs forward and backward itself (a pipeline schedule), not Lightning."""
        return False

    def run_step(
        self, module: Any, batch: Any, train: bool, accumulate: int = 1, loss_scale: float | torch.Tensor = 1.0
    ) -> torch.Tensor:
        """Forward (and backward if ``train``) over ``batch``; the batch's mean loss on every rank.

        ``accumulate``: calls per optimizer step; ``loss_scale``: this rank's token weight
        (``utils/loss.py``).
        """
        raise NotImplementedError(f"{type(self).__name__} does not run steps")

    def sync_gradients(self) -> None:
        """Reduce what :meth:`no_sync` held back, outside backward (after a pipeline schedule's last step)."""

    def grad_norm_groups(self) -> tuple[Any, ...]:
        """Process groups over which the gradient norm's square must also be summed (pipeline stages)."""
        return ()

    def settings(self) -> dict[str, Any]:
        """Settings that tell this plugin apart in logs, shown before its mesh sizes."""
        return {}

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in {**self.settings(), **self.mesh_sizes()}.items())
        return f"{type(self).__name__}({fields})"


def model_parts(model: nn.Module) -> list[nn.Module]:
    """The modules whose ``forward`` the step calls: the pipeline stages if the model was split, else the model.

    Data-parallel wrapping (FSDP) makes each part the root of a unit.
    """
    parts = getattr(model, "_ultrascale_parts", None)
    return list(parts()) if parts is not None else [model]
