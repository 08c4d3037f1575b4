"""The layout search: every valid layout of a model on N GPUs, the ones that fit, ranked by tokens/s.

The playbook's last chapter as a function. :func:`search` enumerates layouts (tensor, context,
pipeline and data sizes, ZeRO stage and HSDP, expert parallelism for MoE models, pipeline schedule,
micro batch size, recomputation), lets the real plugins refuse the invalid ones
(``UltraScaleStrategy.validate``, the run's own checks), prices the rest with
:func:`~lightning_ultrascale.plan.cost.estimate` on the GPU's profile, drops those whose busiest
rank exceeds the GPU's usable memory, and ranks the others by tokens per second.

:meth:`SearchResult.alternatives` explains why each popular layout family loses to the winner
(out of memory by X GiB, pipeline bubble, tensor parallelism across nodes, exposed data-parallel
traffic, recomputation); a model that fits no layout raises :class:`NoLayoutFits` with the smallest
memory it would need and the closest layouts.

The search space is the techniques' own (:func:`search_space`): each plugin declares its axis
(:meth:`~lightning_ultrascale.parallel.plugin.ParallelPlugin.plan_axes`) and builds itself at a point
(:meth:`~lightning_ultrascale.parallel.plugin.ParallelPlugin.plan_plugin`), and the search names none
of them: the sizes of the world-splitting axes (``tp``, ``cp``, ``pp``) multiply into the world and
the data-parallel ranks are what is left; the micro batch (1, 2, 4) is the search's own axis. By
default: ``tp`` and ``cp`` powers of two up to two nodes and 8; ``pp`` powers of two up to the number
of blocks and 32; ZeRO 1-3 (0 on one data rank), HSDP with a node-local shard group; ``ep`` powers
of two dividing the experts; ``1f1b``, ``interleaved_1f1b`` and ``zbv`` with as many microbatches
as the batch allows; recomputation none, ``selective_op`` or ``full``. Pass ``space`` to pin or
widen an axis. A value that only trades time for memory (a larger micro batch, a higher ZeRO stage,
more recomputation) is not priced where a smaller one of the same sizes already fits.

Example:
    >>> from lightning_ultrascale.models import get_model_config
    >>> workload = Workload(get_model_config("llama3_8b"), seq_len=4096, global_batch_size=256)
    >>> result = search(workload, world_size=8, gpu="h100")
    >>> result.best.candidate.tp, result.best.fits
    (1, True)
"""

from __future__ import annotations

import copy
import itertools
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from lightning_ultrascale.errors import ConfigError, is_positive_int
from lightning_ultrascale.parallel.plugin import ParallelPlugin, searched_techniques
from lightning_ultrascale.parallel.pricing import NotSearched, PlanAxis, SearchContext, SearchPoint
from lightning_ultrascale.plan.candidate import Candidate, build_plugins
from lightning_ultrascale.plan.cost import Cost, Workload, estimate, priced_spec
from lightning_ultrascale.plan.hardware import Hardware, get_hardware
from lightning_ultrascale.utils.memo import planning

__all__ = ["NoLayoutFits", "Priced", "SearchResult", "search", "search_space"]

GiB = 2**30
#: the search's own axis: samples per forward (a pipeline's microbatch)
MICRO_BATCH = PlanAxis("micro_batch_size", (1, 2, 4), trades_time_for_memory=True)


class NoLayoutFits(ConfigError):
    """No valid layout of the workload fits the GPU's memory; the message names the closest ones."""


@dataclass
class Priced:
    """One layout with its cost on the first rank of its first, second and last pipeline stage (where the peaks are)."""

    candidate: Candidate
    costs: list[Cost]
    usable_bytes: int

    @property
    def busiest(self) -> Cost:
        return max(self.costs, key=lambda c: c.peak)

    @property
    def slowest(self) -> Cost:
        return max(self.costs, key=lambda c: c.step_time)

    @property
    def peak(self) -> int:
        return self.busiest.peak

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable_bytes

    @property
    def tokens_per_s(self) -> float:
        return self.slowest.tokens_per_s

    @property
    def mfu(self) -> float:
        return self.slowest.mfu

    @property
    def step_time(self) -> float:
        return self.slowest.step_time

    def memory_gib(self) -> dict[str, float]:
        return {k: v / GiB for k, v in self.busiest.memory.items()}


@dataclass
class SearchResult:
    """The priced layouts of one workload on one cluster: ``fitting`` best first, ``too_big`` smallest first."""

    workload: Workload
    world_size: int
    gpu: Hardware
    fitting: list[Priced]
    too_big: list[Priced]
    refused: int = 0  # layouts the plugins' validation refused
    refusals: dict[str, int] = field(default_factory=dict)  # first words of each refusal -> count
    #: layouts not priced: the same sizes fit with less sharding, recomputation or micro batch
    dominated: list[Candidate] = field(default_factory=list)
    #: the ``space`` the search was given (its overrides of the default dimensions)
    space: Mapping[str, Any] | None = None

    @property
    def best(self) -> Priced:
        return self.fitting[0]

    def alternatives(self) -> list[tuple[str, Priced | None, str]]:
        """``(family, its best layout, why it loses to the winner)`` for the layouts users reach for first."""
        gpn = self.gpu.gpus_per_node
        families: list[tuple[str, Any]] = [
            ("data parallel only (ZeRO-1)", lambda c: c.tp == c.pp == c.cp == 1 and c.zero <= 1),
            ("ZeRO-3 / FSDP only", lambda c: c.tp == c.pp == c.cp == 1 and c.zero == 3),
            ("tensor parallel inside a node", lambda c: 1 < c.tp <= gpn and c.pp == 1),
            ("tensor parallel across nodes", lambda c: c.tp > gpn),
            ("pipeline parallel", lambda c: c.pp > 1),
            ("context parallel", lambda c: c.cp > 1),
            ("no recomputation", lambda c: c.recompute == "none"),
        ]
        rows: list[tuple[str, Priced | None, str]] = []
        for name, member in families:
            fit = [p for p in self.fitting if member(p.candidate)]
            if fit:
                best = fit[0]
                rows.append((name, best, "the winner" if best is self.best else self.why_slower(best)))
                continue
            big = [p for p in self.too_big if member(p.candidate)]
            if big:
                over = (big[0].peak - self.gpu.usable_bytes) / GiB
                rows.append((name, big[0], f"out of memory by {over:.1f} GiB at its smallest"))
            elif any(member(c) for c in self.dominated):
                why = "not priced: the same sizes fit with less sharding or recomputation, no slower"
                rows.append((name, None, why))
            else:
                rows.append((name, None, "no valid layout of this family for this model and cluster"))
        return rows

    def why_slower(self, other: Priced) -> str:
        """The largest reasons ``other`` takes longer per step than the winner, in words."""
        best, slow = self.best.slowest, other.slowest
        gpn = self.gpu.gpus_per_node
        reasons: list[tuple[float, str]] = []

        def part(cost: Cost, key: str) -> float:
            return cost.time_parts.get(key, 0.0)

        def bubble(cost: Cost) -> float:
            return (part(cost, "compute") + part(cost, "critical_comm")) * cost.bubble

        reasons.append((bubble(slow) - bubble(best), f"pipeline bubble {slow.bubble:.2f} of compute"))
        for dim in ("tp", "ep", "pp", "cp"):
            extra = part(slow, dim) - part(best, dim)
            if dim == "tp" and other.candidate.tp > gpn:
                what = f"tensor parallelism across nodes (tp={other.candidate.tp} > {gpn} GPUs per node)"
            else:
                what = f"{dim} traffic on the critical path"
            reasons.append((extra, what))
        reasons.append(
            (part(slow, "exposed_dp_comm") - part(best, "exposed_dp_comm"), "data-parallel traffic not hidden")
        )
        extra_compute = part(slow, "compute") - part(best, "compute")
        extra_host = part(slow, "host") - part(best, "host")
        if other.candidate.recompute != self.best.candidate.recompute:
            reasons.append((extra_compute, f"recomputation ({other.candidate.recompute})"))
        else:  # the same work split otherwise: each rank's share of the kernels and of their launches
            reasons.append((extra_host, "host time: more kernels per rank (launch and dispatch overhead)"))
            reasons.append((extra_compute - extra_host, "more compute per rank"))
        reasons.append((part(slow, "optimizer_step") - part(best, "optimizer_step"), "a longer optimizer step"))
        reasons.sort(key=lambda r: -r[0])
        ratio = slow.step_time / best.step_time - 1
        words = [w for extra, w in reasons[:2] if extra > 0.02 * best.step_time]
        why = ", ".join(words) if words else "about as fast" if ratio < 0.05 else "several small terms together"
        return f"{ratio:+.0%} step time: {why}"


def context_of(workload: Workload, world: int, gpu: Hardware) -> SearchContext:
    """What the techniques see of the workload and the cluster when they declare their axes."""
    spec = workload.spec
    experts = spec.n_experts if spec.moe_blocks else 0
    return SearchContext(
        world, gpu.gpus_per_node, workload, n_layers=spec.n_layers, n_experts=experts, moe_folds_tp=spec.moe_folds_tp
    )


def search_space(context: SearchContext, pins: Mapping[str, Any] | None = None) -> dict[str, PlanAxis]:
    """Every searched technique's axes (and the micro batch) on ``context``, with ``pins`` replacing their values.

    Example:
        >>> from lightning_ultrascale.models import get_model_config
        >>> from lightning_ultrascale.plan.hardware import get_hardware
        >>> work = Workload(get_model_config("llama3_8b"), seq_len=4096, global_batch_size=256)
        >>> axes = search_space(context_of(work, 16, get_hardware("h100")), {"tp": [8]})
        >>> axes["tp"].values, axes["zero"].values, sorted(a.name for a in axes.values() if a.splits_world)
        ((8,), (0, 1, 2, 3), ['cp', 'pp', 'tp'])
    """
    axes = {MICRO_BATCH.name: MICRO_BATCH}
    for technique in searched_techniques():
        axes.update((axis.name, axis) for axis in technique.plan_axes(context))
    for key, values in (pins or {}).items():
        if key not in axes:
            names = sorted(axes, key=lambda name: not axes[name].splits_world)  # (the sizes first)
            raise ConfigError(f"search space key {key!r} is unknown; valid: {', '.join(names)}")
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        if not values:
            raise ConfigError(f"search space {key}=[] leaves nothing to search; give at least one value")
        axes[key] = replace(axes[key], values=tuple(values))
    return axes


def _check_cluster(world: int, gpu: Hardware) -> None:
    if not is_positive_int(world):
        raise ConfigError(f"world_size={world!r} must be a positive number of GPUs")
    gpn = gpu.gpus_per_node
    if world > gpn and world % gpn:
        raise ConfigError(
            f"world_size={world} is not a whole number of {gpu.name} nodes ({gpn} GPUs each); valid: "
            f"1..{gpn} GPUs on one node, or a multiple of {gpn} "
            f"(e.g. {world // gpn * gpn} or {(world // gpn + 1) * gpn})"
        )


def _points(context: SearchContext, axes: dict[str, PlanAxis]) -> Iterator[tuple[SearchPoint, tuple[Any, ...]]]:
    """Every point of the space whose world-splitting sizes divide the world and leave data ranks that
    split the global batch, each with the values of its axes that do not trade time for memory.

    The trading axes vary fastest, each from its fastest value (the search skips what a faster
    point of the same sizes already fits).
    """
    world, batch = context.world_size, context.workload.global_batch_size
    splitting = [a for a in axes.values() if a.splits_world]
    trading = [_fastest_first(a) for a in axes.values() if a.trades_time_for_memory]
    others = [a for a in axes.values() if not a.splits_world and not a.trades_time_for_memory]
    values = {a.name: a.values for a in axes.values()}
    for sizes in itertools.product(*(a.values for a in splitting)):
        if world % math.prod(sizes) or batch % (world // math.prod(sizes)):
            continue
        dp = world // math.prod(sizes)
        for rest in itertools.product(*(a.values for a in others)):
            for trades in itertools.product(*(a.values for a in trading)):
                chosen = dict(zip([a.name for a in splitting + others + trading], (*sizes, *rest, *trades)))
                mbs = chosen.pop(MICRO_BATCH.name)
                if (batch // dp) % mbs:
                    continue
                yield SearchPoint(chosen, dp, mbs, context, values), (dp, *sizes, *rest)


def _fastest_first(axis: PlanAxis) -> PlanAxis:
    """``axis`` with its values from the fastest (where every value has a place on it)."""
    if any(axis.rank(v) is None for v in axis.values):
        return axis
    return replace(axis, values=tuple(sorted(axis.values, key=lambda v: axis.rank(v) or 0)))


def _candidates(
    context: SearchContext, axes: dict[str, PlanAxis], extra: Sequence[ParallelPlugin]
) -> Iterator[tuple[Candidate | str, tuple[Any, ...], tuple[float | None, ...]]]:
    """Every layout of the space, with its sizes and its place on the trading axes.

    A layout whose plugins refuse their own arguments (e.g. a schedule's microbatch count) comes
    as the first words of their reason.
    """
    trading = [a for a in axes.values() if a.trades_time_for_memory]
    for point, sizes in _points(context, axes):
        corner = tuple(a.rank(point.micro_batch_size if a is MICRO_BATCH else point.get(a.name)) for a in trading)
        try:
            plugins = [*build_plugins(point), *copy.deepcopy(list(extra))]
            candidate = Candidate.from_plugins(plugins, context.world_size, 1)
        except NotSearched:
            continue
        except ConfigError as err:
            yield _reason(err), sizes, corner
            continue
        # (same sizes: the same values off the trading axes, and the same mesh they made: HSDP only at stage 3)
        yield replace(candidate, micro_batch_size=point.micro_batch_size), (*sizes, candidate.dims), corner


def search(
    workload: Workload,
    world_size: int,
    gpu: str | Mapping[str, Any] | Hardware = "h100",
    model: nn.Module | None = None,
    space: Mapping[str, Sequence[Any] | Any] | None = None,
    plugins: Sequence[ParallelPlugin] = (),
) -> SearchResult:
    """Price every valid layout of ``workload`` on ``world_size`` GPUs; raise if none fits.

    ``model``: the model on the meta device (``workload.model`` where it is one, else built from it).
    ``space``: values to try per dimension instead of the defaults (module docstring), e.g.
    ``{"tp": [8], "recompute": ["full"]}`` pins tp and recomputation. ``plugins``: further plugins
    every layout runs with (each prices itself through ``plan_facts`` / ``plan_cost``).

    Raises:
        ConfigError: an invalid cluster size, GPU profile or search space, or no valid layout at all.
        NoLayoutFits: valid layouts exist but none fits the GPU's memory (the message says how
            much memory the smallest would need and lists the closest ones).
    """
    from lightning_ultrascale.models import build_model

    hardware = get_hardware(gpu)
    _check_cluster(world_size, hardware)
    if model is None:
        model = workload.model if isinstance(workload.model, nn.Module) else build_model(workload.model, device="meta")
    priced_spec(model)
    context = context_of(workload, world_size, hardware)
    axes = search_space(context, space)
    layouts = _candidates(context, axes, plugins)
    with planning():  # the meta model's derived facts, once per search (utils/memo.py)
        fitting, too_big, refusals, dominated = _price_space(workload, hardware, layouts, model)
    # Fastest first; equal speeds (compute-bound layouts) go to the simpler (fewer dims split), then the smaller.
    fitting.sort(key=lambda p: (-float(f"{p.tokens_per_s:.6g}"), p.candidate.splits(), p.peak))
    too_big.sort(key=lambda p: p.peak)
    refused = sum(refusals.values())
    result = SearchResult(workload, world_size, hardware, fitting, too_big, refused, refusals, dominated, space)
    if not fitting:
        raise _no_fit(result)
    return result


def _price_space(
    workload: Workload, hardware: Hardware, layouts: Iterator[Any], meta: nn.Module
) -> tuple[list[Priced], list[Priced], dict[str, int], list[Candidate]]:
    """Every candidate of ``layouts``: those that fit, too big, refused (reason -> count), and not priced."""
    shard_cache: dict[Any, Any] = {}
    fitting: list[Priced] = []
    too_big: list[Priced] = []
    refusals: dict[str, int] = {}
    # A value on a trading axis (a larger micro batch, a higher ZeRO stage, more recomputation)
    # only adds time in the model: a layout is not priced when another of the same sizes that is
    # no larger on every trading axis already fits (the candidates come smallest first).
    fit_corners: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
    dominated: list[Candidate] = []
    for candidate, key, corner in layouts:
        if isinstance(candidate, str):  # its plugins refused their arguments
            refusals[candidate] = refusals.get(candidate, 0) + 1
            continue
        comparable = None not in corner
        if comparable and any(all(a <= b for a, b in zip(fit, corner)) for fit in fit_corners.get(key, [])):
            dominated.append(candidate)
            continue
        priced = _price(workload, candidate, meta, hardware, shard_cache)
        if isinstance(priced, str):  # the plugins refused it: their reason
            refusals[priced] = refusals.get(priced, 0) + 1
            continue
        if priced.fits:
            fitting.append(priced)
            if comparable:
                fit_corners.setdefault(key, []).append(corner)
        else:
            too_big.append(priced)
    return fitting, too_big, refusals, dominated


def _price(
    workload: Workload, candidate: Candidate, meta: nn.Module, hardware: Hardware, shard_cache: dict[Any, Any]
) -> Priced | str:
    """``candidate`` priced on the ranks where the peaks are, or the first words of the plugins' refusal."""
    pp_ranks = candidate.world_size // candidate.pp
    # the first and last stages hold the most memory, a middle one sends the most
    ranks = sorted({0, min(1, candidate.pp - 1) * pp_ranks, (candidate.pp - 1) * pp_ranks})
    try:
        with warnings.catch_warnings():  # the plugins' advice is for a run, not for each candidate
            warnings.simplefilter("ignore")
            costs = estimate(workload, candidate, meta, hardware, ranks=ranks, shard_cache=shard_cache)
    except ConfigError as err:
        return _reason(err)
    return Priced(candidate, costs, hardware.usable_bytes)


def _reason(err: ConfigError) -> str:
    """The first words of a plugin's refusal (refusals are counted by them)."""
    return str(err).split(";")[0][:90]


def _why_no_candidates(result: SearchResult) -> str:
    """Why the space has no layout at all: the sizes divide no world size, or no batch split."""
    w, world = result.workload, result.world_size
    axes = search_space(context_of(w, world, result.gpu), result.space)
    splitting = [a for a in axes.values() if a.splits_world]
    names = " x ".join(a.name for a in splitting)
    products = [math.prod(sizes) for sizes in itertools.product(*(a.values for a in splitting))]
    dividing = [n for n in products if world % n == 0]
    if not dividing:
        least = min(products)
        near = sorted({max(least, world // least * least), -(-world // least) * least})
        ranges = ", ".join(f"{a.name} in {list(a.values)}" for a in splitting)
        return (
            f"no {names} of the search space divides world_size={world} ({ranges}); valid: a world size "
            f"they divide (e.g. {' or '.join(map(str, near))}), or --space values that divide {world}"
        )
    dps = sorted({world // n for n in dividing})
    if all(w.global_batch_size % dp for dp in dps):
        d, b = dps[0], w.global_batch_size
        near = sorted({max(d, b // d * d), -(-b // d) * d})
        return (
            f"data.global_batch_size={b} is split by no number of data-parallel ranks these sizes leave "
            f"({', '.join(map(str, dps))}); valid: a multiple of one of them (e.g. data.global_batch_size="
            f"{' or '.join(map(str, near))}), or another world size"
        )
    return (
        f"no micro_batch_size in {list(axes[MICRO_BATCH.name].values)} (and, with a pipeline, no microbatch count) "
        f"splits data.global_batch_size={w.global_batch_size} over the data ranks ({', '.join(map(str, dps))}); "
        "valid: another global batch size, or --space micro_batch_size=1"
    )


def _no_fit(result: SearchResult) -> ConfigError:
    w, gpu = result.workload, result.gpu
    what = (
        f"{w.name} (seq_len={w.seq_len}, global_batch_size={w.global_batch_size}) on {result.world_size} x {gpu.name}"
    )
    if not result.too_big and not result.refused:
        return ConfigError(f"no layout of {what} to price: {_why_no_candidates(result)}")
    if not result.too_big:
        common = sorted(result.refusals.items(), key=lambda kv: -kv[1])[:3]
        listed = "; ".join(f"{reason} ({n}x)" for reason, n in common)
        return ConfigError(
            f"no valid layout of {what}: the plugins refused all {result.refused} candidates, most often: {listed}"
        )
    closest = result.too_big[:3]
    need = closest[0].peak / GiB
    lines = [
        f"{what}: no layout fits in {gpu.usable_bytes / GiB:.1f} GiB usable per GPU "
        f"({gpu.memory_bytes / GiB:.0f} GiB minus {gpu.reserved_bytes / GiB:.0f} GiB reserved); the smallest "
        f"needs {need:.1f} GiB. Closest layouts:"
    ]
    for p in closest:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in p.memory_gib().items())
        lines.append(f"  {p.candidate.label()}: {p.peak / GiB:.1f} GiB ({parts})")
    lines.append(
        "Valid: more GPUs, a GPU with more memory (--gpu h200), a shorter seq_len or a smaller global batch "
        "(fewer microbatches in flight)"
    )
    return NoLayoutFits("\n".join(lines))
