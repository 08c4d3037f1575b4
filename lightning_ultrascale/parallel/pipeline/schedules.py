"""The pipeline schedules we expose, by the playbook's names, and what each needs.

Every schedule runs through ``torch.distributed.pipelining`` (all of them are correct on CPU with
gloo and on GPU with NCCL in the torch versions we support). This table is pure Python: the
strategy checks a layout against it before any process group exists.

- ``afab`` (torch ``GPipe``), 1 stage per rank: bubble (p-1)/m, holds m microbatches' activations;
- ``1f1b`` (``1F1B``), 1 stage per rank: bubble (p-1)/m, holds p;
- ``interleaved_1f1b`` (``Interleaved1F1B``), v looped stages per rank (default 2): (p-1)/(v m);
- ``looped_bfs`` (``LoopedBFS``), v looped stages (default 2): breadth-first over the stages;
- ``zero_bubble`` (``InterleavedZeroBubble``), v looped stages (default 1, ZB-H1): backward split
  into input (B) and weight (W) gradients, W filling the bubble;
- ``zbv`` (``ZBVZeroBubble``), 2 V-shaped stages per rank: zero bubble in steady state;
- ``dualpipev`` (``DualPipeV``), 2 V-shaped stages: DeepSeek's DualPipe on p ranks.

"Looped" puts stage ``s`` on rank ``s mod p``; "V-shape" puts stages ``r`` and ``2p-1-r`` on rank
``r``, so the first and the last stage share rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_ultrascale.errors import ConfigError, option, require_positive_int

_OWNER = "PipelineParallel"


@dataclass(frozen=True)
class ScheduleInfo:
    """What a schedule is in torch, and which layouts it can run."""

    torch_class: str
    #: ``"single"`` (one stage per rank), ``"loop"`` or ``"v"`` (placement of virtual stages).
    placement: str
    default_virtual: int
    #: Microbatches must be at least this many times the number of stages (1F1B, DualPipeV) or of
    #: ranks (the others).
    min_microbatches_per: str
    summary: str

    @property
    def multi(self) -> bool:
        return self.placement != "single"


#: Schedules that run a stage's backward as two ops (input gradients, then weight gradients).
SPLIT_BACKWARD = frozenset({"zero_bubble", "zbv", "dualpipev"})

SCHEDULES: dict[str, ScheduleInfo] = {
    "afab": ScheduleInfo("GPipe", "single", 1, "rank", "all forwards, then all backwards (GPipe)"),
    "1f1b": ScheduleInfo("1F1B", "single", 1, "stage", "one forward, one backward in steady state"),
    "interleaved_1f1b": ScheduleInfo(
        "Interleaved1F1B", "loop", 2, "rank", "1F1B over v looped virtual stages per rank"
    ),
    "looped_bfs": ScheduleInfo("LoopedBFS", "loop", 2, "rank", "breadth-first over looped virtual stages"),
    "zero_bubble": ScheduleInfo(
        "InterleavedZeroBubble", "loop", 1, "rank", "backward split into input and weight gradients (ZB-H1)"
    ),
    "zbv": ScheduleInfo("ZBVZeroBubble", "v", 2, "rank", "zero bubble with V-shaped stage placement"),
    "dualpipev": ScheduleInfo("DualPipeV", "v", 2, "stage", "DualPipe on a V of 2 stages per rank"),
}


def schedule_info(name: str) -> ScheduleInfo:
    """The schedule's entry, or a ConfigError that lists the valid names."""
    if name not in SCHEDULES:
        raise ConfigError(f"{option(_OWNER, 'schedule', name)} is unknown; valid: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def resolve_virtual_stages(name: str, virtual_stages: int | None) -> int:
    """Stages per rank for ``name``: the schedule's default, or ``virtual_stages`` if it allows it."""
    info = schedule_info(name)
    if virtual_stages is None:
        return info.default_virtual
    require_positive_int(_OWNER, "virtual_stages", virtual_stages)
    if info.placement in ("single", "v") and virtual_stages != info.default_virtual:
        raise ConfigError(
            f"{option(_OWNER, 'virtual_stages', virtual_stages)} does not fit {option(_OWNER, 'schedule', name)}, "
            f"which runs exactly {info.default_virtual} stage(s) per rank; valid: {info.default_virtual} "
            "(or a looped schedule: "
            f"{', '.join(n for n, i in SCHEDULES.items() if i.placement == 'loop')})"
        )
    return virtual_stages


def validate_microbatches(name: str, pp: int, virtual_stages: int, microbatches: int) -> None:
    """Check ``microbatches`` against the schedule's minimum and torch's divisibility rules."""
    info = schedule_info(name)
    require_positive_int(_OWNER, "microbatches", microbatches)
    stages = pp * virtual_stages
    minimum = stages if info.min_microbatches_per == "stage" else pp
    if microbatches < minimum:
        if info.min_microbatches_per == "stage":
            per = f"the number of stages (pp x virtual stages = {pp} x {virtual_stages})"
        else:
            per = "pp"
        raise ConfigError(
            f"{option(_OWNER, 'microbatches', microbatches)} is fewer than {per} = {minimum}, the minimum of "
            f"{option(_OWNER, 'schedule', name)}; valid: {minimum} or more (more microbatches, smaller bubble)"
        )
    if info.torch_class in ("Interleaved1F1B", "InterleavedZeroBubble"):
        # torch runs these in rounds of m // p microbatches; m must split evenly into them.
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            valid = [r * pp for r in range(1, 4)]
            raise ConfigError(
                f"{option(_OWNER, 'microbatches', microbatches)} must be a multiple of its rounds "
                f"(m // pp = {rounds}) for {option(_OWNER, 'schedule', name)}; "
                f"valid: {', '.join(map(str, valid))}, ... (multiples of pp={pp})"
            )


def stage_ranks(name: str, pp: int, virtual_stages: int) -> list[int]:
    """The pipeline rank that holds each stage, in stage order.

    Example:
        >>> stage_ranks("interleaved_1f1b", 2, 2), stage_ranks("zbv", 2, 2)
        ([0, 1, 0, 1], [0, 1, 1, 0])
    """
    info = schedule_info(name)
    if info.placement == "v":
        return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    return [s % pp for s in range(pp * virtual_stages)]
