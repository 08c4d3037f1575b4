"""PipelineParallel: the playbook's pipeline parallelism inside Lightning's training loop.

The model's blocks are split into ``pp x v`` stages (``v`` virtual stages per rank for the
interleaved and V-shaped schedules); a rank builds only its stages (the split happens on the
meta device). Every batch is cut into ``microbatches``; a ``torch.distributed.pipelining``
schedule runs their forwards and backwards across the ranks, the activations and their
gradients travelling point to point between neighbouring stages.

The plugin splits the model and tells the Layout what this rank holds; its step runner
(``step.py``) runs the schedule in place of the LightningModule's ``training_step`` (which would
run the whole model on one rank), so the module provides the loss instead:

* ``loss_fn(logits, labels) -> Tensor``: the mean loss over the tokens whose label is not -100,
  computed on the last stage for each microbatch (where a module that logs its loss counts it:
  ``LlamaModule`` sums it over the global batch after each optimizer step).

Each microbatch's loss is weighted by its share of the batch's tokens, so gradients equal those
of one pass over the whole batch for any number of microbatches (``scale_grads=False`` in torch's
terms). Lightning's automatic optimisation keeps working: optimizer step, gradient clipping
(the norm is summed over the stages), LR schedulers, gradient accumulation on top of the
microbatches, validation (a forward-only schedule) and checkpoints.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_ultrascale.errors import ConfigError, divisors, option, require_positive_int
from lightning_ultrascale.models.spec import ModelSpec, StagedModel, declares, require_spec
from lightning_ultrascale.parallel.dims import DataShape, ParallelDims
from lightning_ultrascale.parallel.layout import Layout, ShardPlan
from lightning_ultrascale.parallel.pipeline.schedules import (
    SPLIT_BACKWARD,
    resolve_virtual_stages,
    schedule_info,
    stage_ranks,
    validate_microbatches,
)
from lightning_ultrascale.parallel.pipeline.simulator import schedule_facts
from lightning_ultrascale.parallel.pipeline.split import plan_stages, stages_from_split_points
from lightning_ultrascale.parallel.pipeline.stage import StageModule, prune_to_stages
from lightning_ultrascale.parallel.pipeline.step import PipelineStep
from lightning_ultrascale.parallel.plugin import ParallelPlugin
from lightning_ultrascale.parallel.pricing import (
    CostTerms,
    NotSearched,
    PlanAxis,
    RankView,
    SearchContext,
    SearchPoint,
)
from lightning_ultrascale.parallel.tied import TiedCopy, TiedGroup, find_tied
from lightning_ultrascale.utils.memo import memoized


class PipelineParallel(ParallelPlugin):
    """Pipeline parallelism over the ``pp`` mesh dim with a named schedule.

    Args:
        size: pipeline ranks (``pp``).
        schedule: ``"afab"`` (GPipe), ``"1f1b"``, ``"interleaved_1f1b"``, ``"looped_bfs"``,
            ``"zero_bubble"``, ``"zbv"`` or ``"dualpipev"``
            (see :mod:`lightning_ultrascale.parallel.pipeline.schedules`).
        microbatches: microbatches per batch (default: the number of stages, the fewest every
            schedule accepts). More microbatches, smaller bubble: ``(pp-1)/microbatches`` for 1F1B.
        virtual_stages: stages per rank (interleaved / looped schedules; default 2 for them, 1
            for ``zero_bubble``; V-shaped schedules always use 2).
        split_points: module names before which a stage begins (``["layers.10", "layers.20"]``),
            ``pp x virtual_stages - 1`` of them; default: balance the stages' compute, the
            embedding and the head counted.

    Example:
        >>> from lightning_ultrascale import PipelineParallel, UltraScaleStrategy, ZeRO
        >>> strategy = UltraScaleStrategy(PipelineParallel(4, "interleaved_1f1b", microbatches=16), ZeRO(stage=1))
    """

    applies_at = "pipeline"
    plan_order = 20
    plan_names = ("pp", "schedule", "microbatches", "virtual_stages")
    #: the most microbatches the planner splits a rank's samples into
    plan_max_microbatches = 64

    def __init__(
        self,
        size: int,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        virtual_stages: int | None = None,
        split_points: Sequence[str] | None = None,
    ) -> None:
        require_positive_int(self, "size", size)
        if microbatches is not None:  # checked even when the pipeline is off (size 1)
            require_positive_int(self, "microbatches", microbatches)
        self.info = schedule_info(schedule)
        self.size = size
        self.schedule = schedule
        self.virtual_stages = resolve_virtual_stages(schedule, virtual_stages)
        self.n_stages = size * self.virtual_stages
        self.microbatches = self.n_stages if microbatches is None else microbatches
        if size > 1:
            validate_microbatches(schedule, size, self.virtual_stages, self.microbatches)
        self.split_points = list(split_points) if split_points is not None else None
        self.stage_ranks = stage_ranks(schedule, size, self.virtual_stages)
        self.step_runner = PipelineStep(self) if size > 1 else None
        # What apply() found out about this rank's part of the pipeline:
        self.model: nn.Module | None = None
        self.spec: ModelSpec | None = None
        self.ranges: list[range] = []
        self.local: list[int] = []  # the stages this rank runs
        self.group: dist.ProcessGroup | None = None
        self.stages: list[StageModule] = []
        self._mtp_depth = 0  # the model's multi-token prediction depth (validate's, for validate_with)

    # ----------------------------------------------------------------------------- configuration
    @property
    def splits_backward(self) -> bool:
        """Runs each backward as two ops (input gradients, then weight gradients): zero-bubble schedules."""
        return self.size > 1 and self.schedule in SPLIT_BACKWARD

    @property
    def active(self) -> bool:
        return self.size > 1

    def mesh_sizes(self) -> dict[str, int | None]:
        return {"pp": self.size}

    def settings(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "microbatches": self.microbatches, "virtual_stages": self.virtual_stages}

    def validate(self, dims: ParallelDims, spec: ModelSpec, data: DataShape | None) -> None:
        self._mtp_depth = spec.mtp_depth
        if spec.n_layers < self.n_stages:
            raise ConfigError(
                f"{option(self, 'size', self.size)} x {option(self, 'virtual_stages', self.virtual_stages)} = "
                f"{self.n_stages} stages, but model {spec.name} has n_layers={spec.n_layers}: every stage needs a "
                f"block; valid: pp x virtual stages <= {spec.n_layers}"
            )
        if self.split_points is not None:
            stages_from_split_points(spec, self.split_points, self.n_stages)
        if data is not None and self.size > 1 and data.micro_batch_size % self.microbatches:
            valid = [d * self.microbatches for d in (1, 2, 3)]
            raise ConfigError(
                f"{data.option('micro_batch_size')} (the batch each data-parallel rank runs per step) must be "
                f"divisible by {option(self, 'microbatches', self.microbatches)}: the global batch must be a "
                f"multiple of dp x microbatches; valid micro_batch_size: {', '.join(map(str, valid))}, ... "
                f"(or microbatches among the divisors {', '.join(map(str, divisors(data.micro_batch_size)))})"
            )

    def validate_with(self, plugins: Sequence[ParallelPlugin]) -> None:
        sharded = [p for p in plugins if type(p).__name__ == "ZeRO" and getattr(p, "stage", 0) == 3]
        if self.size > 1 and self._mtp_depth and self.stage_ranks[0] == self.stage_ranks[-1] and sharded:
            # Both of the rank's stages run the embedding module, and FSDP2 lets a module belong to one root unit.
            raise ConfigError(
                f"{option(self, 'schedule', self.schedule)} with model.mtp_depth={self._mtp_depth} and "
                f"{sharded[0]!r}: the V-shaped schedule puts the first and the last stage on one rank, both run the "
                "embedding (multi-token prediction reads it on the last stage), and FSDP2 shards a module for one "
                "stage only; valid: schedule 1f1b, interleaved_1f1b or zero_bubble, or ZeRO stage 0-2"
            )

    # ----------------------------------------------------------------------------- model
    def apply(self, model: nn.Module, layout: Layout) -> nn.Module:
        spec = require_spec(model)
        if not declares(model, StagedModel):
            raise TypeError(
                f"{type(model).__name__} has no forward_stage(x, position_ids, blocks, embed=, head=); "
                "pipeline parallelism runs the model stage by stage through it (see models/common/decoder.py)"
            )
        pp_mesh = layout.mesh["pp"]
        self.group = pp_mesh.get_group()
        pp_rank = pp_mesh.get_local_rank()
        self.ranges = plan_stages(model, spec, self.n_stages, self.split_points)
        self.local = [s for s, r in enumerate(self.stage_ranks) if r == pp_rank]
        last = self.n_stages - 1
        kept = {b for s in self.local for b in self.ranges[s]}
        # Multi-token prediction's embedding is held on the first and the last stage: one name, two ranks.
        embedding = [n for n, _ in model.named_parameters() if n.startswith(f"{spec.embedding}.")]
        shared = [(n,) for n in embedding if spec.mtp_depth and not any(n in group for group in layout.tied)]
        layout.dropped |= prune_to_stages(model, spec, kept, first=0 in self.local, last=last in self.local)
        self._tie_across_ranks(layout, [*layout.tied, *shared], spec, pp_rank)
        self.model, self.spec = model, spec
        self.stages = [StageModule(model, spec, s, self.ranges[s], first=s == 0, last=s == last) for s in self.local]
        # Facts for the plugins after this one: FSDP roots, parameters re-gathered per microbatch,
        # sharded states keyed per stage, and the gradient norm summed over the stages.
        layout.parts = list(self.stages)
        layout.forwards_per_step = self.microbatches
        layout.part_name = f"pp{pp_rank}"
        layout.grad_norm.across.append(self.group)
        return model

    @classmethod
    def plan_axes(cls, context: SearchContext) -> tuple[PlanAxis, ...]:
        """Stages: powers of two, and any other count that splits the blocks evenly (pp9 for 126 blocks),
        up to 32; schedules: 1F1B, interleaved 1F1B and ZBV, with as many microbatches as the batch allows."""
        layers = context.n_layers
        sizes = [p for p in range(1, min(layers, 32, context.world_size) + 1) if layers % p == 0 or p & (p - 1) == 0]
        schedules = ("1f1b", "interleaved_1f1b", "zbv")
        return PlanAxis("pp", tuple(sizes), splits_world=True), PlanAxis("schedule", schedules)

    @classmethod
    def plan_plugin(cls, point: SearchPoint) -> PipelineParallel | None:
        size, schedule = point.get("pp", 1), point.get("schedule", "1f1b")
        if size == 1:
            if point.axes and schedule != point.axes["schedule"][0]:
                raise NotSearched("a schedule without a pipeline")  # (the same layout as the first)
            return None
        microbatches = point.get("microbatches")
        samples = point.samples_per_rank
        if samples is not None and microbatches is None:
            microbatches = _most_microbatches(samples // point.micro_batch_size, size, cls.plan_max_microbatches)
            if microbatches is None:
                raise NotSearched(f"no multiple of pp={size} splits {samples} samples per data rank")
        return cls(size, schedule, microbatches, point.get("virtual_stages"))

    def plan_label(self, dims: ParallelDims) -> str:
        own = self.virtual_stages != resolve_virtual_stages(self.schedule, None)
        v = f",v{self.virtual_stages}" if own else ""
        return f"pp{self.size}({self.schedule}{v},m{self.microbatches})"

    def plan_shards_key(self) -> tuple[Any, ...]:
        return self.size, self.schedule, self.virtual_stages, tuple(self.split_points or ())

    def plan_facts(self, dims: ParallelDims) -> dict[str, Any]:
        on = self.size > 1
        timeline = schedule_facts(self.schedule, self.size, self.microbatches, self.virtual_stages) if on else None
        return {"pp": self.size, "schedule": self.schedule, "virtual_stages": self.virtual_stages,
                "microbatches": self.microbatches, "timeline": timeline}  # fmt: skip

    def plan_cost(self, rank: RankView) -> CostTerms:
        """The bubble of the simulated schedule; each stage's output forward and input gradient back.

        Every stage on the rank sends its output (not the last stage) and its input's gradient
        (not the first): ``t x h`` activations per microbatch, on the critical path.
        """
        terms = CostTerms(host=f"pipeline_{self.schedule}")  # (its runtime's)
        timeline = schedule_facts(self.schedule, self.size, self.microbatches, self.virtual_stages)
        terms.bubble = timeline.bubble
        s = rank.widths
        boundary = rank.tokens * s.h / s.sp * rank.element_bytes * rank.forwards
        sends = 2 * timeline.stages_per_rank - (1 if rank.last else 0) - (1 if rank.first else 0)
        terms.add("pp", "send", sends * boundary, calls=sends * rank.forwards)
        terms.add("pp", "recv", sends * boundary, calls=sends * rank.forwards)
        return terms

    def plan_shards(self, model: nn.Module, plan: ShardPlan) -> None:
        spec = require_spec(model)
        splits = tuple(self.split_points or ())
        ranges = memoized(
            ("stages", id(model), self.n_stages, splits),
            lambda: plan_stages(model, spec, self.n_stages, self.split_points),
        )
        rank = plan.coordinate["pp"]
        key = ("pp-holders", id(model), self.plan_shards_key())
        named = memoized(key, lambda: {n: self._holders(spec, ranges, n) for n, _ in model.named_parameters()})
        holders = lambda name: named.get(name) or self._holders(spec, ranges, name)  # noqa: E731
        # A rank without a tied weight's first name holds a copy of its own.
        for group in memoized(("tied", id(model)), lambda: find_tied(model)):
            copy = next((n for n in group if rank in holders(n)), group[0])
            if copy != group[0]:
                plan.shapes[copy] = plan.shapes[group[0]]
        for name in list(plan.shapes):
            if rank not in holders(name):
                del plan.shapes[name]

    def _holders(self, spec: ModelSpec, ranges: Sequence[range], name: str) -> set[int]:
        """The pipeline ranks that hold parameter ``name`` (what :func:`prune_to_stages` leaves them)."""
        blocks, first, last = f"{spec.layers}.", self.stage_ranks[0], self.stage_ranks[-1]
        if name.startswith(blocks):
            block = int(name[len(blocks) :].split(".")[0])
            if block >= spec.n_layers:  # multi-token prediction's
                return {last}
            return {self.stage_ranks[s] for s, r in enumerate(ranges) if block in r}
        if name.startswith(f"{spec.embedding}."):  # (multi-token prediction embeds on the last stage too)
            return {first, last} if spec.mtp_depth else {first}
        if name.startswith((f"{spec.final_norm}.", f"{spec.head}.")):
            return {self.stage_ranks[-1]}
        return set(range(self.size))  # outside the pieces a pipeline splits: kept on every rank

    def _tie_across_ranks(self, layout: Layout, groups: Sequence[TiedGroup], spec: ModelSpec, pp_rank: int) -> None:
        """A tied weight whose names land on several pipeline ranks (the embedding on the first stage,
        the head on the last; multi-token prediction's embedding on both): one copy per rank, equal by
        construction (Megatron's "embedding group").

        The rank holding its first name holds the original; the copies' gradients are summed
        before each optimizer step, and the gradient norm counts the original only. Every rank
        creates every group, in the same order (``new_group`` is collective).
        """
        ranks = layout.mesh.root.mesh  # [pp, dp_replicate, dp_shard, cp, tp] -> global rank
        for group in groups:
            holders = {name: self._holders(spec, self.ranges, name) for name in group}
            pp_ranks = sorted(set().union(*holders.values()))
            if len(pp_ranks) < 2:
                continue
            source = min(holders[group[0]])
            mine = next((name for name in group if pp_rank in holders[name]), None)
            for index in itertools.product(*(range(n) for n in ranks.shape[1:])):
                members = [int(ranks[(p, *index)]) for p in pp_ranks]
                process_group = dist.new_group(members)
                if dist.get_rank() in members and mine is not None:
                    copy = TiedCopy(mine, process_group, int(ranks[(source, *index)]))
                    layout.tied_copies.append(copy)
                    if not copy.is_source:
                        layout.grad_norm.skip.add(mine)


def _most_microbatches(samples: int, pp: int, cap: int) -> int | None:
    """Most microbatches (a multiple of ``pp``, at most ``cap``) that split a rank's samples evenly."""
    best = None
    for m in range(pp, min(samples, max(cap, pp)) + 1, pp):
        if samples % m == 0:
            best = m
    return best
