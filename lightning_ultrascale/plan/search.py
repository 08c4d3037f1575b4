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

Search space (pass ``space`` to pin or widen a dimension): ``tp`` and ``cp`` powers of two up to two
nodes and 8; ``pp`` powers of two up to the number of blocks and 32; ``dp`` what is left; ZeRO 1-3 (0 on
one data rank), HSDP with a node-local shard group; ``ep`` powers of two dividing the experts;
``1f1b``, ``interleaved_1f1b`` and ``zbv`` with as many microbatches as the batch allows (at most
``max_microbatches``); micro batch 1, 2, 4; recomputation none, ``selective_op`` or ``full``.
Layouts no faster than another that needs less memory are not priced (ZeRO-0 beside ZeRO-1 where
both move the same bytes).

Example:
    >>> from lightning_ultrascale.models import get_model_config
    >>> workload = Workload(get_model_config("llama3_8b"), seq_len=4096, global_batch_size=256)
    >>> result = search(workload, world_size=8, gpu="h100")
    >>> result.best.candidate.tp, result.best.fits
    (1, True)
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_ultrascale.errors import ConfigError, is_positive_int
from lightning_ultrascale.parallel.plugin import ParallelPlugin
from lightning_ultrascale.plan.candidate import Candidate
from lightning_ultrascale.plan.cost import Cost, Workload, estimate, priced_spec
from lightning_ultrascale.plan.hardware import Hardware, get_hardware

__all__ = ["NoLayoutFits", "Priced", "SearchResult", "search"]

GiB = 2**30
_SCHEDULES = ("1f1b", "interleaved_1f1b", "zbv")
_RECOMPUTE = ("none", "selective_op", "full")
_SPACE_KEYS = ("tp", "cp", "pp", "zero", "ep", "schedule", "micro_batch_size", "recompute", "hsdp")


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
        if other.candidate.recompute != self.best.candidate.recompute:
            reasons.append((extra_compute, f"recomputation ({other.candidate.recompute})"))
        reasons.sort(key=lambda r: -r[0])
        ratio = slow.step_time / best.step_time - 1
        words = [w for extra, w in reasons[:2] if extra > 0.02 * best.step_time]
        why = ", ".join(words) if words else "about as fast"
        return f"{ratio:+.0%} step time: {why}"


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(1, limit))) + 1)]


def _space(workload: Workload, world: int, gpu: Hardware, space: Mapping[str, Any] | None) -> dict[str, list[Any]]:
    spec = workload.spec
    layers = spec.n_layers
    out: dict[str, list[Any]] = {
        "tp": [t for t in _powers_of_two(2 * gpu.gpus_per_node) if t <= world],
        "cp": [c for c in _powers_of_two(8) if workload.seq_len // c >= 1024 or c == 1],
        # powers of two, and any other size that splits the blocks evenly (pp9 for 126 blocks)
        "pp": sorted(
            {p for p in range(1, min(layers, 32) + 1) if p <= world and (layers % p == 0 or p & (p - 1) == 0)}
        ),
        "zero": [0, 1, 2, 3],
        "ep": _powers_of_two(min(spec.n_experts, world)) if spec.moe_blocks else [1],
        "schedule": list(_SCHEDULES),
        "micro_batch_size": [1, 2, 4],
        "recompute": list(_RECOMPUTE),
        "hsdp": [False, True],
    }
    for key, values in (space or {}).items():
        if key not in _SPACE_KEYS:
            raise ConfigError(f"search space key {key!r} is unknown; valid: {', '.join(_SPACE_KEYS)}")
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        if not values:
            raise ConfigError(f"search space {key}=[] leaves nothing to search; give at least one value")
        out[key] = values
    return out


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


def _candidates(
    workload: Workload, world: int, gpu: Hardware, space: dict[str, list[Any]]
) -> Iterator[Candidate | str]:
    """Every layout of the space whose sizes multiply to ``world`` and split the global batch.

    A layout whose plugins refuse their own arguments (e.g. a schedule's microbatch count) comes
    as the first words of their reason.
    """
    gpn, batch = gpu.gpus_per_node, workload.global_batch_size
    for tp, cp, pp in itertools.product(space["tp"], space["cp"], space["pp"]):
        if world % (tp * cp * pp):
            continue
        dp = world // (tp * cp * pp)
        if batch % dp:
            continue
        per_rank = batch // dp  # samples per data rank per optimizer step
        zeros = [z for z in space["zero"] if z == 0 or dp * cp > 1]
        if dp * cp > 1 and 1 in zeros and 0 in zeros:
            zeros.remove(0)  # ZeRO-0 moves ZeRO-1's bytes and keeps more: never better
        for mbs, zero, ep in itertools.product(space["micro_batch_size"], zeros, space["ep"]):
            if per_rank % mbs or (ep > 1 and (dp * cp) % ep):
                continue
            replicas = [1]
            shard = max(1, gpn // (tp * cp))
            if zero == 3 and True in space["hsdp"] and dp > shard and dp % shard == 0:
                replicas.append(dp // shard)
            if False not in space["hsdp"] and zero == 3:
                replicas = replicas[1:]
            schedules: list[tuple[str, int | None]] = [("1f1b", None)]
            if pp > 1:
                schedules = [(s, None) for s in space["schedule"]]
            for replicate, (schedule, micro) in itertools.product(replicas, schedules):
                if pp > 1:
                    micro = _microbatches(per_rank // mbs, pp)
                    if micro is None:
                        continue
                for recompute in space["recompute"]:
                    try:
                        yield Candidate.layout(
                            dp=dp, zero=zero, tp=tp, pp=pp, schedule=schedule, microbatches=micro, cp=cp, ep=ep,
                            recompute=recompute, micro_batch_size=mbs, replicate=replicate,
                            reduce_dtype=workload.reduce_dtype, extra=space["extra"][0] if "extra" in space else (),
                        )  # fmt: skip
                    except ConfigError as err:
                        yield _reason(err)


def _microbatches(samples: int, pp: int, cap: int = 64) -> int | None:
    """Most microbatches (a multiple of pp, at most ``cap``) that split a rank's samples evenly."""
    best = None
    for m in range(pp, min(samples, max(cap, pp)) + 1, pp):
        if samples % m == 0:
            best = m
    return best


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
    grid = _space(workload, world_size, hardware, space) | {"extra": [tuple(plugins)]}
    fitting, too_big, refusals, dominated = _price_space(workload, world_size, hardware, grid, model)
    # Fastest first; equal speeds (compute-bound layouts) go to the simpler (fewer dims split), then the smaller.
    fitting.sort(key=lambda p: (-float(f"{p.tokens_per_s:.6g}"), _dims_split(p.candidate), p.peak))
    too_big.sort(key=lambda p: p.peak)
    refused = sum(refusals.values())
    result = SearchResult(workload, world_size, hardware, fitting, too_big, refused, refusals, dominated, space)
    if not fitting:
        raise _no_fit(result)
    return result


def _price_space(
    workload: Workload, world_size: int, hardware: Hardware, grid: dict[str, list[Any]], meta: nn.Module
) -> tuple[list[Priced], list[Priced], dict[str, int], list[Candidate]]:
    """Every candidate of ``grid``: those that fit, too big, refused (reason -> count), and not priced."""
    shard_cache: dict[Any, Any] = {}
    fitting: list[Priced] = []
    too_big: list[Priced] = []
    refusals: dict[str, int] = {}
    # A larger micro batch (fewer pipeline microbatches), a higher ZeRO stage and a costlier
    # recomputation each only add time in the model: a layout is not priced when another of the
    # same sizes that is no larger in all three already fits (the candidates come smallest first).
    fit_corners: dict[tuple[Any, ...], list[tuple[int, int, int]]] = {}
    dominated: list[Candidate] = []
    for candidate in _candidates(workload, world_size, hardware, grid):
        if isinstance(candidate, str):  # its plugins refused their arguments
            refusals[candidate] = refusals.get(candidate, 0) + 1
            continue
        key = candidate.sizes_key()
        corner = (candidate.micro_batch_size, candidate.zero, _RECOMPUTE.index(candidate.recompute))
        if any(all(a <= b for a, b in zip(fit, corner)) for fit in fit_corners.get(key, [])):
            dominated.append(candidate)
            continue
        priced = _price(workload, candidate, meta, hardware, shard_cache)
        if isinstance(priced, str):  # the plugins refused it: their reason
            refusals[priced] = refusals.get(priced, 0) + 1
            continue
        if priced.fits:
            fitting.append(priced)
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
    grid = _space(w, world, result.gpu, result.space)
    sizes = [(t, c, p) for t, c, p in itertools.product(grid["tp"], grid["cp"], grid["pp"]) if world % (t * c * p) == 0]
    if not sizes:
        least = min(t * c * p for t, c, p in itertools.product(grid["tp"], grid["cp"], grid["pp"]))
        near = sorted({max(least, world // least * least), -(-world // least) * least})
        return (
            f"no tp x cp x pp of the search space divides world_size={world} (tp in {grid['tp']}, cp in "
            f"{grid['cp']}, pp in {grid['pp']}); valid: a world size they divide (e.g. "
            f"{' or '.join(map(str, near))}), or --space values that divide {world}"
        )
    dps = sorted({world // (t * c * p) for t, c, p in sizes})
    if all(w.global_batch_size % dp for dp in dps):
        d, b = dps[0], w.global_batch_size
        near = sorted({max(d, b // d * d), -(-b // d) * d})
        return (
            f"data.global_batch_size={b} is split by no number of data-parallel ranks these sizes leave "
            f"({', '.join(map(str, dps))}); valid: a multiple of one of them (e.g. data.global_batch_size="
            f"{' or '.join(map(str, near))}), or another world size"
        )
    return (
        f"no micro_batch_size in {grid['micro_batch_size']} (and, with a pipeline, no microbatch count) splits "
        f"data.global_batch_size={w.global_batch_size} over the data ranks ({', '.join(map(str, dps))}); valid: "
        "another global batch size, or --space micro_batch_size=1"
    )


def _dims_split(c: Candidate) -> int:
    return sum(n > 1 for n in (c.dp, c.tp, c.pp, c.cp, c.ep)) + (c.zero == 3) + (c.recompute != "none")


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
