"""What a plugin tells the planner about itself: its facts and its share of one rank's cost.

The planner (``lightning_ultrascale.plan``) holds no copy of any technique's rules. Each plugin
states, beside its :meth:`~lightning_ultrascale.parallel.plugin.ParallelPlugin.plan_shards`:

- its **facts** (:meth:`~lightning_ultrascale.parallel.plugin.ParallelPlugin.plan_facts`): the sizes
  and choices the shared formulas read (``tp``, ``sequence_parallel``, ``microbatches``, the
  pipeline's simulated timeline, which blocks recompute, ...), with the plugin's own defaults;
- its **cost terms** (:meth:`~lightning_ultrascale.parallel.plugin.ParallelPlugin.plan_cost`) on one
  rank, a :class:`RankView`: the bytes it hands to collectives per optimizer step and how much of
  the step's compute can hide them, the memory it holds, the compute it adds (recomputation) and
  the idle time it makes (a pipeline's bubble).

The planner composes them: memory is the data plugin's model state plus the model's activations
(counted op by op from the facts) plus every plugin's working memory; time is the model's compute
(matmuls by shape, attention, memory-bound kernels, launches) with what the plugins add, plus the
optimizer step's memory traffic, plus each plugin's traffic not hidden behind its share of compute
(traffic ``in_step`` waits inside every microbatch and stretches with the bubble; the rest is paid
once per step). A new plugin is priced by implementing these two methods: nothing in ``plan/``
changes.

A plugin is also *searched* by stating its axis: :meth:`~lightning_ultrascale.parallel.plugin.ParallelPlugin.plan_axes`
names the values the search may try (a :class:`PlanAxis`: ``tp`` in 1, 2, 4, 8; whether its
values split the world, so that the data ranks are what is left; whether they trade time for
memory, so that the search stops at the first that fits), and
:meth:`~lightning_ultrascale.parallel.plugin.ParallelPlugin.plan_plugin` builds the plugin at one
:class:`SearchPoint` (a value per axis), or says that the search does not try that combination
(:class:`NotSearched`). The search composes the axes of every technique it knows without naming
any.

Example:
    >>> terms = CostTerms(in_step=False, hidden_by=2 / 3)
    >>> terms.add("dp_shard", "all_gather", 1e6, calls=4)  # 1 MB in 4 calls, each paying a collective's latency
    >>> terms.traffic, terms.calls
    ({'dp_shard:all_gather': 1000000}, {'dp_shard:all_gather': 4})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.spec import ModelSpec
from lightning_ultrascale.parallel.layout import ShardPlan

__all__ = [
    "CostTerms",
    "NotSearched",
    "PlanAxis",
    "RankView",
    "SearchContext",
    "SearchPoint",
    "Widths",
    "add_traffic",
    "dim_name",
    "powers_of_two",
]


@dataclass(frozen=True)
class Widths:
    """Per-token widths of one rank's model (after tensor parallelism) that traffic and memory read."""

    h: int
    f: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    vocab: int
    tp: int
    sp: int  # divisor of the norms' tensors: tp under sequence parallelism, else 1


def moe_fold(spec: Any, widths: Widths) -> int:
    """How many ranks share an MoE layer's tokens: ``tp`` where the model's MoE layers fold over it (each tp rank
    routes its share, ``ModelSpec.moe_folds_tp``), else 1 (every tp rank routes them all)."""
    return widths.tp if spec.moe_folds_tp else 1


@dataclass(frozen=True)
class RankView:
    """One rank of a candidate layout, as the planner prices it (no process, no tensor).

    ``workload`` and ``layout`` are the planner's ``Workload`` and ``Candidate`` (the model, batch
    and precision; every plugin's facts); ``plan`` the parameters this rank holds; ``spec`` the
    model's contract, which every width and count is read from (a user's model is priced as ours).
    """

    workload: Any
    layout: Any
    plan: ShardPlan
    layers: tuple[int, ...]  # global indices of the blocks this rank runs
    first: bool  # holds the embedding
    last: bool  # holds the head (computes the loss)
    accumulation: int  # micro-steps per optimizer step
    widths: Widths
    spec: ModelSpec

    @property
    def tokens(self) -> float:
        """Tokens of one forward on this rank (a micro batch, or a pipeline's microbatch, over cp)."""
        return self.layout.micro_batch_size * self.workload.seq_len / self.layout.cp

    @property
    def element_bytes(self) -> int:
        """Bytes of one activation element (bf16 under autocast, else fp32)."""
        return int(self.workload.activation_bytes)

    @property
    def forwards(self) -> int:
        """Forwards this rank runs per optimizer step (microbatches times accumulation)."""
        return (self.layout.n_microbatches if self.layout.pp > 1 else 1) * self.accumulation


@dataclass
class CostTerms:
    """One plugin's share of one rank's cost per optimizer step.

    ``traffic``: ``"dim:op"`` -> payload bytes (as :class:`~lightning_ultrascale.utils.comm.CommTracer`
    counts them). ``in_step``: the traffic is waited inside every microbatch (stretched by the
    pipeline bubble); otherwise paid once per step. ``hidden_by``: the fraction of the step's
    compute that can hide it (0: fully exposed). ``state``: parameters, gradients and optimizer
    states held between steps (the data plugin's); ``held_grads``: gradient bytes held as static
    memory; ``working``: transient bytes at the rank's peak; ``extra_compute``: the blocks'
    compute added, as a fraction of it (recomputation of whole blocks); ``extra_memory_bound``:
    the same for the memory-bound kernels alone (op-level recomputation re-runs only those);
    ``extra_matmul``: the same for the blocks' matmuls alone (a stack's op-level recomputation that re-runs some);
    ``step_bytes``: memory traffic of the optimizer step (at memory bandwidth, once per step);
    ``bubble``: idle time over compute. ``calls`` (and ``forward_calls``, of ``forward_traffic``): the
    collective calls per step carrying each ``"dim:op"``'s bytes, each paying the collective's latency
    (a key without a count: one call); :meth:`add` keeps both.
    """

    traffic: dict[str, int] = field(default_factory=dict)
    #: traffic (of a per-step plugin) that overlaps the forward instead: hidden behind its share of
    #: compute (a third), e.g. parameter all-gathers prefetched for the next block
    forward_traffic: dict[str, int] = field(default_factory=dict)
    in_step: bool = True
    hidden_by: float = 0.0
    #: the fraction of the step's matmul time that can hide ``traffic`` (collectives overlapped
    #: with the GEMMs beside them, e.g. a stack's tensor-parallel communication overlap)
    hidden_by_matmul: float = 0.0
    #: the fraction of the step's attention time (the fused attention kernels, forward and backward) that can
    #: hide ``traffic``: ring attention's K/V exchange overlaps the attention of the block a rank holds, and
    #: nothing else (the projections run before the ring, the output projection and MLP after it)
    hidden_by_attention: float = 0.0
    state: dict[str, int] | None = None
    held_grads: int = 0
    working: int = 0
    extra_compute: float = 0.0
    extra_memory_bound: float = 0.0
    extra_matmul: float = 0.0
    step_bytes: float = 0.0
    #: the optimizer step's GEMM FLOPs, by the GEMMs' narrowest width (priced at the matmul rate there)
    step_flops: dict[int, float] = field(default_factory=dict)
    #: the name of the host time per block this technique adds (the device's ``host_overheads``)
    host: str | None = None
    bubble: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)
    forward_calls: dict[str, int] = field(default_factory=dict)

    def add(self, dim: str, op: str, payload: float, calls: float, forward: bool = False) -> None:
        """``payload`` bytes of ``op`` over ``dim`` in ``calls`` collective calls, waited in the step (``forward``:
        overlapping the forward, :attr:`forward_traffic`).

        Example:
            >>> terms = CostTerms()
            >>> terms.add("tp", "all_gather", 3e6, calls=3)
            >>> terms.traffic, terms.calls
            ({'tp:all_gather': 3000000}, {'tp:all_gather': 3})
        """
        if payload <= 0 or calls <= 0:
            return
        traffic, counts = (self.forward_traffic, self.forward_calls) if forward else (self.traffic, self.calls)
        add_traffic(traffic, dim, op, payload)
        counts[f"{dim}:{op}"] = counts.get(f"{dim}:{op}", 0) + round(calls)


def add_traffic(traffic: dict[str, int], dim: str, op: str, payload: float) -> None:
    """Add ``payload`` bytes of ``op`` over ``dim`` (rounded per call, as a collective's count is)."""
    if payload > 0:
        traffic[f"{dim}:{op}"] = traffic.get(f"{dim}:{op}", 0) + round(payload)


def dim_name(dims: list[str] | tuple[str, ...]) -> str:
    """A group over ``dims`` named as the tracer names a flattened mesh dim (``dp_shard_cp``)."""
    return "_".join(dims)


@dataclass(frozen=True)
class SearchContext:
    """What the planner's search knows before it picks a layout: the cluster and the workload.

    ``workload``: the planner's ``Workload`` (``seq_len``, ``global_batch_size``, the model's
    config and precision); ``n_layers``, ``n_experts`` (routed experts per MoE block, 0 for a
    dense model) and ``moe_folds_tp`` (its MoE layers split tokens over tp) are the model's, as its
    spec states them.
    """

    world_size: int
    gpus_per_node: int
    workload: Any
    n_layers: int
    n_experts: int = 0
    moe_folds_tp: bool = False


@dataclass(frozen=True)
class PlanAxis:
    """One dimension of the planner's search, declared by the technique it belongs to.

    ``values``: what the search tries by default (a user pins others with ``space={name: [...]}``);
    the first is the technique switched off where it can be. ``splits_world``: each value is a
    mesh size, the product of such axes divides the world size and the data-parallel ranks are
    what is left. ``trades_time_for_memory``: a larger value (or a later one, for names) only
    saves memory at a cost in time, so the search does not price it where a smaller one of the
    same sizes already fits.

    Example:
        >>> PlanAxis("tp", (1, 2, 4, 8), splits_world=True).rank(4)
        4
        >>> PlanAxis("recompute", ("none", "selective_op", "full"), trades_time_for_memory=True).rank("full")
        2
    """

    name: str
    values: tuple[Any, ...]
    splits_world: bool = False
    trades_time_for_memory: bool = False

    def rank(self, value: Any) -> float | None:
        """Where ``value`` stands from fastest to leanest: a number itself, a name its place in :attr:`values`."""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        return self.values.index(value) if value in self.values else None


class NotSearched(ConfigError):
    """A combination the search does not try, unlike a refusal: e.g. ZeRO-0 where ZeRO-1 moves the same bytes."""


@dataclass(frozen=True)
class SearchPoint:
    """One point of the planner's search: a value per axis, and what they leave.

    ``values``: axis names (and further choices a technique reads, e.g. ``microbatches``) to
    values; a name missing takes the technique's own default. ``dp``: the data-parallel ranks
    (the world over the sizes of the world-splitting axes). ``context`` and ``axes`` (every
    axis's values in this search) are ``None`` and empty for a layout given by hand
    (``Candidate.layout``).

    Example:
        >>> point = SearchPoint({"tp": 8}, dp=4)
        >>> point.get("tp", 1), point.get("pp", 1), point.samples_per_rank
        (8, 1, None)
    """

    values: Mapping[str, Any]
    dp: int = 1
    micro_batch_size: int = 1
    context: SearchContext | None = None
    axes: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    @property
    def samples_per_rank(self) -> int | None:
        """Samples each data-parallel rank runs per optimizer step (``None`` for a layout given by hand)."""
        return None if self.context is None else self.context.workload.global_batch_size // self.dp

    def searches(self, name: str, value: Any) -> bool:
        """Whether this search tries ``value`` on axis ``name`` too."""
        return value in self.axes.get(name, ())


def powers_of_two(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``limit`` (a search axis's usual sizes)."""
    out, size = [1], 2
    while size <= limit:
        out.append(size)
        size *= 2
    return tuple(out)
