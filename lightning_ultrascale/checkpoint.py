"""Sharded (DCP) checkpoints of any layout, as a part of :class:`~lightning_ultrascale.UltraScaleStrategy`.

Parameters are saved and loaded by their names in the whole model (DCP reshards by name), so the
same code serves every layout. Optimizer states come from the gradient-sync engines where one
shards them (its own keys, per pipeline part and parameter group), else from torch's
``get_optimizer_state_dict``, flattened where the step runner says ranks hold different
parameters (pipeline stages: nested ``param_groups`` lists would be one DCP entry with a
different value per stage).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ultrascale.errors import ConfigError

if TYPE_CHECKING:
    from lightning_ultrascale.parallel.layout import Layout
    from lightning_ultrascale.parallel.step import StepRunner


class LayoutCheckpoints(ModelParallelStrategy):
    """Lightning's checkpoint hooks for the strategy's layout (its ``layout`` and ``step``)."""

    layout: Layout
    step: StepRunner

    def _sharded_optimizer_state(self) -> dict[str, Any] | None:
        states = {s.key: s.optimizer_state() for s in self.layout.grad_syncs}
        return {k: v for k, v in states.items() if v is not None} or None

    def _optimizer_state_options(self) -> StateDictOptions:
        return StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=self.step.flatten_optimizer_state)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        sharded = self._sharded_optimizer_state()
        if sharded is not None:
            if not self._save_distributed_checkpoint:
                raise ConfigError(
                    f"{self.describe()} shards optimizer states across ranks; save them with "
                    "UltraScaleStrategy(save_distributed_checkpoint=True), the default"
                )
            return sharded
        if not self.step.flatten_optimizer_state:
            return super().optimizer_state(optimizer)
        assert self.model is not None
        return get_optimizer_state_dict(self.model, inner, options=self._optimizer_state_options())

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint of any layout's model: sharded (DCP) or full, DTensor parameters or not.

        Lightning's own loader insists on DTensor parameters, which replicated layouts do not have;
        and engines that shard the optimizer keep states that only they can map.
        """
        from torch.distributed.checkpoint import load as dcp_load
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        assert self.model is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        if not _is_sharded_checkpoint(path):
            if any(isinstance(p, DTensor) for p in self.model.parameters()):
                return super().load_checkpoint(path, weights_only=weights_only)
            checkpoint = torch.load(path, map_location="cpu", weights_only=weights_only)
            self.model.load_state_dict(checkpoint.pop("state_dict"), strict=strict)
            for optimizer, state in zip(self.optimizers, checkpoint.pop("optimizer_states", [])):
                optimizer.load_state_dict(state)
            return checkpoint
        # DCP loads into the tensors of a template state dict, in place, each rank its own part.
        model_state = {"state_dict": get_model_state_dict(self.model)}
        dcp_load(model_state, checkpoint_id=path)
        self.model.load_state_dict(model_state["state_dict"], strict=strict)
        for idx, optimizer in enumerate(self.optimizers):
            key, options = f"optimizer_{idx}", self._optimizer_state_options()
            sharded = self._sharded_optimizer_state()
            state = {key: sharded or get_optimizer_state_dict(self.model, optimizer, options=options)}
            dcp_load(state, checkpoint_id=path)
            if sharded is None:
                set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state[key], options=options)
                continue
            for sync in self.layout.grad_syncs:
                if sync.key in sharded:
                    sync.load_optimizer_state(state[key][sync.key])
        # Loops, schedulers, callbacks and the datamodule restore themselves from the rest.
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
