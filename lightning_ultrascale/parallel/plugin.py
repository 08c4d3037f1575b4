"""The contract between the strategy and each parallelism technique.

A plugin knows its technique and nothing of the others; :class:`UltraScaleStrategy` knows the order
in which plugins apply and nothing of their insides. The order is fixed by the data flow (build on
meta -> FP8 swap -> pipeline split -> experts -> tensor -> context -> recomputation -> compile ->
data-parallel wrapping -> materialise), whatever order a user lists plugins in: e.g. FSDP must
wrap modules that tensor parallelism has already turned into DTensors.

A plugin has four parts: the mesh dims it owns (:meth:`~ParallelPlugin.mesh_sizes`), checks that
need no process (:meth:`~ParallelPlugin.validate`), the rewrite of the meta-device model
(:meth:`~ParallelPlugin.apply`), where it reads and writes the facts it shares with the other
plugins in the :class:`~lightning_ultrascale.parallel.layout.Layout`, and, for a technique that
runs forward and backward itself, its :attr:`~ParallelPlugin.step_runner`. For the planner, each
plugin also predicts what it leaves on a rank (:meth:`~ParallelPlugin.plan_shards`), states its
sizes and choices (:meth:`~ParallelPlugin.plan_facts`) and prices itself
(:meth:`~ParallelPlugin.plan_cost`): the planner holds no copy of any technique's rules. A plugin
that declares a search axis (:meth:`~ParallelPlugin.plan_axes`, :meth:`~ParallelPlugin.plan_plugin`)
is searched by the planner wherever it is defined (:func:`searched_techniques`).
"""

from __future__ import annotations

import abc
import functools
import importlib
import pkgutil
from collections.abc import Hashable, Sequence
from typing import Any, ClassVar

from torch import nn

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.spec import ModelSpec
from lightning_ultrascale.parallel.dims import DataShape, ParallelDims
from lightning_ultrascale.parallel.layout import Layout, ShardPlan
from lightning_ultrascale.parallel.pricing import CostTerms, PlanAxis, RankView, SearchContext, SearchPoint
from lightning_ultrascale.parallel.step import StepRunner

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
    #: Runs a step's forward and backward itself (a pipeline schedule); None: Lightning's own step.
    step_runner: StepRunner | None = None
    #: Where the technique stands among the others in the planner's search and a layout's label.
    plan_order: ClassVar[int] = 100
    #: The names :meth:`plan_plugin` reads: its axes and further choices (``Candidate.layout`` takes them).
    plan_names: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "plan_axes" in cls.__dict__:  # (a subclass that only inherits them is the same technique)
            _SEARCHED[f"{cls.__module__}.{cls.__qualname__}"] = cls

    @abc.abstractmethod
    def mesh_sizes(self) -> dict[str, int | None]:
        """The mesh dims this plugin owns and their sizes (``None``: infer from the world size)."""

    def size_arg(self, dim: str) -> str:
        """The constructor argument that sets ``dim``'s size (errors about that size name it)."""
        return "size"

    def validate(self, dims: ParallelDims, spec: ModelSpec, data: DataShape | None) -> None:
        """Raise :class:`~lightning_ultrascale.errors.ConfigError` for a layout this technique cannot run.

        Called once, before any process group, with the model's spec and, where the strategy can
        tell it, the batch shape.
        """

    @property
    def active(self) -> bool:
        """Whether this plugin changes anything (a technique of size 1 does not).

        The strategy calls :meth:`apply` and the planner :meth:`plan_shards`, :meth:`plan_cost`
        and :meth:`plan_label` of an active plugin only.
        """
        return True

    @abc.abstractmethod
    def apply(self, model: nn.Module, layout: Layout) -> nn.Module:
        """Rewrite ``model`` (still on the meta device) for this technique and return it (when :attr:`active`)."""

    def plan_shards(self, model: nn.Module, plan: ShardPlan) -> None:
        """Predict, without processes, what :meth:`apply` leaves on ``plan``'s rank (default: everything, whole).

        ``model`` is the whole meta-device model, untouched. The planner composes every plugin's
        prediction in :data:`APPLY_ORDER`; ``ultrascale-plan --check`` holds it against a real
        ``apply`` under torch's fake process group.
        """

    def validate_with(self, plugins: Sequence[ParallelPlugin]) -> None:
        """Raise :class:`~lightning_ultrascale.errors.ConfigError` for a combination with the other
        ``plugins`` this technique cannot run (default: none). Called after :meth:`validate`."""

    def plan_facts(self, dims: ParallelDims) -> dict[str, Any]:
        """The sizes and choices the planner reads of this plugin, its own defaults resolved (default: none).

        Keys are :class:`~lightning_ultrascale.plan.Candidate` fields (e.g. ``{"tp": 8,
        "sequence_parallel": True}``), or a technique's own names, kept in ``Candidate.facts``;
        see :mod:`lightning_ultrascale.parallel.pricing`.
        """
        return {}

    def plan_cost(self, rank: RankView) -> CostTerms | None:
        """This technique's share of ``rank``'s cost per optimizer step (default: nothing).

        Traffic and how much compute can hide it, memory it holds, compute it adds, a bubble:
        the planner composes every plugin's terms (:mod:`lightning_ultrascale.parallel.pricing`).
        """
        return None

    @classmethod
    def plan_axes(cls, context: SearchContext) -> tuple[PlanAxis, ...]:
        """The dimensions the planner's search tries for this technique on ``context``'s cluster (default: none).

        A technique that declares axes is searched: the search tries every combination of every
        technique's values and builds each technique with :meth:`plan_plugin`.
        """
        return ()

    @classmethod
    def plan_plugin(cls, point: SearchPoint) -> ParallelPlugin | None:
        """This technique at one point of the search (``None``: not used there).

        Raise :class:`~lightning_ultrascale.parallel.pricing.NotSearched` for a combination the
        search should skip, :class:`~lightning_ultrascale.errors.ConfigError` (the plugin's own
        checks) for one it cannot run: the search counts those refusals.
        """
        return None

    def plan_label(self, dims: ParallelDims) -> str:
        """This plugin in a layout's one-line label (``tp8``), or ``""`` where it does nothing."""
        return ""

    def plan_splits(self, dims: ParallelDims) -> int:
        """How many ways this plugin splits or repeats the work: of two layouts as fast, the planner
        prefers the one with fewer (default: 1)."""
        return 1

    def plan_shards_key(self) -> Hashable:
        """What :meth:`plan_shards` depends on (the planner reuses a prediction; ``None``: it shards nothing)."""
        return None if type(self).plan_shards is ParallelPlugin.plan_shards else repr(self)

    def settings(self) -> dict[str, Any]:
        """Settings that tell this plugin apart in logs, shown before its mesh sizes."""
        return {}

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in {**self.settings(), **self.mesh_sizes()}.items())
        return f"{type(self).__name__}({fields})"


def apply_all(plugins: Sequence[ParallelPlugin], model: nn.Module, layout: Layout) -> nn.Module:
    """``model`` rewritten by every active plugin of ``plugins``, in their order (as the strategy applies them)."""
    for plugin in plugins:
        if plugin.active:
            model = plugin.apply(model, layout)
    return model


_SEARCHED: dict[str, type[ParallelPlugin]] = {}


def searched_techniques() -> tuple[type[ParallelPlugin], ...]:
    """Every technique the planner searches: the plugins of ``lightning_ultrascale.parallel`` and any
    other subclass defined so far that declares :meth:`~ParallelPlugin.plan_axes`, in ``plan_order``.
    """
    _import_techniques()
    return tuple(sorted(_SEARCHED.values(), key=lambda cls: (cls.plan_order, cls.__name__)))


@functools.cache
def _import_techniques() -> None:
    """Import every module of ``lightning_ultrascale.parallel`` once: its plugins register themselves."""
    package = importlib.import_module(__name__.rpartition(".")[0])
    for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
        importlib.import_module(module.name)


def resolve_dims(plugins: Sequence[ParallelPlugin], world_size: int) -> ParallelDims:
    """The plugins' mesh sizes, the one left open inferred, validated against ``world_size``."""
    sizes: dict[str, int] = {}
    sources: dict[str, tuple[str, str]] = {}
    open_dims: list[str] = []
    for plugin in plugins:
        for dim, size in plugin.mesh_sizes().items():
            sources[dim] = (type(plugin).__name__, plugin.size_arg(dim))
            if size is None:
                open_dims.append(dim)
            else:
                sizes[dim] = size
    if len(open_dims) > 1:
        raise ConfigError(
            f"only one parallel size can be inferred, but {', '.join(open_dims)} are all unset; "
            "give all but one of them a size"
        )
    dims = ParallelDims.infer(world_size, open_dims[0] if open_dims else None, sources, **sizes)
    dims.validate(world_size)
    return dims
