"""UltraScaleStrategy: one Lightning strategy that composes the playbook's parallelism plugins.

The strategy owns the run's mesh, the fixed order in which plugins rewrite the model, and the
training step; each plugin owns one technique (see ``parallel/plugin.py``). Lightning's
``ModelParallelStrategy`` provides process-group setup, launchers and sharded (DCP) checkpoints;
this class replaces its 2-D mesh with the ``(pp, dp_replicate, dp_shard, cp, tp)`` mesh and its
user-written ``configure_model`` parallelisation with the plugins.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Generator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.spec import ModelSpec, SpecifiedModel
from lightning_ultrascale.parallel.data import DataParallel
from lightning_ultrascale.parallel.dims import ParallelDims
from lightning_ultrascale.parallel.mesh import ParallelMesh, build_mesh
from lightning_ultrascale.parallel.plugin import APPLY_ORDER, ParallelPlugin
from lightning_ultrascale.utils.grad import clip_grad_norm_
from lightning_ultrascale.utils.loss import token_weight
from lightning_ultrascale.utils.memory import ModelStateBytes

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

_APPLIED = "_ultrascale_applied"


class UltraScaleStrategy(ModelParallelStrategy):
    """Train with any composition of the Ultra-Scale Playbook's parallelism techniques.

    Plugins may be listed in any order; they are applied in the fixed order of
    :data:`~lightning_ultrascale.parallel.plugin.APPLY_ORDER`. Without a data-parallel plugin,
    :class:`~lightning_ultrascale.parallel.data.DataParallel` takes the ranks left over.
    At most one plugin may leave its size unset (it is inferred from the world size).

    The LightningModule must hold a model that declares a
    :class:`~lightning_ultrascale.models.spec.ModelSpec` (our ``Llama`` does) and build it in
    ``configure_model``: the strategy builds it on the meta device, applies the plugins, then
    materialises it and calls ``init_weights(seed)``, so every layout starts from the weights a
    single-process run would have.

    Args:
        *plugins: parallelism plugins, e.g. ``DataParallel()``.
        seed: seed of the per-parameter weight initialisation.
        save_distributed_checkpoint: save sharded (DCP) checkpoints, one file per rank (default),
            or a single full checkpoint assembled on rank 0.
        process_group_backend: ``"nccl"`` / ``"gloo"``; default: by device.
        timeout: timeout of every collective: a hung rank fails the job after this long.

    Example:
        >>> import lightning as L
        >>> from lightning_ultrascale import UltraScaleStrategy, DataParallel
        >>> strategy = UltraScaleStrategy(DataParallel(bucket_mb=25))
        >>> trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2)  # doctest: +SKIP
    """

    strategy_name = "ultrascale"

    def __init__(
        self,
        *plugins: ParallelPlugin,
        seed: int = 0,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=10),
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
        if "data" not in stages:
            plugins = (*plugins, DataParallel())
        self.plugins: tuple[ParallelPlugin, ...] = tuple(sorted(plugins, key=lambda p: APPLY_ORDER.index(p.applies_at)))
        self.seed = seed
        self._parallel_dims: ParallelDims | None = None
        self._mesh: ParallelMesh | None = None

    @property
    def step_runner(self) -> ParallelPlugin | None:
        """The plugin that runs forward and backward itself (pipeline parallelism), if any."""
        return next((p for p in self.plugins if p.runs_step), None)

    # ----------------------------------------------------------------------------- sizes & mesh
    def resolve_dims(self, world_size: int) -> ParallelDims:
        """The plugins' sizes, with the one left open inferred, validated against ``world_size``."""
        sizes: dict[str, int] = {}
        open_dims: list[str] = []
        for plugin in self.plugins:
            for dim, size in plugin.mesh_sizes().items():
                if size is None:
                    open_dims.append(dim)
                else:
                    sizes[dim] = size
        if len(open_dims) > 1:
            raise ConfigError(
                f"only one parallel size can be inferred, but {', '.join(open_dims)} are all unset; "
                "give all but one of them a size"
            )
        dims = ParallelDims.infer(world_size, open_dims[0] if open_dims else None, **sizes)
        dims.validate(world_size)
        return dims

    @property
    def parallel_dims(self) -> ParallelDims:
        if self._parallel_dims is None:
            raise RuntimeError("parallel dims are resolved when the Trainer is created with this strategy")
        return self._parallel_dims

    @property
    def mesh(self) -> ParallelMesh:
        """The run's mesh with its named and flattened (``dp``, ``dp_cp``) dims."""
        if self._mesh is None:
            raise RuntimeError("the mesh exists once the processes are initialised (setup_environment)")
        return self._mesh

    @override
    def _configure_launcher(self) -> None:
        # Lightning calls this while building the Trainer, once devices and nodes are known: the
        # earliest point at which the world size is, and long before any process group exists.
        self._parallel_dims = self.resolve_dims(self.world_size)
        if self.step_runner is not None and not self._save_distributed_checkpoint:
            raise ConfigError(
                f"{self.step_runner!r} keeps each stage's parameters on its own ranks; save sharded checkpoints "
                "with UltraScaleStrategy(save_distributed_checkpoint=True), the default"
            )
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        spec = self._declared_spec()
        if spec is not None:
            self._validate_model(spec)  # still before any process group
        self._setup_distributed()
        self._mesh = build_mesh(self.parallel_dims, self.root_device.type)
        self._device_mesh = self._mesh.root
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        log.info("UltraScaleStrategy: %s", self.describe())

    def _declared_spec(self) -> ModelSpec | None:
        """A spec the LightningModule declares before its model exists (``model_spec``), if any."""
        spec = getattr(self.lightning_module, "model_spec", None)
        return spec if isinstance(spec, ModelSpec) else None

    def _validate_model(self, spec: ModelSpec) -> None:
        self.parallel_dims.validate_model(spec)
        for plugin in self.plugins:
            plugin.validate(self.parallel_dims, spec)

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

    def _find_model(self) -> tuple[nn.Module, str]:
        """The outermost module that declares a ModelSpec, and its name in the LightningModule."""
        assert self.lightning_module is not None
        for name, module in self.lightning_module.named_modules():
            if isinstance(getattr(module, "spec", None), ModelSpec):
                return module, name
        raise TypeError(
            f"{type(self.lightning_module).__name__} holds no model with a `spec: ModelSpec`; "
            "UltraScaleStrategy parallelises models that declare one (e.g. lightning_ultrascale.models.Llama, "
            "built in LightningModule.configure_model)"
        )

    def _replace(self, name: str, new: nn.Module) -> None:
        assert self.lightning_module is not None
        parent_name, _, attr = name.rpartition(".")
        parent = self.lightning_module.get_submodule(parent_name) if parent_name else self.lightning_module
        setattr(parent, attr, new)

    def parallelize(self) -> nn.Module:
        """Apply every plugin in order, then materialise and initialise the weights (idempotent).

        Plugins bind to the materialised parameters (:meth:`ParallelPlugin.on_materialized`) in
        :meth:`setup`, after the precision plugin's conversion and the move to the device.
        """
        model, name = self._find_model()
        applied_by = getattr(model, _APPLIED, None)
        if applied_by is self:
            return model
        if applied_by is not None:
            raise RuntimeError(
                f"{type(model).__name__} was already parallelised by another UltraScaleStrategy; its parameters "
                "are sharded and hooked for that one. Build a new LightningModule (or reuse the same Trainer)"
            )
        self._validate_model(model.spec)
        for plugin in self.plugins:
            plugin.set_precision(self.precision_plugin.precision)
            new = plugin.apply(model, self.mesh)
            if new is not model:
                if not name:
                    raise TypeError(f"{plugin!r} replaced the root module; wrap the model in a LightningModule")
                self._replace(name, new)
                model = new
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            model.to_empty(device=self.root_device)
            if not isinstance(model, SpecifiedModel):
                raise TypeError(f"{type(model).__name__} needs init_weights(seed) to be built on the meta device")
            model.init_weights(self.seed)
        setattr(model, _APPLIED, self)
        assert self.lightning_module is not None
        leftover = [n for n, p in self.lightning_module.named_parameters() if p.is_meta]
        if leftover:
            raise RuntimeError(
                f"parameters outside the parallelised model are still on the meta device: {leftover[:5]}"
            )
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
        for plugin in self.plugins:
            plugin.on_materialized(model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            for plugin in self.plugins:
                plugin.setup_optimizers(self.optimizers)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    # ----------------------------------------------------------------------------- step
    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        # Lightning enters this on non-final gradient-accumulation micro-steps.
        with contextlib.ExitStack() as stack:
            for plugin in self.plugins:
                stack.enter_context(plugin.no_sync())
            yield

    # ----------------------------------------------------------------------------- checkpoints
    def _sharded_optimizer_state(self, optimizer: Optimizer) -> tuple[ParallelPlugin, dict[str, Any]] | None:
        for plugin in self.plugins:
            state = plugin.optimizer_state_dict(optimizer)
            if state is not None:
                return plugin, state
        return None

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        sharded = self._sharded_optimizer_state(inner)
        if sharded is None:
            if self.step_runner is None:
                return super().optimizer_state(optimizer)
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            assert self.model is not None
            return get_optimizer_state_dict(self.model, inner, options=self._optimizer_state_options())
        if not self._save_distributed_checkpoint:
            raise ConfigError(
                f"{sharded[0]!r} keeps optimizer states sharded across ranks; save them with "
                "UltraScaleStrategy(save_distributed_checkpoint=True), the default"
            )
        return sharded[1]

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint of any layout's model: sharded (DCP) or full, DTensor parameters or not.

        Lightning's own loader insists on DTensor parameters, which data-parallel stages 0-2 do not
        have; and sharded optimizers (ZeRO-1/2) keep states that only their plugin can map.
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
            key = f"optimizer_{idx}"
            sharded = self._sharded_optimizer_state(optimizer)
            options = self._optimizer_state_options()
            template = (
                sharded[1] if sharded is not None else get_optimizer_state_dict(self.model, optimizer, options=options)
            )
            state = {key: template}
            dcp_load(state, checkpoint_id=path)
            if sharded is not None:
                sharded[0].load_optimizer_state_dict(optimizer, state[key])
            else:
                set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state[key], options=options)
        # Loops, schedulers, callbacks and the datamodule restore themselves from the rest.
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)

    def _optimizer_state_options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # Pipeline stages hold different parameters: nested param_groups lists would be one DCP
        # entry with a different value per stage; flattened, every entry is keyed by its parameter.
        return StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=self.step_runner is not None)

    def reduced_gradients(self) -> dict[nn.Parameter, torch.Tensor] | None:
        """Averaged gradients where a plugin keeps them away from ``param.grad`` (ZeRO-1/2), else None."""
        for plugin in self.plugins:
            grads = plugin.reduced_gradients()
            if grads is not None:
                return grads
        return None

    def expected_model_state_bytes(self, n_params: int, k_optimizer: int) -> ModelStateBytes | None:
        """The playbook's per-rank model state for this layout, from the data-parallel plugin."""
        for plugin in self.plugins:
            expected = plugin.expected_state_bytes(n_params, k_optimizer)
            if expected is not None:
                return expected
        return None

    @contextlib.contextmanager
    def _step_context(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for plugin in self.plugins:
                stack.enter_context(plugin.step_context())
            yield

    def _shard_batch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Each plugin's part of the batch (context parallelism keeps this rank's tokens)."""
        for plugin in self.plugins:
            if "batch" in kwargs:
                kwargs = {**kwargs, "batch": plugin.shard_batch(kwargs["batch"])}
            elif args:
                args = (plugin.shard_batch(args[0]), *args[1:])
        return args, kwargs

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._shard_batch(args, kwargs)
        runner = self.step_runner
        if runner is None:
            with self._step_context():
                output = super().training_step(*args, **kwargs)
            weight = self._token_weight(_batch_and_index(args, kwargs)[0])
            if weight is not None:
                if isinstance(output, torch.Tensor):
                    output = output * weight.to(output.dtype)
                elif isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
                    output = {**output, "loss": output["loss"] * weight.to(output["loss"].dtype)}
            return output
        return self._run_pipelined_step(runner, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._shard_batch(args, kwargs)
        runner = self.step_runner
        with self._step_context():
            if runner is None:
                return super().validation_step(*args, **kwargs)
            batch, batch_idx = _batch_and_index(args, kwargs)
            module = self.lightning_module
            loss = runner.run_step(module, batch, train=False)
            _pipeline_step_end(module, loss, batch, batch_idx, "val")
            return loss

    def _token_weight(self, batch: Any) -> torch.Tensor | None:
        """This rank's share of the labelled tokens of the ``dp x cp`` ranks (1.0 when all hold as many).

        Gradients are averaged over those ranks; weighting each rank's mean loss by its share makes
        the average the mean over every labelled token (``utils/loss.py``).
        """
        group = self.mesh["dp_cp"]
        if group.size() == 1 or not isinstance(batch, dict) or not isinstance(batch.get("labels"), torch.Tensor):
            return None
        return token_weight(batch["labels"], group.get_group())

    def _run_pipelined_step(self, runner: ParallelPlugin, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One micro-step whose forward and backward ``runner`` runs (a pipeline schedule).

        Lightning's own backward and zero_grad are skipped (see :meth:`on_train_start`): this
        zeroes gradients at the first micro-step of an optimizer step, keeps every data-parallel
        reduction back while the schedule runs its many backwards, and reduces once after the last
        micro-step.
        """
        trainer = self.lightning_module.trainer
        module = self.lightning_module
        batch, batch_idx = _batch_and_index(args, kwargs)
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:
            for optimizer in self.optimizers:
                module.optimizer_zero_grad(trainer.current_epoch, batch_idx, optimizer)
        weight = self._token_weight(batch)
        scale = weight if weight is not None else 1.0
        with self._step_context(), self.block_backward_sync():
            loss = runner.run_step(module, batch, train=True, accumulate=accumulate, loss_scale=scale)
        if not trainer.fit_loop._should_accumulate():
            for plugin in self.plugins:
                plugin.sync_gradients()
        _pipeline_step_end(module, loss, batch, batch_idx, "train")
        return loss

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.step_runner is not None:
            module = self.lightning_module
            if not module.automatic_optimization:
                raise ConfigError(
                    f"{self.step_runner!r} runs forward and backward itself; it needs automatic optimisation "
                    f"(set {type(module).__name__}.automatic_optimization = True)"
                )
            # The schedule has run backward inside training_step; Lightning must neither zero the
            # gradients after it nor run a backward of its own (the flag its SWA callback uses).
            module.trainer.fit_loop._skip_backward = True

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Any:
        with self._step_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()
        # Lightning clips with torch's clip_grad_norm_, which cannot mix tensor-parallel shards
        # with replicated gradients; ours counts every gradient exactly once in any layout.
        plugin = self.precision_plugin
        across = tuple(g for p in self.plugins for g in p.grad_norm_groups())
        plugin.clip_grad_by_norm = lambda optimizer, clip_val: clip_grad_norm_(  # type: ignore[method-assign]
            plugin.main_params(optimizer), float(clip_val), across
        )

    def describe(self) -> str:
        """One line: the mesh and the plugins, for logs."""
        dims = self.parallel_dims
        return f"{dims.describe()} ({dims.world_size} ranks); plugins: {', '.join(map(repr, self.plugins))}"


def _batch_and_index(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int]:
    batch = kwargs.get("batch", args[0] if args else None)
    batch_idx = kwargs.get("batch_idx", args[1] if len(args) > 1 else 0)
    return batch, int(batch_idx)


def _pipeline_step_end(module: Any, loss: torch.Tensor, batch: Any, batch_idx: int, split: str) -> None:
    hook = getattr(module, "pipeline_step_end", None)
    if hook is not None:
        hook(loss, batch, batch_idx, split)
