"""UltraScaleStrategy: one Lightning strategy that composes the playbook's parallelism plugins.

The strategy holds Lightning's Trainer hooks; what it shares with the Fabric strategy (``fabric.py``)
is ``composition.py``: the plugins in their fixed order, the mesh, validation and the rewrite of the
model. Plugins (``parallel/plugin.py``) hand each other facts through the ``Layout``; a step runner
(``parallel/step.py``) runs each step; gradient-sync engines (``parallel/data/engines.py``) average
gradients. Checkpoints, the non-finite guard, the statistics metrics read and the watchdog are
mixins of their own modules. Lightning's ``ModelParallelStrategy`` provides process groups,
launchers and DCP checkpoints; its 2-D mesh becomes the ``(pp, dp_replicate, dp_shard, cp, tp)`` mesh.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Generator, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ultrascale.core.agreement import StepAgreement
from lightning_ultrascale.core.checkpoint import LayoutCheckpoints
from lightning_ultrascale.core.composition import PluginComposition
from lightning_ultrascale.core.guard import GuardedSteps, NonFiniteGuard
from lightning_ultrascale.core.statistics import LayoutStatistics
from lightning_ultrascale.core.watchdog import WatchedRanks
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.contract import check_module
from lightning_ultrascale.models.hf.adapter import adapt_in
from lightning_ultrascale.models.spec import ModelSpec, find_model
from lightning_ultrascale.parallel.dims import DataShape
from lightning_ultrascale.parallel.plugin import ParallelPlugin
from lightning_ultrascale.utils.grad import clip_grad_value_

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)


class UltraScaleStrategy(
    LayoutCheckpoints, GuardedSteps, LayoutStatistics, WatchedRanks, PluginComposition, ModelParallelStrategy
):
    """Train with any composition of the Ultra-Scale Playbook's parallelism techniques.

    Plugins may be listed in any order; they are applied in the fixed order of
    :data:`~lightning_ultrascale.parallel.plugin.APPLY_ORDER`. Without a plugin for the data dims, plain
    data parallelism takes the ranks left over. One plugin may leave its size unset (inferred).
    The LightningModule must hold a model that declares a
    :class:`~lightning_ultrascale.models.spec.ModelSpec` (our ``Llama`` does) and build it in
    ``configure_model``: the strategy builds it on the meta device, applies the plugins, then
    materialises it and calls ``init_weights(seed)``, so every layout starts from the weights a
    single-process run would have. Layout, model and batch shape are validated once, before any
    process group (:meth:`validate`).

    Args:
        *plugins: parallelism plugins, e.g. ``DataParallel()``.
        seed: seed of the per-parameter weight initialisation.
        save_distributed_checkpoint: save sharded (DCP) checkpoints, one file per rank (default),
            or a single full checkpoint assembled on rank 0.
        async_checkpoint: write sharded checkpoints in the background while training goes on.
        guard: what a non-finite loss or gradient does (default: stop the run, naming where).
        process_group_backend: ``"nccl"`` / ``"gloo"``; default: by device.
        timeout: timeout of every collective: a hung rank fails the job after this long (and a
            watchdog on every rank ends the ranks a failed job leaves behind).
        tf32: on CUDA, run the fp32 matmuls and convolutions that remain (reference ops' backward,
            fp32 runs) on TF32 tensor cores, as torchtitan does; False for exact fp32.

    Example:
        >>> import lightning as L
        >>> from lightning_ultrascale import UltraScaleStrategy, ZeRO
        >>> strategy = UltraScaleStrategy(ZeRO(stage=2, bucket_mb=25))
        >>> trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2)  # doctest: +SKIP
    """

    strategy_name = "ultrascale"

    def __init__(
        self,
        *plugins: ParallelPlugin,
        seed: int = 0,
        save_distributed_checkpoint: bool = True,
        async_checkpoint: bool = False,
        guard: NonFiniteGuard | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=10),
        tf32: bool = True,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.compose(plugins, seed)
        self.async_checkpoint = async_checkpoint
        self.guard = guard or NonFiniteGuard()
        self.agreement = StepAgreement()
        self.tf32 = tf32

    # ----------------------------------------------------------------------------- sizes, mesh, layout
    @override
    def active_precision(self) -> Any:
        return self.precision_plugin

    @override
    def _configure_launcher(self) -> None:
        # Lightning calls this while building the Trainer, once devices and nodes are known: the
        # earliest point at which the world size is, and long before any process group exists.
        self._parallel_dims = self.resolve_dims(self.world_size)
        if self.step.requires_sharded_checkpoint and not self._save_distributed_checkpoint:
            owner = next(p for p in self.plugins if p.step_runner is self.step)
            raise ConfigError(
                f"{owner!r} keeps parameters on some ranks only; save sharded checkpoints with "
                "UltraScaleStrategy(save_distributed_checkpoint=True), the default"
            )
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        spec = getattr(self.lightning_module, "model_spec", None)  # declared before the model exists
        if isinstance(spec, ModelSpec):
            datamodule = getattr(getattr(self.lightning_module, "_trainer", None), "datamodule", None)
            self.validate(spec, DataShape.declared_by(datamodule))
        adapt_in(self.lightning_module)  # a Hugging Face causal LM gets the contract in place
        check_module(self.lightning_module, self.applied_plugins())  # the model contract, if built yet
        self._setup_distributed()
        if self.root_device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = self.tf32
        self.build_layout(self.root_device.type)
        self._device_mesh = self.mesh.root
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        log.info("UltraScaleStrategy: %s", self.describe())

    # ----------------------------------------------------------------------------- model
    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Always meta: plugins rewrite the model before any rank allocates it, then setup()
        # materialises each rank's part and initialises it per parameter.
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    def parallelize(self) -> nn.Module:
        """Apply every plugin in order, then materialise and initialise the weights (idempotent)."""
        assert self.lightning_module is not None
        return self.parallelize_module(self.lightning_module, self.root_device)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        model = self.parallelize()
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # Only now, and at every setup: dtype conversion and .to(device) swap the tensors of
        # subclass parameters (DTensor), and autograd hooks registered before stay with the old ones.
        for sync in self.layout.grad_syncs:
            sync.bind(model)
        self.step.bind(self.layout)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            for sync in self.layout.grad_syncs:
                sync.attach(self.optimizers)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    # ----------------------------------------------------------------------------- step
    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        # Lightning enters this on non-final gradient-accumulation micro-steps.
        with self.step.no_sync():
            yield

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.guard.observe(self.step.training_step(self.lightning_module, super().training_step, args, kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.step.validation_step(self.lightning_module, super().validation_step, args, kwargs)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.step.on_train_start(self.lightning_module)

    @override
    def on_train_end(self) -> None:
        self.wait_for_parameters()
        super().on_train_end()

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        with self.step.backward_context():
            return super().backward(self.step.weighted(closure_loss), optimizer, *args, **kwargs)

    @override
    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()
        # Lightning clips with torch's clip_grad_norm_, which cannot mix sharded DTensor gradients
        # with replicated ones; ours counts every gradient exactly once in any layout. By value:
        # torch's refuses partial sums (sequence-parallel norm weights); ours reduces them first.
        assert self.lightning_module is not None
        plugin, (model, _) = self.precision_plugin, find_model(self.lightning_module)
        plugin.clip_grad_by_norm = lambda optimizer, clip_val: self.clip_grad_norm(  # type: ignore[method-assign]
            model, plugin.main_params(optimizer), float(clip_val)
        )
        plugin.clip_grad_by_value = lambda optimizer, clip_val: clip_grad_value_(  # type: ignore[method-assign]
            plugin.main_params(optimizer), float(clip_val)
        )

    @override
    def teardown(self) -> None:
        # The clipping closures hold the model: a precision plugin the user keeps (or reuses for the next
        # Trainer) must not keep this run's model and optimizer state alive.
        for name in ("clip_grad_by_norm", "clip_grad_by_value"):
            vars(self.precision_plugin).pop(name, None)
        super().teardown()
