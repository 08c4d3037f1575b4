"""A layout the planner prices: the real plugin objects that run it, and what they say of themselves."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lightning_ultrascale.parallel.defaults import with_defaults
from lightning_ultrascale.parallel.dims import DataShape
from lightning_ultrascale.parallel.pipeline.schedules import resolve_virtual_stages
from lightning_ultrascale.parallel.pipeline.simulator import ScheduleFacts
from lightning_ultrascale.parallel.plugin import ParallelPlugin, resolve_dims
from lightning_ultrascale.parallel.recompute import never

__all__ = ["Candidate"]


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
        return cls(plugins=plugins, micro_batch_size=max(1, micro_batch_size), **facts)

    @classmethod
    def layout(
        cls,
        dp: int = 1,
        zero: int | None = None,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        micro_batch_size: int = 1,
        extra: Sequence[ParallelPlugin] = (),
        **choices: Any,
    ) -> Candidate:
        """The layout of these sizes, built from the plugins that run it (each with its own defaults).

        ``choices``: ``replicate`` and ``reduce_dtype`` (ZeRO), ``sequence_parallel``, ``schedule``,
        ``virtual_stages`` and ``microbatches`` (pipeline), ``cp_method``, ``recompute`` and
        ``recompute_every``. ``micro_batch_size`` is one forward's samples (a pipeline's microbatch).
        ``extra``: further plugins (any that implements ``plan_facts`` / ``plan_cost`` is priced).
        """
        plugins = [*_plugins(dp, zero, tp, pp, cp, ep, choices), *copy.deepcopy(list(extra))]
        candidate = cls.from_plugins(plugins, dp * tp * pp * cp, 1)
        return replace(candidate, micro_batch_size=micro_batch_size)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def n_microbatches(self) -> int:
        return self.microbatches

    def sizes_key(self) -> tuple[Any, ...]:
        """The sizes and placement of this layout (what its parameter shards depend on)."""
        return (self.dp, self.replicate, self.tp, self.sequence_parallel, self.pp, self.schedule,
                self.virtual_stages, self.cp, self.cp_method, self.ep)  # fmt: skip

    def label(self) -> str:
        parts = [f"dp{self.dp}", f"zero{self.zero}"]
        if self.replicate > 1:
            parts.append(f"hsdp{self.replicate}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("" if self.sequence_parallel else "(no sp)"))
        if self.pp > 1:
            own = self.virtual_stages != resolve_virtual_stages(self.schedule, None)
            v = f",v{self.virtual_stages}" if own else ""
            parts.append(f"pp{self.pp}({self.schedule}{v},m{self.n_microbatches})")
        if self.cp > 1:
            parts.append(f"cp{self.cp}({self.cp_method})")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.recompute != "none":
            every = f"/{self.recompute_every}" if self.recompute == "selective" else ""
            parts.append(f"ac:{self.recompute}{every}")
        parts.append(f"mb{self.micro_batch_size}")
        return " ".join(parts)

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


def _plugins(dp: int, zero: int | None, tp: int, pp: int, cp: int, ep: int, choices: dict[str, Any]) -> list[Any]:
    """The plugins of a layout given by sizes (``Candidate.layout``'s arguments)."""
    from lightning_ultrascale.parallel.context import ContextParallel
    from lightning_ultrascale.parallel.data import ZeRO
    from lightning_ultrascale.parallel.expert import ExpertParallel
    from lightning_ultrascale.parallel.pipeline import PipelineParallel
    from lightning_ultrascale.parallel.recompute import Recompute
    from lightning_ultrascale.parallel.tensor import TensorParallel

    unknown = set(choices) - _CHOICES
    if unknown:
        raise TypeError(f"Candidate.layout() got unknown choices {sorted(unknown)}; valid: {sorted(_CHOICES)}")
    get = choices.get
    replicate = get("replicate", 1)
    stage = {} if zero is None else {"stage": zero}  # (None: ZeRO's own default)
    data = ZeRO(**stage, size=dp // replicate, replicate=replicate, reduce_dtype=get("reduce_dtype", "fp32"))
    plugins: list[Any] = [data]
    if tp > 1:
        plugins.append(TensorParallel(tp, sequence_parallel=get("sequence_parallel", True)))
    if pp > 1:
        plugins.append(PipelineParallel(pp, get("schedule", "1f1b"), get("microbatches"), get("virtual_stages")))
    if cp > 1:
        plugins.append(ContextParallel(cp, method=get("cp_method", "zigzag_ring")))
    if ep > 1:
        plugins.append(ExpertParallel(ep))
    if get("recompute", "none") != "none":
        plugins.append(Recompute(get("recompute"), every=get("recompute_every", 1)))
    return plugins


_CHOICES = {"replicate", "reduce_dtype", "sequence_parallel", "schedule", "virtual_stages", "microbatches",
            "cp_method", "recompute", "recompute_every"}  # fmt: skip
