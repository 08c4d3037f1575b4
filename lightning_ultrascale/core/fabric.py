"""FabricStrategy: the ultrascale strategy for Lightning Fabric: the same plugins in a loop you write.

``lightning_ultrascale.UltraScaleStrategy`` is a strategy of Lightning's Trainer; Fabric takes
strategies of its own kind. This one composes the same plugins the same way (``composition.py``:
sizes resolved when Fabric is created, the plugins applied in ``APPLY_ORDER`` on the meta
device, ``init_weights(seed)`` on each rank's shards) and maps Fabric's calls onto the pieces
the Trainer's strategy uses:

=========================================  ===============================================================
Fabric                                     here
=========================================  ===============================================================
``fabric.init_module(empty_init=True)``    the model on the meta device (or pass it built whole)
``fabric.setup(model, optimizer)``         the plugins rewrite the model; the optimizer is pointed at the
                                           new parameters by name; the gradient syncs bind and attach
``L.Fabric(plugins=[FP8Precision()])``     its FP8 swap applies first, with the other plugins
``model(...)``                             the Layout's step contexts (loss parallel) around the forward
``fabric.setup_dataloaders``               each batch becomes this rank's part (context parallelism)
``fabric.backward(loss)``                  the step runner's token weight and backward contexts
``fabric.no_backward_sync``                the gradient syncs hold reductions back (accumulation)
``optimizer.step()``                       first, gradients become the mean over every labelled token
``fabric.clip_gradients(max_norm=...)``    the global norm, each gradient counted once in any layout
``fabric.clip_gradients(clip_val=...)``    element-wise on each rank's pieces, partial sums reduced first
``fabric.save`` / ``fabric.load``          the any-layout checkpoint the Trainer writes (``checkpoint.py``)
=========================================  ===============================================================

Pipeline parallelism is refused: its schedule runs forward and backward itself, which a loop
written around ``model(...)`` and ``fabric.backward`` cannot hand it; the Trainer runs it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import Precision
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
from lightning.fabric.strategies.strategy import Strategy, _BackwardSyncControl, _validate_keys_for_strict_loading
from lightning.fabric.utilities.load import _METADATA_FILENAME, _move_state_into
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_ultrascale.core.checkpoint import (
    ACCUMULATION_KEY,
    TRAIN_DATA_KEY,
    begin_save,
    check_checkpoint_path,
    checkpoint_location,
    data_positions,
    load_layout_state,
    named_optimizer_state,
    publish_save,
    with_masters,
)
from lightning_ultrascale.core.checkpoint_io import check_weights_only, load, to_data
from lightning_ultrascale.core.composition import PluginComposition
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.spec import find_model
from lightning_ultrascale.parallel.plugin import ParallelPlugin
from lightning_ultrascale.parallel.step import StepRunner, settle_gradients
from lightning_ultrascale.utils.grad import clip_grad_value_


class FabricStrategy(PluginComposition, ModelParallelStrategy):
    """Train with the Ultra-Scale Playbook's parallelism plugins under Lightning Fabric.

    Takes the plugins :class:`lightning_ultrascale.UltraScaleStrategy` takes, but
    ``PipelineParallel`` (the Trainer runs pipeline schedules). Build the model under
    ``fabric.init_module(empty_init=True)`` (the meta device: each rank allocates only its part)
    or pass it whole; it must declare a :class:`~lightning_ultrascale.models.spec.ModelSpec` (our
    ``Llama`` does), itself or a submodule of the module given to ``fabric.setup``.

    Args:
        *plugins: parallelism plugins, e.g. ``ZeRO(stage=3)``, ``TensorParallel(2)``.
        seed: seed of the per-parameter weight initialisation of a model built on the meta device.
        process_group_backend: ``"nccl"`` / ``"gloo"``; default: by device.
        timeout: timeout of every collective.

    Attributes:
        global_step: optimizer steps taken (saved in checkpoints, restored by ``fabric.load``).
        accumulate: backward passes per optimizer step, as the last step counted them.

    Example:
        >>> import lightning as L
        >>> from lightning_ultrascale import ZeRO
        >>> from lightning_ultrascale import FabricStrategy
        >>> from lightning_ultrascale.models import get_model_config
        >>> from lightning_ultrascale.models.common.decoder import Llama
        >>> fabric = L.Fabric(strategy=FabricStrategy(ZeRO(stage=3)), accelerator="cpu", devices=2)
        >>> fabric.launch()  # doctest: +SKIP
        >>> with fabric.init_module(empty_init=True):  # doctest: +SKIP
        ...     model = Llama(get_model_config("llama_tiny"))
        >>> model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))  # doctest: +SKIP
    """

    def __init__(
        self,
        *plugins: ParallelPlugin,
        seed: int = 0,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=10),
    ) -> None:
        # Lightning's parallelize_fn is not used: setup_module applies the plugins.
        super().__init__(lambda module, mesh: module, process_group_backend=process_group_backend, timeout=timeout)
        self.compose(plugins, seed)
        for plugin in self.plugins:
            if plugin.step_runner is not None:
                raise ConfigError(
                    f"{plugin!r} runs forward and backward itself (a pipeline schedule), which a Fabric loop around "
                    "model(...) and fabric.backward(...) cannot hand it; run pipeline schedules with the Trainer: "
                    f"lightning.Trainer(strategy=lightning_ultrascale.UltraScaleStrategy({plugin!r}, ...))"
                )
        self._backward_sync_control = _SyncControl(self.step)
        self.global_step = 0
        self.accumulate = 1
        self._backwards = 0
        self._hooks: list[Any] = []
        self._forwards: list[contextlib.ExitStack] = []
        self._batches_split = 0

    @override
    def active_precision(self) -> Any:
        return self.precision.plugin if isinstance(self.precision, TrainerPrecision) else self.precision

    @property
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        # A Trainer precision plugin (FP8Precision) given to L.Fabric(plugins=[...]) takes Fabric's interface.
        self._precision = TrainerPrecision(precision) if isinstance(precision, pl.plugins.Precision) else precision

    @override
    def _configure_launcher(self) -> None:
        # Fabric calls this when it is created, devices and nodes known: sizes fail here, before any process.
        self._parallel_dims = self.resolve_dims(self.world_size)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        Strategy.setup_environment(self)  # (not Lightning's 2-D mesh: ours)
        self._setup_distributed()
        self.build_layout(self.root_device.type)
        self._device_mesh = self.mesh.root

    # ----------------------------------------------------------------------------- model and optimizers
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        model = self.parallelize_module(module, self.root_device)
        for sync in self.layout.grad_syncs:
            sync.bind(model)
        self.step.bind(self.layout)
        self._watch(model)
        if isinstance(self.precision, TrainerPrecision):
            self.precision.model = module
        return module

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        # The plugins replace parameters (meta tensors, FSDP2 and TP DTensors): the optimizers
        # built on the model before find theirs again by name.
        names = {p: name for name, p in module.named_parameters()}
        module = self.setup_module(module)
        params = dict(module.named_parameters())
        for optimizer in optimizers:
            _point_at(optimizer, names, params)
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        for sync in self.layout.grad_syncs:
            sync.attach([optimizer])
        return optimizer

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        return LayoutBatches(dataloader, self)

    def _watch(self, model: nn.Module) -> None:
        """Run the model's forward in the Layout's step contexts and note its labels for the token weight."""
        for handle in self._hooks:
            handle.remove()
        signature = inspect.signature(model.forward)

        def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.layout.batch_transforms and not self._batches_split:
                raise ConfigError(
                    f"{self.describe()}: each batch must become this rank's part before the model sees it; "
                    "iterate a dataloader set up with fabric.setup_dataloaders(...), which does that"
                )
            labels = signature.bind_partial(*args, **kwargs).arguments.get("labels")
            if torch.is_grad_enabled() and isinstance(labels, torch.Tensor):
                self.step.weigh({"labels": labels})
            stack = contextlib.ExitStack()
            stack.enter_context(self.layout.step_context())
            self._forwards.append(stack)

        def after(module: nn.Module, args: tuple, output: Any) -> Any:
            self._forwards.pop().close()
            return output

        self._hooks = [
            model.register_forward_pre_hook(before, with_kwargs=True),
            model.register_forward_hook(after, always_call=True),
        ]

    def loss_context(self) -> contextlib.AbstractContextManager[None]:
        """The contexts the model's forward runs in, for a loss computed outside the model from its outputs:
        under tensor parallelism the logits are vocabulary-sharded DTensors, and the cross-entropy runs
        under ``loss_parallel`` (``fabric.backward`` enters it again for the backward).

        Example:
            >>> logits = model(input_ids=batch["input_ids"]).logits  # doctest: +SKIP
            >>> with fabric.strategy.loss_context():  # doctest: +SKIP
            ...     loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        """
        return self.layout.step_context()

    # ----------------------------------------------------------------------------- step
    @override
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self._backwards += 1
        with self.step.backward_context():
            super().backward(self.step.weighted(tensor), module, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self.accumulate, self._backwards = max(self._backwards, 1), 0
        settle_gradients(_params_of(optimizer))
        self.step.finish_step(optimizer, self.accumulate)  # exact token weighting
        output = super().optimizer_step(optimizer, **kwargs)
        self.global_step += 1
        return output

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        if float(norm_type) != 2.0:
            raise ConfigError(
                f"fabric.clip_gradients(norm_type={norm_type!r}): FabricStrategy clips by the global L2 norm, "
                "each gradient counted once in any layout; valid: 2.0"
            )
        self.precision.unscale_gradients(optimizer)
        settle_gradients(_params_of(optimizer))
        model, _ = find_model(module)
        norm = self.clip_grad_norm(model, self.precision.main_params(optimizer), float(max_norm))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of the gradients is {float(norm)}: not finite")
        return norm

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        settle_gradients(_params_of(optimizer))
        clip_grad_value_(self.precision.main_params(optimizer), float(clip_val))

    # ----------------------------------------------------------------------------- checkpoints
    @override
    def save_checkpoint(
        self, path: _PATH, state: dict[str, Any], storage_options: Any | None = None, filter: Any | None = None
    ) -> None:
        """Save ``state`` as the Trainer's strategy saves its checkpoints: any layout, Trainer or Fabric, loads it.

        The model and the optimizers go to DCP by parameter name (``checkpoint.py``); the LR
        schedulers, resumable data loaders' positions, :attr:`global_step` and every other entry
        to ``meta.pt``. Published once every rank has written (a crash leaves the previous one).
        """
        from torch.distributed.checkpoint import save as dcp_save
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if storage_options is not None or filter is not None:
            raise ConfigError("fabric.save(filter=..., storage_options=...): not supported; each rank saves its shards")
        where = Path(self.broadcast(path))
        parts = _sort_state(state, self)
        self.wait_for_parameters()
        syncs, model = self.layout.grad_syncs, parts.module
        weights = get_model_state_dict(model, options=StateDictOptions(cpu_offload=True))
        tensors = {"state_dict": with_masters(weights, model, syncs)}
        for i, optimizer in enumerate(parts.optimizers.values()):
            tensors[f"optimizer_{i}"] = named_optimizer_state(model, optimizer, syncs)
        meta = {k: v.state_dict() if isinstance(v, _Stateful) else v for k, v in parts.other.items()}
        meta["lr_schedulers"] = [scheduler.state_dict() for scheduler in parts.schedulers.values()]
        meta[TRAIN_DATA_KEY] = [loader.state_dict() for loader in parts.loaders.values()]
        meta.setdefault("global_step", self.global_step)
        meta[ACCUMULATION_KEY] = self.accumulate
        to_data(meta, where)
        partial = begin_save(where, self.global_rank, self.barrier)
        dcp_save(tensors, checkpoint_id=partial)
        publish_save(meta, partial, where, self.global_rank, self.barrier)

    @override
    def load_checkpoint(
        self, path: _PATH, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore ``state`` in place from a checkpoint of any layout, saved by Fabric or by the Trainer.

        Returns the checkpoint's entries ``state`` did not ask for (a Trainer's: ``global_step``,
        its loops, hyperparameters). The files are read as data only (:mod:`~lightning_ultrascale.core.checkpoint_io`),
        and ``weights_only`` set false is refused.
        """
        if not isinstance(state, dict):
            raise ConfigError(
                "fabric.load(path, state): give the state to restore in place, a dict holding the model fabric.setup "
                f"set up (e.g. {{'model': model, 'optimizer': optimizer}}), got {type(state).__name__}"
            )
        path = self.broadcast(path)
        check_weights_only(weights_only, f"fabric.load(path={path})")
        check_checkpoint_path(path, "path")
        where = checkpoint_location(path)
        if not _is_sharded_checkpoint(where):
            raise ConfigError(
                f"fabric.load(path={path}) is a single-file checkpoint; FabricStrategy loads the DCP directories "
                "every layout writes (the Trainer's with save_distributed_checkpoint=True, the default)"
            )
        parts = _sort_state(state, self)
        self.wait_for_parameters()
        optimizers = list(parts.optimizers.values())
        load_layout_state(where, parts.module, optimizers, self.layout.grad_syncs, strict)
        meta = load(where / _METADATA_FILENAME, map_location=None)
        parts.restore(meta, state, strict)
        self.global_step = int(meta.get("global_step", 0))
        return meta


def _params_of(optimizer: Optimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _point_at(optimizer: Optimizer, names: dict[nn.Parameter, str], params: dict[str, nn.Parameter]) -> None:
    """Make ``optimizer`` step ``params`` in place of the parameters it was built with (by name)."""
    if optimizer.state:
        raise ConfigError(
            "fabric.setup(model, optimizer) got an optimizer that has stepped already; its state belongs to the "
            "parameters the plugins replace: set the optimizer up before its first step"
        )
    for group in optimizer.param_groups:
        unknown = [tuple(p.shape) for p in group["params"] if p not in names]
        if unknown:
            raise ConfigError(
                f"the optimizer holds tensors of shapes {unknown[:3]} that are no parameters of the model given to "
                "fabric.setup; build it on model.parameters()"
            )
        group["params"] = [params[names[p]] for p in group["params"]]


class TrainerPrecision(Precision):
    """A Trainer precision plugin (``FP8Precision``) in Fabric's interface: ``L.Fabric(plugins=[FP8Precision()])``.

    Its forward context, its model rewrite (``parallel_plugin``, which the strategy applies in
    order with the others, hence no ``convert_module`` here) and its work after each step are the
    plugin's; backward and the optimizer step are Fabric's (the Trainer's run LightningModule hooks).
    """

    def __init__(self, plugin: pl.plugins.Precision) -> None:
        self.plugin = plugin
        self.precision = plugin.precision
        #: The module set up (``after_step`` reads its FP8 weights).
        self.model: nn.Module | None = None

    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.plugin.forward_context()

    @override
    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.plugin.module_init_context()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = optimizer.step(**kwargs)
        after_step = getattr(self.plugin, "after_step", None)
        if after_step is not None and self.model is not None:
            after_step(self.model)
        return output


class _SyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync``: the gradient syncs hold their reductions back (accumulation micro-steps)."""

    def __init__(self, step: StepRunner) -> None:
        self.step = step

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return self.step.no_sync() if enabled else contextlib.nullcontext()


class LayoutBatches:
    """A dataloader whose batches are this rank's part of what its data-parallel group reads.

    The Layout's batch transforms (context parallelism keeps this rank's tokens, labels and
    positions) apply to every batch, as the Trainer's step runner applies them; everything else
    (``len``, ``sampler``, a resumable loader's ``state_dict``) is the loader's.
    """

    def __init__(self, loader: Any, strategy: FabricStrategy) -> None:
        self.loader = loader
        self._strategy = strategy

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            self._strategy._batches_split += 1
            yield self._strategy.layout.transform_batch(batch)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if "loader" not in self.__dict__:  # (being copied or unpickled)
            raise AttributeError(name)
        return getattr(self.__dict__["loader"], name)


@dataclass
class _StateParts:
    """What a checkpoint does with each entry of the state ``fabric.save`` / ``fabric.load`` get, by its type."""

    module: nn.Module
    optimizers: dict[str, Optimizer] = field(default_factory=dict)
    schedulers: dict[str, LRScheduler] = field(default_factory=dict)
    loaders: dict[str, Any] = field(default_factory=dict)
    other: dict[str, Any] = field(default_factory=dict)

    def restore(self, meta: dict[str, Any], state: dict[str, Any], strict: bool) -> None:
        """Give the schedulers, loaders and other entries their saved values (``meta`` keeps what is left)."""
        schedules, positions = meta.pop("lr_schedulers", []), data_positions(meta) or []
        meta.pop(TRAIN_DATA_KEY, None)
        for what, wanted, saved in (
            ("LR scheduler", self.schedulers, schedules),
            ("data loader", self.loaders, positions),
        ):
            if strict and len(saved) < len(wanted):
                raise ConfigError(
                    f"the checkpoint holds {len(saved)} {what} state(s) and the state to restore has {len(wanted)} "
                    f"({', '.join(wanted)}); drop them from the state, or load with strict=False"
                )
            for target, value in zip(wanted.values(), saved):
                target.load_state_dict(value)
        _validate_keys_for_strict_loading(self.other.keys(), meta.keys(), strict=strict)
        _move_state_into(source=meta, destination=state, keys=set(self.other))


def _sort_state(state: Mapping[str, Any], strategy: FabricStrategy) -> _StateParts:
    """``state``'s entries by what a checkpoint does with them; the one model must be set up by ``strategy``."""
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    if len(modules) != 1 or not strategy.parallelised(next(iter(modules.values()))):
        raise ConfigError(
            f"the state of fabric.save/fabric.load holds {len(modules)} module(s) ({', '.join(modules) or 'none'}); "
            "give it the one model fabric.setup set up with this strategy (e.g. {'model': model, ...})"
        )
    parts = _StateParts(next(iter(modules.values())))
    for key, value in state.items():
        loader = value.loader if isinstance(value, LayoutBatches) else value
        if isinstance(value, Optimizer):
            parts.optimizers[key] = value
        elif isinstance(value, LRScheduler):
            parts.schedulers[key] = value
        elif isinstance(loader, DataLoader):
            if not isinstance(loader, _Stateful):
                raise ConfigError(
                    f"state[{key!r}] is a data loader without state_dict/load_state_dict: its position cannot be "
                    "saved; use a resumable one (lightning_ultrascale.data.sampler.ResumableDataLoader) or leave it out"
                )
            parts.loaders[key] = loader
        elif key not in modules:
            parts.other[key] = value
    return parts


#: The name this class had before it was exported as ``FabricStrategy`` (kept: code that imported it by that name).
UltraScaleStrategy = FabricStrategy
