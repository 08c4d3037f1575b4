"""Pipeline-schedule simulator: when each rank computes what, how long it idles, what it holds.

The *order* of compute on every rank is torch's own, so a timeline here is the one that
``torch.distributed.pipelining`` runs. Multi-stage schedules come from the class's
``pipeline_order``, built with mocked stages as ``torch.distributed.pipelining._schedule_visualizer
.get_schedule_ops`` does (no process group). GPipe and 1F1B run no such IR: their
``_step_microbatches`` is a hand-written loop, which ``_single_stage_order`` mirrors. (torch's
``Schedule1F1B._get_pipeline_order``, which only the visualizer reads, is wrong on the last rank in
torch 2.13: it skips ``F0`` and emits an ``F{m}`` that does not exist.)

The *times* are ours: an op starts once its rank is free and its input exists, and lasts its
:class:`OpCosts`. On one stage and microbatch, ``F`` waits for the previous stage's ``F``; ``B``
(input gradient) or ``BW`` (full backward: input and weight gradient in one op) waits for the next
stage's input gradient, or for the same stage's ``F`` on the last stage (the loss); ``W`` (weight
gradient) waits for the same stage's ``B``. A producer on another rank adds ``OpCosts.p2p``.
DualPipeV's ``OVERLAP_F_B`` is its forward then its backward, each waiting for its own input, as
torch's runtime runs it.

Bubble, in the playbook's unit (HF Ultra-Scale Playbook, "Pipeline parallelism"): idle over compute
time of a rank, ``r_bubble = (makespan - busy) / busy``. Every rank holds ``v`` stages of equal cost,
so ``busy = m v (F + B + W)`` on every rank and ``r_bubble`` is the same on all of them.
:func:`bubble_formula` gives the closed forms for ``p`` ranks, ``m`` microbatches, ``v`` stages per
rank and per-stage costs ``F``, ``B``, ``W`` (``p2p = 0``); the simulator meets each exactly except
where noted:

================  ======================================  ============================================
schedule          bubble time per rank                    source, and what torch's order achieves
================  ======================================  ============================================
afab, 1f1b        (p-1)(F+B+W)  -> r = (p-1)/m            Playbook (GPipe; PipeDream-Flush 1F1B)
interleaved_1f1b  (p-1)(F+B+W)  -> r = (p-1)/(v m)        Playbook; Narayanan et al. 2021
looped_bfs        (p-1)(F+B+W)  -> r = (p-1)/(v m)        as interleaved (Lamy-Poirier, arXiv 2211.05953)
zero_bubble       (p-1) max(F, B, F+B-W)                  ZB-H1 (Qi et al. 2023, section 2): (p-1)(F+B-W)
                                                          for W <= F, B: 1/3 of 1F1B's at F = B = W.
                                                          Heavier W: torch's order keeps the fill
                                                          (p-1)F or the drain (p-1)B (measured, any v)
zbv               (p-1)F                                  ZB-V (Qi et al., section 6): zero bubble at
                                                          F = B = W, counting with the next step
                                                          overlapping this one; one synchronous step
                                                          keeps the fill (p-1)F, which no schedule
                                                          avoids. torch's fixed order does worse when
                                                          the costs differ (its docstring says so)
dualpipev         (p-1)(F&B + (B+W) - 3W), F&B = F+B+W    DeepSeek-V3 report Table 2 and the DualPipe
                                                          docs (DualPipeV on PP/2 = p ranks), with
                                                          the overlapped pair as one block. torch runs
                                                          the pair's halves in turn, each waiting only
                                                          for its own input: at F = B = W it gets
                                                          (p-1)F, half the formula
================  ======================================  ============================================

Activations (:meth:`Timeline.peak_activations`) count the ``(stage, microbatch)`` pairs a rank
holds, from the end of their forward to the end of the op that frees them; one pair is ``1/v`` of a
rank's layers. For a split backward that op is ``W``: torch frees the stage's input and output
after ``B``, but ``W`` still needs the input of every linear layer, most of a block's saved
activations (the ZB paper's ``M_W``), so the count is an upper bound there. Peaks on rank ``r``
(``m >= p``; ``m >= 2p`` for zbv):

- afab ``m``; 1f1b ``p - r`` (the playbook: ``p`` on rank 0);
- interleaved_1f1b ``min(m v, (v-1) m_r + 2(p-1-r) + 1)`` with torch's round ``m_r = m // (m // p)``
  (Megatron's warm-up): ``v p + p - 1`` on rank 0, i.e. ``p + (p-1)/v`` microbatches of the rank's
  layers (Korthikanti et al. 2022, section 4.2.3); looped_bfs ``m v``;
- zero_bubble (v = 1) ``p`` on every rank (ZB-H1: 1F1B's peak, on all ranks); zbv ``2p`` on every
  rank (ZB-V: 1F1B's peak in layers, balanced); dualpipev ``2p + 1`` (DeepSeek: ``PP + 1``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from lightning_ultrascale.errors import ConfigError, require_positive_int
from lightning_ultrascale.parallel.pipeline.schedules import (
    SCHEDULES,
    resolve_virtual_stages,
    schedule_info,
    stage_ranks,
    validate_microbatches,
)

#: ``F`` forward, ``B`` input gradient, ``W`` weight gradient, ``BW`` both in one op.
KINDS: tuple[str, ...] = ("F", "B", "W", "BW")
#: torch's ``_ComputationType`` values for compute, in our kinds.
_TORCH_KINDS = {"F": "F", "I": "B", "W": "W", "B": "BW"}

Action = tuple[int, str, int]  # (stage, kind, microbatch)


@dataclass(frozen=True)
class OpCosts:
    """Time of one microbatch through one stage (one virtual chunk), in any unit."""

    forward: float = 1.0
    backward_input: float = 1.0
    #: Schedules that do not split the backward run ``backward_input + backward_weight`` as one op.
    backward_weight: float = 1.0
    #: Latency of one send between ranks; the playbook's formulas assume 0.
    p2p: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward_input", "backward_weight", "p2p"):
            if getattr(self, name) < 0:
                raise ConfigError(f"OpCosts.{name}={getattr(self, name)!r} must be >= 0")
        if self.forward + self.backward_input + self.backward_weight <= 0:
            raise ConfigError("OpCosts: forward + backward_input + backward_weight must be > 0")

    def duration(self, kind: str) -> float:
        if kind == "BW":
            return self.backward_input + self.backward_weight
        return {"F": self.forward, "B": self.backward_input, "W": self.backward_weight}[kind]


@dataclass(frozen=True)
class Op:
    """One compute op of the timeline."""

    rank: int
    stage: int
    microbatch: int
    kind: str
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """The simulated run of one training step's pipeline."""

    schedule: str
    p: int
    m: int
    v: int
    costs: OpCosts
    ops: tuple[Op, ...]

    @property
    def makespan(self) -> float:
        return max(op.end for op in self.ops)

    def rank_ops(self, rank: int) -> list[Op]:
        """The ops of ``rank``, in the order it runs them."""
        return [op for op in self.ops if op.rank == rank]  # simulate() appends them in that order

    def compute_time(self, rank: int) -> float:
        return sum(op.end - op.start for op in self.ops if op.rank == rank)

    def idle_time(self, rank: int) -> float:
        return self.makespan - self.compute_time(rank)

    @property
    def bubble_ratio(self) -> float:
        """The playbook's ``r_bubble``: idle over compute time, of the busiest rank (all are equally busy)."""
        busy = max(self.compute_time(r) for r in range(self.p))
        return (self.makespan - busy) / busy

    @property
    def bubble_fraction(self) -> float:
        """Share of the step a rank idles: ``r / (1 + r)``."""
        busy = max(self.compute_time(r) for r in range(self.p))
        return (self.makespan - busy) / self.makespan

    def peak_activations(self, rank: int) -> int:
        """Most ``(stage, microbatch)`` activations ``rank`` holds at once (freed by ``W`` or ``BW``)."""
        return self._held(rank)[0]

    def peak_moment(self, rank: int) -> float:
        """The last instant at which ``rank`` holds :meth:`peak_activations` (what it has sent by then
        may still be alive: the latest such instant is the worst)."""
        return self._held(rank)[1]

    def _held(self, rank: int) -> tuple[int, float]:
        ops = self.rank_ops(rank)
        freed = {(op.stage, op.microbatch): op.end for op in ops if op.kind in ("W", "BW")}
        ends = [(op.end, freed[op.stage, op.microbatch]) for op in ops if op.kind == "F"]
        # The count only grows when a forward ends, so the peak is at one of those instants.
        return max((sum(1 for made, gone in ends if made <= t < gone), t) for t, _ in ends)

    def gradients_sent_before(self, rank: int, t: float) -> int:
        """Input gradients ``rank`` has sent back by ``t``: backwards (``B``, ``BW``) of stages past the first."""
        return sum(1 for op in self.rank_ops(rank) if op.kind in ("B", "BW") and op.stage > 0 and op.end <= t)

    def _label(self, op: Op) -> str:
        # torch's notation ("4F3": stage 4, forward, microbatch 3) where a rank holds several stages.
        return f"{op.stage if self.v > 1 else ''}{op.kind}{op.microbatch}"

    def render_text(self, unit: float | None = None) -> str:
        """One line per rank; a cell is ``unit`` of time (default: the shortest op), ``.`` is idle.

        Example (``simulate("1f1b", 2, 3, costs=OpCosts(1, 1, 0))``)::

            rank 0 | F0  F1  .   BW0 F2  BW1 .   BW2
            rank 1 | .   F0  BW0 F1  BW1 F2  BW2 .
        """
        if unit is None:
            unit = min(d for d in (op.end - op.start for op in self.ops) if d > 0)
        width = max(len(self._label(op)) for op in self.ops) + 1
        total = round(self.makespan / unit)
        lines = []
        for rank in range(self.p):
            cells: list[str] = []
            for op in self.rank_ops(rank):
                first, last = round(op.start / unit), round(op.end / unit)
                if last > first:  # an op shorter than half a cell is not drawn
                    cells += ["."] * (first - len(cells))
                    cells += [self._label(op)] + ["-" * (width - 1)] * (last - first - 1)
            cells += ["."] * (total - len(cells))
            lines.append(f"rank {rank} | " + "".join(c.ljust(width) for c in cells).rstrip())
        return "\n".join(lines)

    def render_png(self, path: str | Path) -> None:
        """Draw the timeline (one row per rank, one bar per op) into ``path``; needs matplotlib."""
        try:
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as err:
            raise ImportError(
                "Timeline.render_png needs matplotlib: pip install matplotlib "
                "(or pip install 'lightning-ultrascale[plot]')"
            ) from err
        colors = {"F": "#4c78a8", "B": "#54a24b", "W": "#b5cf6b", "BW": "#f58518"}
        unit = min(d for d in (op.end - op.start for op in self.ops) if d > 0)
        fig = Figure(figsize=(min(60.0, max(6.0, 0.35 * self.makespan / unit)), 0.6 * self.p + 1))
        ax = fig.subplots()
        for op in self.ops:
            ax.barh(op.rank, op.end - op.start, left=op.start, color=colors[op.kind], edgecolor="black", lw=0.5)
            ax.text((op.start + op.end) / 2, op.rank, self._label(op), ha="center", va="center", fontsize=6)
        ax.set_yticks(range(self.p), [f"rank {r}" for r in range(self.p)])
        ax.invert_yaxis()
        ax.set_xlim(0, self.makespan)
        ax.set_xlabel("time")
        ax.set_title(f"{self.schedule}: p={self.p} m={self.m} v={self.v}, bubble {self.bubble_ratio:.3f} of compute")
        kinds = sorted({op.kind for op in self.ops}, key=KINDS.index)
        ax.legend(handles=[Patch(color=colors[k], label=k) for k in kinds], loc="upper left", bbox_to_anchor=(1, 1))
        fig.savefig(path, bbox_inches="tight", dpi=120)


def _check(schedule: str, p: int, m: int, v: int | None) -> int:
    """The stages per rank, after the checks the runtime plugin makes (same messages)."""
    schedule_info(schedule)
    require_positive_int("PipelineParallel", "size", p)
    v = resolve_virtual_stages(schedule, v)
    validate_microbatches(schedule, p, v, m)
    return v


def _single_stage_order(schedule: str, p: int, m: int, rank: int) -> list[Action]:
    # Mirrors ScheduleGPipe / Schedule1F1B._step_microbatches: 1F1B warms up with p - rank forwards.
    if schedule == "afab":
        return [(rank, "F", i) for i in range(m)] + [(rank, "BW", i) for i in range(m)]
    warmup = min(m, p - rank)
    order = [(rank, "F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [(rank, "BW", i), (rank, "F", warmup + i)]
    return order + [(rank, "BW", i) for i in range(m - warmup, m)]


@functools.lru_cache(maxsize=64)
def torch_order(schedule: str, p: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's compute actions ``(stage, kind, microbatch)``, in the order torch runs them."""
    info = schedule_info(schedule)
    if not info.multi:
        return tuple(tuple(_single_stage_order(schedule, p, m, r)) for r in range(p))
    from unittest import mock

    from torch.distributed.pipelining.schedules import get_schedule_class
    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.num_stages, stage.submod = 0, p, p * v, None
    pipeline_order = get_schedule_class(info.torch_class)([stage] * v, m).pipeline_order
    orders = []
    for rank in range(p):
        actions = []
        for action in pipeline_order[rank]:
            if action is None:
                continue
            for sub in action.sub_actions or (action,):  # OVERLAP_F_B runs its parts in turn
                if sub.computation_type.value in _TORCH_KINDS:
                    actions.append((sub.stage_index, _TORCH_KINDS[sub.computation_type.value], sub.microbatch_index))
        orders.append(tuple(actions))
    return tuple(orders)


def _dependency(stage: int, kind: str, microbatch: int, n_stages: int) -> tuple[str, int, int] | None:
    # Keys name a result: ("F", s, i) stage s's output, ("B", s, i) the gradient of s's input.
    if kind == "F":
        return ("F", stage - 1, microbatch) if stage > 0 else None
    if kind == "W":
        return ("B", stage, microbatch)
    return ("F", stage, microbatch) if stage == n_stages - 1 else ("B", stage + 1, microbatch)


def simulate(schedule: str, p: int, m: int, v: int | None = None, costs: OpCosts | None = None) -> Timeline:
    """Time torch's order of ``schedule`` on ``p`` ranks, ``m`` microbatches, ``v`` stages per rank.

    Example:
        >>> simulate("1f1b", p=4, m=8).bubble_ratio  # (p - 1) / m
        0.375
    """
    v = _check(schedule, p, m, v)
    costs = costs or OpCosts()
    orders = torch_order(schedule, p, m, v)
    placement = stage_ranks(schedule, p, v)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    nxt = [0] * p
    ops: list[Op] = []
    while any(nxt[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for rank in range(p):
            while nxt[rank] < len(orders[rank]):
                stage, kind, mb = orders[rank][nxt[rank]]
                dep = _dependency(stage, kind, mb, p * v)
                if dep is not None and dep not in done:
                    break
                start = free[rank]
                if dep is not None:
                    start = max(start, done[dep] + (costs.p2p if placement[dep[1]] != rank else 0.0))
                free[rank] = start + costs.duration(kind)
                done["B" if kind == "BW" else kind, stage, mb] = free[rank]
                ops.append(Op(rank, stage, mb, kind, start, free[rank]))
                nxt[rank] += 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][nxt[r]] for r in range(p) if nxt[r] < len(orders[r])}
            raise RuntimeError(f"{schedule} p={p} m={m} v={v} deadlocks; waiting ops per rank: {stuck}")
    return Timeline(schedule, p, m, v, costs, tuple(ops))


def bubble_formula(schedule: str, p: int, m: int, v: int | None = None, costs: OpCosts | None = None) -> float:
    """The literature's bubble for ``schedule``, in :attr:`Timeline.bubble_ratio`'s unit (p2p = 0)."""
    v = _check(schedule, p, m, v)
    costs = costs or OpCosts()
    f, b, w = costs.forward, costs.backward_input, costs.backward_weight
    busy = m * v * (f + b + w)
    bubble = {
        "afab": (p - 1) * (f + b + w),
        "1f1b": (p - 1) * (f + b + w),
        "interleaved_1f1b": (p - 1) * (f + b + w),
        "looped_bfs": (p - 1) * (f + b + w),
        "zero_bubble": (p - 1) * max(f, b, f + b - w),
        "zbv": (p - 1) * f,
        "dualpipev": (p - 1) * ((f + b + w) + (b + w) - 3 * w),
    }[schedule]
    return bubble / busy


@dataclass(frozen=True)
class ScheduleFacts:
    """What the planner reads of a schedule's simulated timeline (unit costs)."""

    bubble: float  # the playbook's r_bubble: idle over compute time
    peak_activations: tuple[int, ...]  # per pp rank: (stage, microbatch) activations held at once
    stages_per_rank: int
    #: per pp rank: the input gradients it has sent back by its activations' peak moment
    gradients_sent_at_peak: tuple[int, ...] = ()

    def in_flight(self, pp_rank: int) -> float:
        """Microbatches' worth of the rank's activations held at once (its peak over its stages)."""
        return self.peak_activations[pp_rank] / self.stages_per_rank


@functools.lru_cache(maxsize=1024)
def schedule_facts(schedule: str, p: int, m: int, v: int | None = None) -> ScheduleFacts:
    """The bubble, activation peaks and stages per rank of a schedule, simulated once per arguments.

    Example:
        >>> schedule_facts("1f1b", 4, 8).bubble
        0.375
    """
    v = resolve_virtual_stages(schedule, v)
    stages_per_rank = v if schedule_info(schedule).multi else 1
    timeline = simulate(schedule, p, m, v if stages_per_rank > 1 else None)
    peaks = tuple(timeline.peak_activations(r) for r in range(p))
    sent = tuple(timeline.gradients_sent_before(r, timeline.peak_moment(r)) for r in range(p))
    return ScheduleFacts(timeline.bubble_ratio, peaks, stages_per_rank, sent)


__all__ = [
    "KINDS", "SCHEDULES", "Op", "OpCosts", "ScheduleFacts", "Timeline", "bubble_formula", "schedule_facts", "simulate",
    "torch_order",
]  # fmt: skip
