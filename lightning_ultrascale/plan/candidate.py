"""A layout the planner prices: the real plugin objects that run it, and what they say of themselves."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from lightning_ultrascale.parallel.defaults import with_defaults
from lightning_ultrascale.parallel.dims import MESH_DIMS, DataShape, ParallelDims
from lightning_ultrascale.parallel.pipeline.simulator import ScheduleFacts
from lightning_ultrascale.parallel.plugin import ParallelPlugin, resolve_dims, searched_techniques
from lightning_ultrascale.parallel.pricing import SearchPoint
from lightning_ultrascale.parallel.recompute import never

__all__ = ["Candidate", "build_plugins"]


@dataclass(frozen=True)
class Candidate:
    """One layout: the plugins that run it, the micro batch, and the facts the plugins state.

    Build one from a run's plugins (:meth:`from_plugins`) or from sizes and choices, the search's
    vocabulary (:meth:`layout`). The other fields are read from the plugins'
    :meth:`~lightning_ultrascale.parallel.plugin.ParallelPlugin.plan_facts` (their own defaults
    resolved: e.g. a pipeline's microbatches), never set by hand; ``dp`` counts every data-parallel
    rank (``dp_replicate x dp_shard``); ZeRO stage 3 with ``replicate > 1`` is HSDP.

    Example:
        >>> c = Candidate.layout(dp=4, tp=8, pp=2, zero=1, micro_batch_size=1)
        >>> c.world_size, c.label()
        (64, 'dp4 zero1 tp8 pp2(1f1b,m2) mb1')
    """

    plugins: tuple[ParallelPlugin, ...] = field(compare=False, repr=False)
    micro_batch_size: int = 1
    dp: int = 1
    zero: int = 0
    replicate: int = 1
    reduce_dtype: str = "fp32"
    tp: int = 1
    sequence_parallel: bool = True
    #: sequence-parallel inputs kept sharded for backward, all-gathered again there (``TensorParallel(regather=)``)
    regather: bool = False
    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1
    timeline: ScheduleFacts | None = field(default=None, compare=False, repr=False)
    cp: int = 1
    cp_method: str = "zigzag_ring"
    ep: int = 1
    recompute: str = "none"
    recompute_every: int = 1
    #: whether a block (global index) is recomputed whole in backward (``full``, ``selective``)
    recomputes: Callable[[int], bool] = field(default=never, compare=False, repr=False)
    #: the mesh the plugins make
    dims: ParallelDims = field(default_factory=ParallelDims, compare=False, repr=False)
    #: facts of techniques beyond the fields above (a plugin's own ``plan_facts`` keys)
    facts: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_plugins(cls, plugins: Sequence[ParallelPlugin], world_size: int, micro_batch_size: int) -> Candidate:
        """The layout a run's plugins make on ``world_size`` ranks; ``micro_batch_size``: ``data.micro_batch_size``.

        Each plugin states its own facts (``plan_facts``); the strategy's default data plugin is
        added where none is given, as a run does.

        Example:
            >>> from lightning_ultrascale import TensorParallel, ZeRO
            >>> Candidate.from_plugins([ZeRO(3), TensorParallel(8)], world_size=64, micro_batch_size=1).label()
            'dp8 zero3 tp8 mb1'
        """
        plugins = with_defaults(tuple(plugins))
        dims = resolve_dims(plugins, world_size)
        facts: dict[str, Any] = {"dp": dims.dp_replicate * dims.dp_shard}
        for plugin in plugins:
            facts.update(plugin.plan_facts(dims))
        # the run's data.micro_batch_size is what a pipeline splits into its microbatches
        if facts.get("pp", 1) > 1:
            micro_batch_size //= facts["microbatches"]
        known = {f.name for f in fields(cls)}
        extra = {k: v for k, v in facts.items() if k not in known}
        own = {k: v for k, v in facts.items() if k in known}
        return cls(plugins=plugins, micro_batch_size=max(1, micro_batch_size), dims=dims, facts=extra, **own)

    @classmethod
    def layout(
        cls, dp: int = 1, micro_batch_size: int = 1, extra: Sequence[ParallelPlugin] = (), **choices: Any
    ) -> Candidate:
        """The layout of these sizes and choices, built by the techniques the planner searches.

        ``choices``: any name a technique reads (its ``plan_names``): ``tp``, ``pp``, ``cp``,
        ``ep``, ``zero`` (``None``: ZeRO's default stage), ``replicate``, ``reduce_dtype``,
        ``sequence_parallel``, ``regather``, ``schedule``, ``virtual_stages``, ``microbatches``, ``cp_method``,
        ``recompute``, ``recompute_every``; a name left out is the technique's own default (off
        where it can be). ``micro_batch_size`` is one forward's samples (a pipeline's
        microbatch). ``extra``: further plugins (any that implements ``plan_facts`` /
        ``plan_cost`` is priced).
        """
        plugins = [*build_plugins(SearchPoint(choices, dp=dp)), *copy.deepcopy(list(extra))]
        world = math.prod(size or 1 for p in plugins for d, size in p.mesh_sizes().items() if d in MESH_DIMS)
        candidate = cls.from_plugins(plugins, world, 1)
        return replace(candidate, micro_batch_size=micro_batch_size)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def n_microbatches(self) -> int:
        return self.microbatches

    def shards_key(self) -> Hashable:
        """What this layout's parameter shards depend on: the mesh and each plugin's part in them."""
        keys = ((type(p).__name__, p.plan_shards_key()) for p in self.plugins)
        return self.dims, tuple((name, key) for name, key in keys if key is not None)

    def label(self) -> str:
        """One line: every plugin's part (in the planner's order of techniques), then the micro batch."""
        ordered = sorted(self.plugins, key=lambda p: type(p).plan_order)
        parts = [label for p in ordered if p.active and (label := p.plan_label(self.dims))]
        return " ".join([*parts, f"mb{self.micro_batch_size}"])

    def splits(self) -> int:
        """How many ways the layout splits or repeats the work (of two as fast, the planner takes the fewer)."""
        return sum(p.plan_splits(self.dims) for p in self.plugins if p.active)

    def strategy(self) -> Any:
        """A strategy of fresh copies of this layout's plugins (a run's plugins hold its state)."""
        from lightning_ultrascale.core.strategy import UltraScaleStrategy

        return UltraScaleStrategy(*copy.deepcopy(self.plugins))

    @property
    def batch_per_rank(self) -> int:
        """Samples each data-parallel rank runs per step (a pipeline splits them into microbatches)."""
        return self.micro_batch_size * (self.n_microbatches if self.pp > 1 else 1)

    def data_shape(self, workload: Any) -> DataShape:
        """The batch shape the run's validation checks: :attr:`batch_per_rank` samples of ``seq_len``."""
        return DataShape(workload.seq_len, self.batch_per_rank, workload.global_batch_size, owner="Workload")


def build_plugins(point: SearchPoint) -> list[ParallelPlugin]:
    """Every searched technique at ``point``: the plugins that run it (a technique off there adds none).

    Raises:
        ConfigError: a name no technique reads (the valid ones listed), or a plugin's own refusal.
    """
    techniques = searched_techniques()
    unknown = set(point.values) - {name for t in techniques for name in t.plan_names}
    if unknown:
        valid = sorted({name for t in techniques for name in t.plan_names})
        raise TypeError(f"Candidate.layout() got unknown choices {sorted(unknown)}; valid: {valid}")
    return [p for technique in techniques if (p := technique.plan_plugin(point)) is not None]
