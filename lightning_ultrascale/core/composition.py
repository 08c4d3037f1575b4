"""What the Trainer's and Fabric's ``UltraScaleStrategy`` share: the plugins composed, and the model they rewrite.

Both strategies hold the plugins in :data:`~lightning_ultrascale.parallel.plugin.APPLY_ORDER`,
resolve their sizes from the world size before any process group exists, own one mesh and the
:class:`~lightning_ultrascale.parallel.layout.Layout`, validate against the model and the batch
shape, and rewrite a model the same way (:meth:`PluginComposition.parallelize_module`): apply
every plugin on the meta device, then materialise each rank's part and call ``init_weights(seed)``,
so every layout starts from the weights one process would have. Only Lightning's hooks around
this differ (``strategy.py``, ``fabric.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.contract import check_init, check_model, init_reference
from lightning_ultrascale.models.hf.adapter import adapt_in
from lightning_ultrascale.models.spec import ModelSpec, find_model
from lightning_ultrascale.parallel.defaults import with_defaults
from lightning_ultrascale.parallel.dims import DataShape, ParallelDims
from lightning_ultrascale.parallel.layout import Layout
from lightning_ultrascale.parallel.mesh import ParallelMesh, build_mesh
from lightning_ultrascale.parallel.plugin import APPLY_ORDER, ParallelPlugin, resolve_dims
from lightning_ultrascale.parallel.step import StepRunner
from lightning_ultrascale.parallel.tied import equalise, find_parameter, find_tied, retie
from lightning_ultrascale.utils.comm import collective_device
from lightning_ultrascale.utils.grad import clip_grad_norm_

#: Which strategy parallelised a model: its parameters are sharded and hooked for that one only. The value is a
#: weak reference: a strong one would keep the key alive through the strategy (which holds the LightningModule),
#: and every model fitted in a process, with its optimizer state, would stay in memory until the process ends.
_PARALLELISED_BY: weakref.WeakKeyDictionary[nn.Module, weakref.ref[PluginComposition]] = weakref.WeakKeyDictionary()


def order_plugins(plugins: Sequence[ParallelPlugin]) -> tuple[tuple[ParallelPlugin, ...], StepRunner]:
    """The plugins (defaults added) in :data:`APPLY_ORDER`, and the runner of their steps.

    Example:
        >>> from lightning_ultrascale import TensorParallel, ZeRO
        >>> order_plugins([ZeRO(stage=3), TensorParallel(2)])[0]
        (TensorParallel(tp=2), ZeRO(stage=3, dp_replicate=1, dp_shard=None))
    """
    for plugin in plugins:
        if not isinstance(plugin, ParallelPlugin):
            raise TypeError(f"UltraScaleStrategy takes ParallelPlugin objects, got {plugin!r}")
        if plugin.applies_at not in APPLY_ORDER:
            raise TypeError(f"{plugin!r} has applies_at={plugin.applies_at!r}; valid: {', '.join(APPLY_ORDER)}")
    stages = [p.applies_at for p in plugins]
    repeated = sorted({s for s in stages if stages.count(s) > 1})
    if repeated:
        raise ConfigError(f"one plugin per technique; got several for: {', '.join(repeated)}")
    ordered = tuple(sorted(with_defaults(plugins), key=lambda p: APPLY_ORDER.index(p.applies_at)))
    runners = [p.step_runner for p in ordered if p.step_runner is not None]
    if len(runners) > 1:
        raise ConfigError(f"one plugin may run the step; several do: {', '.join(map(repr, ordered))}")
    return ordered, runners[0] if runners else StepRunner()


class PluginComposition:
    """The plugins in their fixed order, their sizes, the mesh and Layout, and the rewrite of a model.

    A mixin of both strategies; each calls :meth:`compose` in its ``__init__`` and names its
    precision plugin (:meth:`active_precision`).
    """

    plugins: tuple[ParallelPlugin, ...]
    #: How each step runs: Lightning's own step, or the one a plugin brings (e.g. a schedule).
    step: StepRunner
    seed: int
    _parallel_dims: ParallelDims | None = None
    _layout: Layout | None = None
    _validated: tuple[ModelSpec, tuple[int, int, int | None] | None] | None = None

    def compose(self, plugins: Sequence[ParallelPlugin], seed: int) -> None:
        """Hold ``plugins`` in their order; ``seed`` seeds the per-parameter weight initialisation."""
        self.plugins, self.step = order_plugins(plugins)
        self.seed = seed

    def active_precision(self) -> Any:
        """The precision plugin Lightning handed this strategy (its ``precision`` names the setting)."""
        raise NotImplementedError

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
        offer = getattr(self.active_precision(), "parallel_plugin", None)
        if offer is not None:
            plugins = (*plugins, offer())  # the same object at every call: it keeps what it applied
        return tuple(sorted(plugins, key=lambda p: APPLY_ORDER.index(p.applies_at)))

    @property
    def parallel_dims(self) -> ParallelDims:
        if self._parallel_dims is None:
            raise RuntimeError("parallel dims are resolved when the Trainer (or Fabric) is created with this strategy")
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

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Samplers shard by data-parallel coordinates: tp/cp/pp peers must read the same samples.
        dp = self.mesh["dp"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    def build_layout(self, device_type: str) -> None:
        """The mesh, once the process group exists (a second fit keeps the mesh and its model's facts)."""
        if self._layout is None:
            self._layout = Layout(self.parallel_dims, build_mesh(self.parallel_dims, device_type))

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

    def parallelize_module(self, root: nn.Module, device: torch.device) -> nn.Module:
        """Apply every plugin in order to the model ``root`` holds (or is), then materialise and initialise it.

        Returns that model (the outermost module declaring a ``spec``), rewritten in place;
        idempotent. A model built on the meta device gets ``init_weights(seed)`` on each rank's
        shards, checked against the same parameter initialised whole (``check_init``).
        """
        adapt_in(root)  # a Hugging Face causal LM gets the contract in place; a ModuleList of blocks, Blocks
        model, name = find_model(root)
        owner = _PARALLELISED_BY.get(model)
        if owner is not None and owner() is self:
            return model
        if owner is not None:  # another strategy's, alive or not: the parameters are sharded and hooked for it
            raise RuntimeError(
                f"{type(model).__name__} was already parallelised by another UltraScaleStrategy; its parameters "
                "are sharded and hooked for that one. Build a new model (or reuse the same Trainer or Fabric)"
            )
        self.validate(model.spec)
        check_model(model, root, self.applied_plugins())
        reference = init_reference(model)  # (meta: a copy costs nothing) for check_init
        # Fresh facts for this model (the mesh stays); its ties as it was built, before any plugin.
        self._layout = Layout(self.parallel_dims, self.mesh, self.active_precision().precision, find_tied(model))
        for plugin in (p for p in self.applied_plugins() if p.active):
            new = plugin.apply(model, self.layout)
            if new is not model:
                if not name:
                    raise TypeError(f"{plugin!r} replaced the root module; wrap the model in a module")
                root.set_submodule(name, new)
                model = new
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            model.to_empty(device=device)
            retie(model, self.layout.tied, by="materialising the meta model (to_empty)")
            model.init_weights(self.seed)  # (the contract checked it exists)
            check_init(model, reference, self.seed, collective_device())
        equalise(model, self.layout.tied_copies)  # a tied weight's copies on other ranks (pipeline stages)
        _PARALLELISED_BY[model] = weakref.ref(self)
        leftover = [n for n, p in root.named_parameters() if p.is_meta]
        if leftover:
            raise RuntimeError(f"parameters outside the parallelised model are still meta tensors: {leftover[:5]}")
        return model

    def parallelised(self, root: nn.Module) -> bool:
        """Whether the model ``root`` holds (or is) was rewritten by this strategy."""
        owner = _PARALLELISED_BY.get(find_model(root)[0])
        return owner is not None and owner() is self

    def clip_grad_norm(self, model: nn.Module, params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Scale the gradients of ``params`` (what the optimizer steps) to a global L2 norm of at most ``max_norm``.

        torch's ``clip_grad_norm_`` cannot mix sharded DTensor gradients with replicated ones;
        this counts every gradient exactly once in any layout. Returns the norm before clipping.
        """
        plan = self.layout.grad_norm
        uncounted = [self.layout.stepped(find_parameter(model, name)) for name in plan.skip]
        return clip_grad_norm_(params, float(max_norm), plan.across, plan.groups_of, uncounted=uncounted)

    def wait_for_parameters(self) -> None:
        """Finish the parameter all-gathers a sharded optimizer (ZeRO-1/2) leaves in flight after its step.

        The next forward waits for each bucket where it needs it, ``state_dict()`` and the end of
        training for all; code reading parameter values in between (a callback's
        ``on_train_batch_end`` or ``on_train_end``, which run before the strategy's) calls this first.
        """
        for sync in self.layout.grad_syncs:
            sync.wait_for_parameters()

    def describe(self) -> str:
        """One line: the mesh and the plugins, for logs."""
        dims = self.parallel_dims
        return f"{dims.describe()} ({dims.world_size} ranks); plugins: {', '.join(map(repr, self.applied_plugins()))}"
