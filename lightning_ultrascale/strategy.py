"""UltraScaleStrategy: one Lightning strategy that composes the playbook's parallelism plugins.

The strategy owns the mesh, the fixed order in which plugins rewrite the model, and Lightning's
hooks. Plugins (``parallel/plugin.py``) hand each other facts through the ``Layout``; a step
runner (``parallel/step.py``) runs each step; gradient-sync engines (``parallel/data/engines.py``)
average gradients. Checkpoints, the non-finite guard, the statistics metrics read and the
watchdog are mixins of their own modules. Lightning's ``ModelParallelStrategy`` provides process groups, launchers and
DCP checkpoints; its 2-D mesh becomes the ``(pp, dp_replicate, dp_shard, cp, tp)`` mesh.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
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

from lightning_ultrascale.checkpoint import LayoutCheckpoints
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.guard import GuardedSteps, NonFiniteGuard
from lightning_ultrascale.models.contract import check_init, check_model, check_module, init_reference
from lightning_ultrascale.models.hf_adapter import adapt_in
from lightning_ultrascale.models.spec import ModelSpec, find_model
from lightning_ultrascale.parallel.defaults import with_defaults
from lightning_ultrascale.parallel.dims import DataShape, ParallelDims
from lightning_ultrascale.parallel.layout import Layout
from lightning_ultrascale.parallel.mesh import ParallelMesh, build_mesh
from lightning_ultrascale.parallel.plugin import APPLY_ORDER, ParallelPlugin, resolve_dims
from lightning_ultrascale.parallel.step import StepRunner
from lightning_ultrascale.statistics import LayoutStatistics
from lightning_ultrascale.utils.comm import collective_device
from lightning_ultrascale.utils.grad import clip_grad_norm_
from lightning_ultrascale.watchdog import WatchedRanks

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

#: Which strategy parallelised a model: its parameters are sharded and hooked for that one only.
_PARALLELISED_BY: weakref.WeakKeyDictionary[nn.Module, UltraScaleStrategy] = weakref.WeakKeyDictionary()


class UltraScaleStrategy(LayoutCheckpoints, GuardedSteps, LayoutStatistics, WatchedRanks, ModelParallelStrategy):
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
        for plugin in plugins:
            if not isinstance(plugin, ParallelPlugin):
                raise TypeError(f"UltraScaleStrategy takes ParallelPlugin objects, got {plugin!r}")
            if plugin.applies_at not in APPLY_ORDER:
                raise TypeError(f"{plugin!r} has applies_at={plugin.applies_at!r}; valid: {', '.join(APPLY_ORDER)}")
        stages = [p.applies_at for p in plugins]
        repeated = sorted({s for s in stages if stages.count(s) > 1})
        if repeated:
            raise ConfigError(f"one plugin per technique; got several for: {', '.join(repeated)}")
        ordered = sorted(with_defaults(plugins), key=lambda p: APPLY_ORDER.index(p.applies_at))
        self.plugins: tuple[ParallelPlugin, ...] = tuple(ordered)
        runners = [p.step_runner for p in self.plugins if p.step_runner is not None]
        if len(runners) > 1:
            raise ConfigError(f"one plugin may run the step; several do: {', '.join(map(repr, self.plugins))}")
        #: How each step runs: Lightning's own step, or the one a plugin brings (e.g. a schedule).
        self.step: StepRunner = runners[0] if runners else StepRunner()
        self.seed = seed
        self.async_checkpoint = async_checkpoint
        self.guard = guard or NonFiniteGuard()
        self.tf32 = tf32
        self._parallel_dims: ParallelDims | None = None
        self._layout: Layout | None = None
        self._validated: tuple[ModelSpec, tuple[int, int, int | None] | None] | None = None

    # ----------------------------------------------------------------------------- sizes, mesh, layout
    def resolve_dims(self, world_size: int) -> ParallelDims:
        """The plugins' sizes, with the one left open inferred, validated against ``world_size``."""
        return resolve_dims(self.plugins, world_size)

    def applied_plugins(self) -> tuple[ParallelPlugin, ...]:
        """Every plugin in the order it applies: the strategy's and the precision plugin's model rewrite (FP8).

        A precision plugin takes part by offering ``parallel_plugin()`` (e.g. ``FP8Precision``'s
        module swap, which applies first); Lightning hands the strategy its precision plugin late,
        so it joins here rather than in ``__init__``.
        """
        plugins = self.plugins
        offer = getattr(self.precision_plugin, "parallel_plugin", None)
        if offer is not None:
            plugins = (*plugins, offer())  # the same object at every call: it keeps what it applied
        return tuple(sorted(plugins, key=lambda p: APPLY_ORDER.index(p.applies_at)))

    @property
    def parallel_dims(self) -> ParallelDims:
        if self._parallel_dims is None:
            raise RuntimeError("parallel dims are resolved when the Trainer is created with this strategy")
        return self._parallel_dims

    @property
    def layout(self) -> Layout:
        """The mesh and the facts the plugins share; exists once the processes are initialised."""
        if self._layout is None:
            raise RuntimeError("the layout exists once the processes are initialised (setup_environment)")
        return self._layout

    @property
    def mesh(self) -> ParallelMesh:
        return self.layout.mesh

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

    def validate(self, spec: ModelSpec, data: DataShape | None = None, world_size: int | None = None) -> None:
        """Every check that needs no process: the layout against the model and the batch shape.

        ``trainer.fit`` runs it before the process group exists; the CLI before the Trainer
        exists (with its ``world_size``); either way once per process.
        """
        if world_size is not None:
            self._parallel_dims = self.resolve_dims(world_size)
        key = (spec, data and (data.seq_len, data.micro_batch_size, data.max_token_id))
        if self._validated is not None and self._validated[0] == spec and (data is None or self._validated == key):
            return
        dims = self.parallel_dims
        dims.validate_model(spec)
        for plugin in self.applied_plugins():
            plugin.validate(dims, spec, data)
            plugin.validate_with(self.applied_plugins())
        if data is not None:
            data.validate_vocabulary(spec)
            if data.fits is not None:
                data.fits(dims.dp)
            if data.global_batch_size is not None:
                dims.grad_accumulation(data.global_batch_size, data.micro_batch_size)
        self._validated = key

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
        if self._layout is None:  # a second fit keeps the mesh and the facts of its model
            self._layout = Layout(self.parallel_dims, build_mesh(self.parallel_dims, self.root_device.type))
        self._device_mesh = self.mesh.root
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        log.info("UltraScaleStrategy: %s", self.describe())

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Samplers shard by data-parallel coordinates: tp/cp/pp peers must read the same samples.
        dp = self.mesh["dp"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

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
        adapt_in(self.lightning_module)
        model, name = find_model(self.lightning_module)
        owner = _PARALLELISED_BY.get(model)
        if owner is self:
            return model
        if owner is not None:
            raise RuntimeError(
                f"{type(model).__name__} was already parallelised by another UltraScaleStrategy; its parameters "
                "are sharded and hooked for that one. Build a new LightningModule (or reuse the same Trainer)"
            )
        self.validate(model.spec)
        check_model(model, self.lightning_module, self.applied_plugins())
        reference = init_reference(model)  # (meta: a copy costs nothing) for check_init
        # Fresh facts for this model (the mesh stays).
        self._layout = Layout(self.parallel_dims, self.mesh, self.precision_plugin.precision)
        for plugin in self.applied_plugins():
            new = plugin.apply(model, self.layout)
            if new is not model:
                if not name:
                    raise TypeError(f"{plugin!r} replaced the root module; wrap the model in a LightningModule")
                self.lightning_module.set_submodule(name, new)
                model = new
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            model.to_empty(device=self.root_device)
            model.init_weights(self.seed)  # (the contract checked it exists)
            check_init(model, reference, self.seed, collective_device())
        _PARALLELISED_BY[model] = self
        leftover = [n for n, p in self.lightning_module.named_parameters() if p.is_meta]
        if leftover:
            raise RuntimeError(f"parameters outside the parallelised model are still meta tensors: {leftover[:5]}")
        return model

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

    def wait_for_parameters(self) -> None:
        """Finish the parameter all-gathers a sharded optimizer (ZeRO-1/2) leaves in flight after its step.

        The next forward waits for each bucket where it needs it, ``state_dict()`` and the end of
        training for all; code reading parameter values in between (a callback's
        ``on_train_batch_end`` or ``on_train_end``, which run before the strategy's) calls this first.
        """
        for sync in self.layout.grad_syncs:
            sync.wait_for_parameters()

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        with self.step.backward_context():
            return super().backward(self.step.weighted(closure_loss), optimizer, *args, **kwargs)

    @override
    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()
        # Lightning clips with torch's clip_grad_norm_, which cannot mix sharded DTensor gradients
        # with replicated ones; ours counts every gradient exactly once in any layout.
        assert self.lightning_module is not None
        plugin, plan, (model, _) = self.precision_plugin, self.layout.grad_norm, find_model(self.lightning_module)
        plugin.clip_grad_by_norm = lambda optimizer, clip_val: clip_grad_norm_(  # type: ignore[method-assign]
            plugin.main_params(optimizer),
            float(clip_val),
            plan.across,
            plan.groups_of,
            uncounted=[self.layout.stepped(model.get_parameter(name)) for name in plan.skip],
        )

    def describe(self) -> str:
        """One line: the mesh and the plugins, for logs."""
        dims = self.parallel_dims
        return f"{dims.describe()} ({dims.world_size} ranks); plugins: {', '.join(map(repr, self.applied_plugins()))}"
