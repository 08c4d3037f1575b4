"""The cost model: per-rank memory, communication and step time of one layout, from formulas alone.

**Memory.** A rank's peak is its static state plus the largest of two moments of the backward pass:

- static: parameters, optimizer states (and the gradient buckets a ZeRO 0-2 engine keeps between
  steps), counted from the plugins' own sharding rules (:func:`~lightning_ultrascale.plan.predict_shards`)
  and the engines' own formula (``utils.memory.layout_model_state_bytes``): stage 1 splits the
  optimizer states, stage 2 the gradients too, stage 3 the parameters too. Under ``bf16-mixed``
  stages 0-2 hold bf16 weights (2 bytes per parameter), fp32 main gradients (4; 2 with
  ``reduce_dtype="bf16"``) and the fp32 master with Adam's moments (12); stage 3 FSDP2's sharded
  fp32 parameters (the master), fp32 gradients and the moments (4 + 4 + 8);
- the loss moment (the rank holding the head, backward just started): every activation kept for
  backward, times the microbatches in flight, plus the loss's gradient working set;
- the block moment (the first block's backward): the kept activations without the head's, plus that
  block's recomputed activations when it recomputes, plus its backward working set (and a ZeRO-3
  block's gathered parameters), plus the gradients backward has made by then.

Gradients held between micro-steps count in the static part: under gradient accumulation or a
pipeline's microbatches every rank keeps its gradients (ZeRO-3 its reduce-scattered shards; ZeRO-2
its full buckets, reduced once per step; ZeRO-3 under torch's pipeline stages the unsharded
gradients and the gathered parameters, kept until the schedule ends).

Activations kept per token of a block are the tensors our Llama saves for backward, counted op by
op (``h`` width, ``f`` FFN width, ``n`` heads, ``n_kv`` KV heads, ``d`` head width; tensor
parallelism ``T`` divides heads and ``f``, sequence parallelism also the norms' tensors, context
parallelism the tokens; fp32 statistics):

===================  =========================================================================
part                 elements saved per token
===================  =========================================================================
each RMSNorm (x2)    input, x * rstd (``2h/T_sp``), rstd (1, fp32), normalised output (``h``:
                     all-gathered under SP, where the column-parallel matmul saves it)
attention            q, k, v after RoPE (k, v repeated to ``n`` heads) and the output
                     ``4 n d / T``, logsumexp ``n / T`` (fp32); ring CP keeps k, v at ``n_kv``
                     heads; all-to-all CP also keeps the re-gathered output (``h / T``)
dense FFN            w1 and w3 outputs, SiLU output, their product: ``4 f / T``
MoE FFN              router (scores ``E``, 2 statistics, ``k`` indices, weights, sort order), per
                     routed row ``2h + 4 f_e`` on the expert side and ``h`` back, shared experts
                     ``4 f_s``
head                 final norm (as above), log-softmax output ``V / T`` (fp32), token ids and
                     labels (int64); the fused cross-entropy keeps none of it
===================  =========================================================================

Recomputation keeps a recomputed block's input only (``"full"``, every ``every``-th block for
``"selective"``) or the matmul and attention outputs (``"selective_op"``). Pipeline schedules
keep the activations of as many microbatches as the schedule simulator says a rank holds at once.
``benchmarks/plan.py`` checks all of it against torch's ``MemTracker`` in the real Lightning loop.

**Communication** per optimizer step and rank, payload bytes by mesh dim and collective, as
:class:`~lightning_ultrascale.utils.comm.CommTracer` counts them. **Time**: FLOPs over the GPU's
achieved matmul rate, tensor/context/expert traffic on the critical path, data-parallel traffic
overlapped with backward (exposed when longer), times ``1 + bubble`` of the pipeline schedule.
"""

from __future__ import annotations

import functools
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.llama import LlamaConfig
from lightning_ultrascale.parallel.dims import DATA_DIMS, MESH_DIMS, DataShape, ParallelDims
from lightning_ultrascale.parallel.layout import ShardPlan
from lightning_ultrascale.parallel.pipeline.simulator import Timeline
from lightning_ultrascale.plan.hardware import Hardware
from lightning_ultrascale.utils.comm import wire_bytes
from lightning_ultrascale.utils.memory import layout_model_state_bytes

__all__ = ["Candidate", "Cost", "Workload", "estimate"]

_PRECISIONS = ("32-true", "bf16-mixed")
_REDUCE_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class Workload:
    """What is trained: the model, the batch and the precision.

    Example:
        >>> from lightning_ultrascale.models import get_model_config
        >>> w = Workload(get_model_config("llama3_8b"), seq_len=8192, global_batch_size=512)
        >>> w.tokens_per_step
        4194304
    """

    model: LlamaConfig
    seq_len: int
    global_batch_size: int
    precision: str = "bf16-mixed"
    fused_cross_entropy: bool = False
    reduce_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.precision not in _PRECISIONS:
            raise ConfigError(f"precision={self.precision!r} is not planned; valid: {', '.join(_PRECISIONS)}")
        if self.reduce_dtype not in _REDUCE_DTYPES:
            raise ConfigError(f"reduce_dtype={self.reduce_dtype!r}; valid: {', '.join(_REDUCE_DTYPES)}")
        for name in ("seq_len", "global_batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a positive integer")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch_size

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element: bf16 under autocast, else fp32."""
        return 2 if self.precision == "bf16-mixed" else 4

    @property
    def weight_bytes(self) -> int:
        """Bytes of a weight on the device (and on the wire of a ZeRO-1/2 gather): bf16 under ``bf16-mixed``."""
        return 2 if self.precision == "bf16-mixed" else 4

    @property
    def grad_bytes(self) -> int:
        """Bytes of a gradient as ZeRO reduces it (and ZeRO 0-2 hold it): ``reduce_dtype`` under ``bf16-mixed``."""
        return 2 if self.precision == "bf16-mixed" and self.reduce_dtype == "bf16" else 4


@dataclass(frozen=True)
class Candidate:
    """One layout: every size and choice a run makes, as the plugins take them.

    ``dp`` is every data-parallel rank (``dp_replicate x dp_shard``); ZeRO stage 3 with
    ``replicate > 1`` is HSDP. ``microbatches`` (pipeline) defaults to ``2 pp``.

    Example:
        >>> c = Candidate(dp=4, tp=8, pp=2, zero=1, micro_batch_size=1)
        >>> c.world_size, c.label()
        (64, 'dp4 zero1 tp8 pp2(1f1b,m4) mb1')
    """

    dp: int = 1
    zero: int = 1
    tp: int = 1
    sequence_parallel: bool = True
    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int | None = None
    microbatches: int | None = None
    cp: int = 1
    cp_method: str = "zigzag_ring"
    ep: int = 1
    recompute: str = "none"
    recompute_every: int = 1
    micro_batch_size: int = 1
    replicate: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def n_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else 2 * self.pp

    def label(self) -> str:
        parts = [f"dp{self.dp}", f"zero{self.zero}"]
        if self.replicate > 1:
            parts.append(f"hsdp{self.replicate}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("" if self.sequence_parallel else "(no sp)"))
        if self.pp > 1:
            v = f",v{self.virtual_stages}" if self.virtual_stages else ""
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

    def plugins(self) -> list[Any]:
        """The plugins that run this layout (what ``UltraScaleStrategy(*plugins)`` takes)."""
        from lightning_ultrascale.parallel.context import ContextParallel
        from lightning_ultrascale.parallel.data import ZeRO
        from lightning_ultrascale.parallel.expert import ExpertParallel
        from lightning_ultrascale.parallel.pipeline import PipelineParallel
        from lightning_ultrascale.parallel.recompute import Recompute
        from lightning_ultrascale.parallel.tensor import TensorParallel

        if self.zero == 3:
            data = ZeRO(stage=3, size=self.dp // self.replicate, replicate=self.replicate)
        else:
            data = ZeRO(stage=self.zero, size=self.dp)
        plugins: list[Any] = [data]
        if self.tp > 1:
            plugins.append(TensorParallel(self.tp, sequence_parallel=self.sequence_parallel))
        if self.pp > 1:
            plugins.append(PipelineParallel(self.pp, self.schedule, self.n_microbatches, self.virtual_stages))
        if self.cp > 1:
            plugins.append(ContextParallel(self.cp, method=self.cp_method))
        if self.ep > 1:
            plugins.append(ExpertParallel(self.ep))
        if self.recompute != "none":
            every = self.recompute_every if self.recompute == "selective" else 1
            plugins.append(Recompute(self.recompute, every=every))
        return plugins

    def strategy(self) -> Any:
        from lightning_ultrascale.strategy import UltraScaleStrategy

        return UltraScaleStrategy(*self.plugins())

    @classmethod
    def from_plugins(cls, plugins: list[Any], world_size: int, micro_batch_size: int) -> Candidate:
        """The layout a run's plugins make on ``world_size`` ranks; ``micro_batch_size``: ``data.micro_batch_size``.

        Example:
            >>> from lightning_ultrascale import TensorParallel, ZeRO
            >>> Candidate.from_plugins([ZeRO(3), TensorParallel(8)], world_size=64, micro_batch_size=1).label()
            'dp8 zero3 tp8 mb1'
        """
        from lightning_ultrascale.parallel.context import ContextParallel
        from lightning_ultrascale.parallel.data import ZeRO
        from lightning_ultrascale.parallel.expert import ExpertParallel
        from lightning_ultrascale.parallel.pipeline import PipelineParallel
        from lightning_ultrascale.parallel.recompute import Recompute
        from lightning_ultrascale.parallel.tensor import TensorParallel
        from lightning_ultrascale.strategy import UltraScaleStrategy

        dims = UltraScaleStrategy(*plugins).resolve_dims(world_size)
        fields: dict[str, Any] = {"dp": dims.dp_replicate * dims.dp_shard, "replicate": 1, "zero": 1}
        for plugin in plugins:
            if isinstance(plugin, ZeRO):
                fields["zero"] = plugin.stage
                fields["replicate"] = dims.dp_replicate if plugin.stage == 3 else 1
            elif isinstance(plugin, TensorParallel):
                fields.update(tp=plugin.size, sequence_parallel=plugin.sequence_parallel)
            elif isinstance(plugin, PipelineParallel) and plugin.size > 1:
                # the run's data.micro_batch_size is what a pipeline splits into its microbatches
                fields.update(pp=plugin.size, schedule=plugin.schedule, microbatches=plugin.microbatches)
                fields["virtual_stages"] = plugin.virtual_stages if plugin.virtual_stages > 1 else None
                micro_batch_size //= plugin.microbatches
            elif isinstance(plugin, ContextParallel):
                fields.update(cp=plugin.size, cp_method=plugin.method)
            elif isinstance(plugin, ExpertParallel):
                fields["ep"] = plugin.size
            elif isinstance(plugin, Recompute):
                fields.update(recompute=plugin.mode, recompute_every=plugin.every)
        return cls(micro_batch_size=max(1, micro_batch_size), **fields)

    @property
    def batch_per_rank(self) -> int:
        """Samples each data-parallel rank runs per step (a pipeline splits them into microbatches)."""
        return self.micro_batch_size * (self.n_microbatches if self.pp > 1 else 1)

    def data_shape(self, workload: Workload) -> DataShape:
        """The batch shape the run's validation checks: :attr:`batch_per_rank` samples of ``seq_len``."""
        return DataShape(workload.seq_len, self.batch_per_rank, workload.global_batch_size, owner="Workload")


@dataclass
class Cost:
    """What a layout costs on its busiest rank (bytes, seconds, FLOP/s), and why.

    ``memory`` holds the peak's parts: ``params``, ``optimizer``, ``grads`` (buckets held between
    steps), ``activations`` (kept for backward at the peak moment) and ``working`` (transients of
    that moment); ``peak`` their sum. ``comm`` maps ``"dim:op"`` to payload bytes per step.
    """

    candidate: Candidate
    rank: int
    memory: dict[str, int]
    comm: dict[str, int]
    model_state: dict[str, int]
    step_time: float = math.nan
    tokens_per_s: float = math.nan
    mfu: float = math.nan
    bubble: float = 0.0
    time_parts: dict[str, float] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return sum(self.memory.values())


# ----------------------------------------------------------------------------- model state
def _group_numels(plan: ShardPlan) -> dict[tuple[str, ...], list[int]]:
    """Elements of each parameter this rank holds, by the mesh dims its gradient is reduced over."""
    groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for name, shape in plan.shapes.items():
        groups[plan.groups.get(name, DATA_DIMS)].append(math.prod(shape))
    return groups


def model_state(plan: ShardPlan, zero: int, precision: str = "32-true", reduce_dtype: str = "fp32") -> dict[str, int]:
    """Parameters, gradients and AdamW states one rank holds after a step (``model_state_bytes``'s view).

    ``plan``: the rank's parameter shards (:func:`~lightning_ultrascale.plan.predict_shards`), so
    tensor, pipeline, expert and ZeRO-3 sharding are already in it; ZeRO 1 and 2 split the flat
    optimizer states (and gradients) of each gradient group over its ranks (rounded up), by the
    engines' formula (``layout_model_state_bytes``: under ``bf16-mixed`` the fp32 master is
    optimizer state).
    """
    params = grads = optimizer = 0
    for dims, numels in _group_numels(plan).items():
        numel = sum(numels)
        n = math.prod(plan.sizes[d] for d in dims) if zero in (1, 2) else 1  # ZeRO-3's split is in the plan
        state = layout_model_state_bytes(numel, zero, n, precision, reduce_dtype)
        params, grads, optimizer = params + state.params, grads + state.grads, optimizer + state.optimizer_states
        # AdamW's step counter: one fp32 scalar per tensor it updates (one flat shard for ZeRO 1/2).
        optimizer += 4 * (1 if zero in (1, 2) and (n > 1 or precision == "bf16-mixed") else len(numels))
    return {"params": params, "grads": grads, "optimizer": optimizer}


def _unsharded_numel(plan: ShardPlan, zero: int) -> int:
    """Elements this rank's parameters hold before ZeRO-3 splits them over the data dims."""
    total = 0
    for dims, numels in _group_numels(plan).items():
        n = math.prod(plan.sizes[d] for d in dims if d != "dp_replicate") if zero == 3 else 1
        total += sum(numels) * n
    return total


# ----------------------------------------------------------------------------- activations
@dataclass(frozen=True)
class _Shapes:
    """Per-token widths of one rank (after tensor parallelism)."""

    h: int
    f: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    vocab: int
    tp: int
    sp: int  # divisor of the norms' tensors: tp under sequence parallelism, else 1


def _shapes(cfg: LlamaConfig, c: Candidate) -> _Shapes:
    if cfg.mla is not None:  # MLA: queries and keys of qk width, values of v width (approximation)
        head_dim = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim
        v_dim = cfg.mla.v_head_dim
    else:
        head_dim = v_dim = cfg.head_dim
    return _Shapes(
        h=cfg.dim, f=cfg.ffn_hidden_dim, heads=cfg.n_heads, kv_heads=cfg.n_kv_heads, head_dim=head_dim,
        v_head_dim=v_dim, vocab=cfg.vocab_size, tp=c.tp, sp=c.tp if c.sequence_parallel else 1,
    )  # fmt: skip


def _norm(s: _Shapes, e: int) -> float:
    """Bytes per token one RMSNorm keeps: input and x*rstd (sequence-sharded under SP), rstd, output."""
    return (2 * s.h * e + 4) / s.sp + s.h * e


def _attention(s: _Shapes, e: int, cp_method: str | None) -> float:
    heads, kv = s.heads / s.tp, s.kv_heads / s.tp
    q, o = heads * s.head_dim, heads * s.v_head_dim
    if cp_method in ("ring", "zigzag_ring"):
        k_v = kv * (s.head_dim + s.v_head_dim)  # the ring sends and keeps K/V at their own heads
        extra = 0.0
    else:
        k_v = heads * (s.head_dim + s.v_head_dim)  # repeated to every query head
        extra = s.h / s.tp if cp_method == "all_to_all" else 0.0  # the output gathered back
    return (q + k_v + o + extra) * e + 4 * heads


def _moe_ffn(cfg: LlamaConfig, s: _Shapes, e: int) -> float:
    moe = cfg.moe
    assert moe is not None
    k, fe = moe.top_k, moe.moe_ffn_dim
    router = 4 * moe.n_routed_experts + 8 + 32 * k
    routed = k * ((2 * s.h + 4 * fe) * e + s.h * e)
    shared = 4 * fe * moe.n_shared_experts * e
    return router + routed + shared


def _block_kept(cfg: LlamaConfig, s: _Shapes, e: int, layer: int, cp_method: str | None) -> float:
    """Bytes per token a block keeps for backward without recomputation."""
    moe = cfg.moe is not None and cfg.moe.is_moe_block(layer)
    ffn = _moe_ffn(cfg, s, e) if moe else 4 * s.f / s.tp * e
    return 2 * _norm(s, e) + _attention(s, e, cp_method) + ffn


def _block_kept_selective_op(cfg: LlamaConfig, s: _Shapes, e: int, layer: int) -> float:
    """Bytes per token ``selective_op`` keeps: the block input, matmul and attention outputs."""
    heads, kv = s.heads / s.tp, s.kv_heads / s.tp
    attention = (heads * s.head_dim + kv * (s.head_dim + s.v_head_dim) + heads * s.v_head_dim) * e + 4 * heads
    wo = s.h / s.sp * e
    if cfg.moe is not None and cfg.moe.is_moe_block(layer):
        k, fe = cfg.moe.top_k, cfg.moe.moe_ffn_dim
        ffn = 4 * cfg.moe.n_routed_experts + k * (2 * fe + s.h) * e + (2 * fe + s.h) * cfg.moe.n_shared_experts * e
    else:
        ffn = (2 * s.f / s.tp + s.h / s.sp) * e
    return s.h / s.sp * e + attention + wo + ffn


def _block_working(cfg: LlamaConfig, s: _Shapes, e: int, layer: int) -> float:
    """Bytes per token of a block's backward working set (the FFN's input and output gradients)."""
    if cfg.moe is not None and cfg.moe.is_moe_block(layer):
        return (2 * cfg.moe.top_k * cfg.moe.moe_ffn_dim + 2 * s.h) * e
    return (2 * s.f / s.tp + 2 * s.h) * e


def _recomputes(c: Candidate, layer: int) -> bool:
    if c.recompute == "full":
        return True
    return c.recompute == "selective" and layer % c.recompute_every == c.recompute_every - 1


def _kept(cfg: LlamaConfig, s: _Shapes, e: int, layer: int, c: Candidate, cp_method: str | None) -> float:
    if _recomputes(c, layer):
        return s.h / s.sp * e
    if c.recompute == "selective_op":
        return _block_kept_selective_op(cfg, s, e, layer)
    return _block_kept(cfg, s, e, layer, cp_method)


@dataclass(frozen=True)
class _Pipeline:
    """What the cost model reads from a schedule's simulated timeline (unit costs)."""

    bubble: float  # the playbook's r_bubble: idle over compute time
    peak_activations: tuple[int, ...]  # per pp rank: (stage, microbatch) activations held at once
    stages_per_rank: int


def _schedule(c: Candidate) -> _Pipeline:
    """The pipeline schedule's facts, simulated once per (schedule, pp, microbatches, v)."""
    return _simulate(c.schedule, c.pp, c.n_microbatches, c.virtual_stages)


@functools.lru_cache(maxsize=1024)
def _simulate(schedule: str, pp: int, microbatches: int, virtual_stages: int | None) -> _Pipeline:
    from lightning_ultrascale.parallel.pipeline.schedules import resolve_virtual_stages, schedule_info
    from lightning_ultrascale.parallel.pipeline.simulator import simulate

    v = resolve_virtual_stages(schedule, virtual_stages)
    stages_per_rank = v if schedule_info(schedule).multi else 1
    timeline: Timeline = simulate(schedule, pp, microbatches, v if stages_per_rank > 1 else None)
    peaks = tuple(timeline.peak_activations(r) for r in range(pp))
    return _Pipeline(timeline.bubble_ratio, peaks, stages_per_rank)


def _in_flight(c: Candidate, pp_rank: int) -> tuple[float, int]:
    """(microbatches' worth of this rank's activations held at once, pipeline stages on the rank)."""
    if c.pp == 1:
        return 1.0, 1
    pipeline = _schedule(c)
    return pipeline.peak_activations[pp_rank] / pipeline.stages_per_rank, pipeline.stages_per_rank


def activation_memory(
    workload: Workload,
    c: Candidate,
    layers: list[int],
    first: bool,
    last: bool,
    pp_rank: int,
    backward_grads: int = 0,
) -> dict[str, int]:
    """``{"activations", "working"}`` at this rank's peak moment (bytes).

    ``backward_grads``: gradient bytes that appear during backward and are not counted as held (a
    single rank's, ZeRO-3's shards without accumulation): present at the block moment, not the loss moment.
    """
    cfg, e = workload.model, workload.activation_bytes
    s = _shapes(cfg, c)
    t = c.micro_batch_size * workload.seq_len / c.cp  # tokens per microbatch on this rank
    cp_method = c.cp_method if c.cp > 1 else None
    blocks = sum(_kept(cfg, s, e, i, c, cp_method) for i in layers) * t
    rope = 2 * 4 * s.head_dim * workload.seq_len * (c.micro_batch_size if c.cp > 1 else 1) / c.cp
    ids = 8 * t if first else 0.0
    head = head_working = 0.0
    if last:
        ids += 8 * t  # labels
        if workload.fused_cross_entropy:
            head_working = s.h * e * t + 2 * 4 * s.vocab / s.tp * min(t, 1024)
        else:
            log_softmax = 4 * s.vocab / s.tp
            head = (_norm(s, e) + log_softmax) * t
            # Backward of the loss: the gradients of the log-softmax and of the logits (loss
            # parallelism keeps two more vocabulary-wide tensors), then of the hidden state.
            head_working = (2 + (2 if c.tp > 1 else 0)) * log_softmax * t + s.h * e * t
    in_flight, stages = _in_flight(c, pp_rank)
    per_microbatch = blocks + head + ids + rope
    kept = per_microbatch * in_flight
    if c.pp > 1:
        # torch's pipeline stages keep every microbatch's output until the step ends: the hidden
        # state of each stage but the last, the logits of the last.
        outputs = stages - (1 if last else 0)
        kept += c.n_microbatches * t * (outputs * s.h / s.sp * e + (4 * s.vocab / s.tp if last else 0))
    # The block moment: the last block of the rank's forward starts its backward.
    block_moment = 0.0
    if layers:
        i = layers[-1]
        block_moment = _block_working(cfg, s, e, i) * t
        if _recomputes(c, i) or c.recompute == "selective_op":
            block_moment += (_block_kept(cfg, s, e, i, cp_method) - _kept(cfg, s, e, i, c, cp_method)) * t
        block_moment -= head  # the loss's tensors are gone by then
    working = max(head_working, block_moment + backward_grads)
    return {"activations": round(kept), "working": round(working)}


# ----------------------------------------------------------------------------- communication
def _add(comm: dict[str, int], dim: str, op: str, payload: float) -> None:
    if payload > 0:
        comm[f"{dim}:{op}"] = comm.get(f"{dim}:{op}", 0) + round(payload)


def communication(
    workload: Workload,
    c: Candidate,
    plan: ShardPlan,
    layers: list[int],
    first: bool,
    last: bool,
    accumulation: int = 1,
) -> dict[str, int]:
    """Payload bytes per optimizer step this rank hands to collectives, by ``"dim:op"``.

    ``accumulation``: micro-steps per optimizer step. Activation traffic (TP, CP, EP, PP) and
    FSDP's all-gathers and reduce-scatters repeat every micro-step; ZeRO 0-2 reduce once per step.
    One term per technique, each its own function (the plugins' share of the traffic).
    """
    comm: dict[str, int] = {}
    _data_traffic(comm, workload, c, plan, accumulation)
    s = _shapes(workload.model, c)
    e = workload.activation_bytes
    m = (c.n_microbatches if c.pp > 1 else 1) * accumulation  # forwards per optimizer step
    t = c.micro_batch_size * workload.seq_len / c.cp  # tokens of one forward on this rank
    if c.tp > 1:
        _tp_traffic(comm, c, s, layers, first, last, (t, e, m))
    if c.cp > 1:
        _cp_traffic(comm, c, s, len(layers), (t, e, m))
    if c.ep > 1 and workload.model.moe is not None:
        moe = workload.model.moe
        moe_layers = sum(1 for i in layers if moe.is_moe_block(i))
        rows = t * moe.top_k * s.h * e
        # dispatch and combine forward, their reverses backward; uniform routing (the mean over ranks)
        _add(comm, "ep", "all_to_all", (4 * rows + 8 * moe.n_routed_experts) * moe_layers * m)
    if c.pp > 1:
        boundary = t * s.h / s.sp * e * m
        _, stages = _in_flight(c, plan.coordinate["pp"])
        # each stage sends its output forward (not the last) and its input gradient back (not the first)
        sends = 2 * stages - (1 if last else 0) - (1 if first else 0)
        _add(comm, "pp", "send", sends * boundary)
        _add(comm, "pp", "recv", sends * boundary)
    return comm


def _data_traffic(comm: dict[str, int], workload: Workload, c: Candidate, plan: ShardPlan, accumulation: int) -> None:
    """Gradients and parameters over the data dims (each group its own dims, e.g. experts over edp)."""
    for dims, numels in _group_numels(plan).items():
        numel = sum(numels)
        live = [d for d in dims if plan.sizes[d] > 1]
        if not live:
            continue
        dim = _dim_name(live)
        grad = workload.grad_bytes * numel
        if c.zero == 0:
            _add(comm, dim, "all_reduce", grad)
        elif c.zero in (1, 2):
            _add(comm, dim, "reduce_scatter", grad)
            _add(comm, dim, "all_gather", workload.weight_bytes * numel)  # the updated (bf16) weights
        else:
            shard_dims = [d for d in live if d != "dp_replicate"]
            n = math.prod(plan.sizes[d] for d in shard_dims)
            if shard_dims:
                # FSDP2 gathers every parameter twice (forward, backward; once under a pipeline,
                # which keeps them gathered for its microbatches): payload the gathered output;
                # reduce-scatters the unsharded gradient (payload its input). (bf16-mixed gathers
                # bf16 copies: FSDP2's MixedPrecisionPolicy param_dtype.)
                gathers = 1 if c.pp > 1 else 2
                gathered = gathers * workload.activation_bytes * numel * n * accumulation
                _add(comm, _dim_name(shard_dims), "all_gather", gathered)
                # every micro-step (FSDPEngine.no_sync holds nothing back)
                _add(comm, _dim_name(shard_dims), "reduce_scatter", grad * n * accumulation)
            if "dp_replicate" in live:
                _add(comm, "dp_replicate", "all_reduce", grad)


def _tp_traffic(
    comm: dict[str, int], c: Candidate, s: _Shapes, layers: list[int], first: bool, last: bool,
    tem: tuple[float, int, int],
) -> None:  # fmt: skip
    """Tensor parallelism: 4 collectives per block (+ embedding, head) of t x h activations, m times; the loss's.

    ``tem``: tokens of one forward, bytes per activation element, forwards per step.
    """
    t, e, m = tem
    activation = t * s.h * e * m
    n = 4 * len(layers) + (1 if first else 0) + (1 if last else 0)
    # Recomputation repeats a block's forward collectives (2 per block) in backward; op-level
    # recomputation keeps the reduce-scatter outputs (SP), not the all-reduces (measured: one).
    again = {"full": 2, "selective_op": 0 if c.sequence_parallel else 1}.get(c.recompute, 0)
    again *= len(layers) if c.recompute != "selective" else 0
    again += 2 * sum(1 for i in layers if c.recompute == "selective" and _recomputes(c, i))
    if c.sequence_parallel:
        _add(comm, "tp", "all_gather", (n + again) * activation)
        _add(comm, "tp", "reduce_scatter", (n + again) * activation)
    else:
        _add(comm, "tp", "all_reduce", (n + again) * activation)
    if last:  # loss parallelism: max, sum of exponentials and target logit, forward and backward
        _add(comm, "tp", "all_reduce", 6 * 4 * t * m)


def _cp_traffic(
    comm: dict[str, int], c: Candidate, s: _Shapes, attention_layers: int, tem: tuple[float, int, int]
) -> None:
    """Context parallelism: the all-to-all of q, k, v and the output, or the ring's K/V (and dK/dV) sends."""
    t, e, m = tem
    if c.cp_method == "all_to_all":
        # q and the output at every head, k and v at their own heads (repeated after the exchange)
        q_k_v_o = t * (s.heads * (s.head_dim + s.v_head_dim) + s.kv_heads * (s.head_dim + s.v_head_dim)) / s.tp * e
        _add(comm, "cp", "all_to_all", 2 * q_k_v_o * attention_layers * m)
        return
    kv = t * s.kv_heads / s.tp * (s.head_dim + s.v_head_dim) * e
    # forward: K/V to the next rank cp-1 times; backward: K/V again and dK/dV cp times.
    sends = (2 * (c.cp - 1) + c.cp) * kv * attention_layers * m
    _add(comm, "cp", "send", sends)
    _add(comm, "cp", "recv", sends)


def _dim_name(dims: list[str]) -> str:
    """A group over ``dims`` named as the tracer names a flattened mesh dim (``dp_shard_cp``)."""
    return "_".join(dims)


def _mesh_dims(name: str) -> list[str]:
    """The mesh dims a :func:`_dim_name` name joins (names hold ``_`` themselves: match whole ones)."""
    return [d for d in MESH_DIMS if re.search(rf"(?:^|_){d}(?:_|$)", name)]


# ----------------------------------------------------------------------------- time
def _group_span(dims: ParallelDims, names: list[str]) -> int:
    """Ranks from the first to the last member of a group over mesh dims ``names`` (row-major mesh)."""
    span, stride = 1, 1
    for d in reversed(MESH_DIMS):
        size = getattr(dims, d)
        if d in names:
            span = (size - 1) * stride + span
        stride *= size
    return span


def step_time(workload: Workload, c: Candidate, cost: Cost, dims: ParallelDims, gpu: Hardware) -> None:
    """Fill ``cost``'s step time, tokens/s, MFU and bubble (seconds per optimizer step)."""
    cfg = workload.model
    flops_token = cfg.flops_per_token(workload.seq_len)
    tokens_per_rank = workload.tokens_per_step / (c.dp * c.cp)  # each rank's share before tp/pp split
    model_flops = flops_token * tokens_per_rank / (c.tp * c.pp)
    recompute = {"none": 0.0, "selective_op": 0.03, "full": 1 / 3}.get(c.recompute, 1 / (3 * c.recompute_every))
    peak = gpu.peak_for(workload.precision)  # fp32 runs at the TF32 peak, not the bf16 one
    compute = model_flops * (1 + recompute) / (peak * gpu.matmul_efficiency)
    seconds: dict[str, float] = {}
    for key, payload in cost.comm.items():
        dim, op = key.split(":")
        if dim == "ep":  # experts borrow data ranks: the group spans them, ep of them take part
            names, size = [d for d in DATA_DIMS if getattr(dims, d) > 1], c.ep
        else:
            names = _mesh_dims(dim)
            size = math.prod(getattr(dims, d) for d in names)
        intra = _group_span(dims, names) <= gpu.gpus_per_node
        bandwidth = (gpu.intra_node_bandwidth if intra else gpu.inter_node_bandwidth) * gpu.link_efficiency
        latency = gpu.intra_node_latency if intra else gpu.inter_node_latency
        wire = wire_bytes(op, int(payload), size)
        seconds[dim] = seconds.get(dim, 0.0) + wire / bandwidth + latency * max(1, size - 1)
    data = sum(v for k, v in seconds.items() if k not in ("tp", "cp", "ep", "pp"))
    critical = seconds.get("tp", 0.0) + seconds.get("ep", 0.0) + seconds.get("pp", 0.0)
    # Ring attention overlaps its K/V exchange with the attention of the block it holds.
    critical += max(0.0, seconds.get("cp", 0.0) - 0.5 * compute)
    bubble = _schedule(c).bubble if c.pp > 1 else 0.0
    busy = (compute + critical) * (1 + bubble)
    # Data-parallel traffic overlaps backward (2/3 of compute); what is longer is exposed.
    exposed = max(0.0, data - (2 / 3) * compute)
    total = busy + exposed
    cost.step_time = total
    cost.tokens_per_s = workload.tokens_per_step / total
    cost.mfu = flops_token * cost.tokens_per_s / (c.world_size * peak)
    cost.bubble = bubble
    cost.time_parts = {"compute": compute, "critical_comm": critical, "exposed_dp_comm": exposed, **seconds}


def _rank_cost(
    workload: Workload, c: Candidate, model: nn.Module, plan: ShardPlan, rank: int, accumulation: int
) -> Cost:
    """Memory and traffic of one rank holding ``plan`` (no time yet)."""
    spec = model.spec  # type: ignore[attr-defined]
    layers = sorted({int(n.split(".")[1]) for n in plan.shapes if n.startswith(f"{spec.layers}.")})
    first = f"{spec.embedding}.weight" in plan.shapes
    last = f"{spec.head}.weight" in plan.shapes or (spec.head is None and first)
    state = model_state(plan, c.zero, workload.precision, workload.reduce_dtype)
    compute_b = 2 if workload.precision == "bf16-mixed" else 4
    unsharded = _unsharded_numel(plan, c.zero)
    held_grads = _held_grads(workload, c, state["grads"], unsharded, accumulation)
    # Gradients not held between steps still exist by the first block's backward.
    act = activation_memory(
        workload, c, layers, first, last, plan.coordinate["pp"], 0 if held_grads else state["grads"]
    )
    working = act["working"]
    if c.zero == 3 and c.pp > 1:
        # torch's pipeline stages keep an FSDP module's gathered parameters from its first
        # backward to the step's end (reshard_after_backward=False)
        working += compute_b * unsharded
    elif c.zero == 3 and layers:  # the gathered parameters of the block running and the next one
        per_block = (
            state["params"] // max(1, len(layers)) * math.prod(plan.sizes[d] for d in DATA_DIMS if d != "dp_replicate")
        )
        working += 2 * per_block * compute_b // 4  # (gathered in compute_b from fp32 shards)
    memory = {
        "params": state["params"],
        "optimizer": state["optimizer"],
        "grads": held_grads,
        "activations": act["activations"],
        "working": working,
    }
    comm = communication(workload, c, plan, layers, first, last, accumulation)
    return Cost(c, rank, memory, comm, state)


def _held_grads(workload: Workload, c: Candidate, grads: int, unsharded: int, accumulation: int) -> int:
    """Gradient bytes a rank holds between steps (or micro-steps): static memory, not the backward's."""
    # ZeRO 0-2 engines keep their gradient buckets between steps (under bf16-mixed on one rank
    # too: the masters' gradients); FSDP2 and a single fp32 rank do not.
    engine = c.zero < 3 and (c.dp * c.cp > 1 or workload.precision == "bf16-mixed")
    held = grads if engine else 0
    if held == 0 and (accumulation > 1 or c.pp > 1):
        # kept between micro-steps (ZeRO-3: reduce-scattered every micro-step, summed in the shards)
        held = grads
    if c.dp * c.cp > 1 and ((c.zero == 2 and (accumulation > 1 or c.pp > 1)) or (c.zero == 3 and c.pp > 1)):
        # Gradients reduced once per step (ZeRO-2 under accumulation, or a pipeline's
        # microbatches) accumulate unsharded until then: ZeRO-2's full buckets; under torch's
        # pipeline stages FSDP2's unsharded fp32 gradients (set_requires_gradient_sync(False)).
        held = (4 if c.zero == 3 else workload.grad_bytes) * unsharded
    return held


# ----------------------------------------------------------------------------- one layout
def estimate(
    workload: Workload,
    candidate: Candidate,
    model: nn.Module,
    gpu: Hardware | None = None,
    ranks: list[int] | None = None,
    shard_cache: dict[Any, ShardPlan] | None = None,
) -> list[Cost]:
    """The cost of ``candidate`` on each of ``ranks`` (default: the first rank of every pipeline stage).

    ``model``: the whole model on the meta device (``build_model(cfg, device="meta")``). The
    layout is validated first by the real plugins (``UltraScaleStrategy.validate``): an invalid
    one raises their :class:`~lightning_ultrascale.errors.ConfigError`. ``shard_cache``: a dict the
    caller keeps across calls for the same model (the search does): shard plans depend on the sizes
    and the pipeline placement only, not on batch sizes or recomputation.

    Example:
        >>> from lightning_ultrascale.models import build_model, get_model_config
        >>> w = Workload(get_model_config("llama_tiny"), seq_len=256, global_batch_size=4, precision="32-true")
        >>> [cost] = estimate(w, Candidate(dp=2, zero=3, micro_batch_size=2), build_model("llama_tiny", device="meta"))
        >>> cost.model_state
        {'params': 476288, 'grads': 476288, 'optimizer': 952732}
    """
    from lightning_ultrascale.plan.shards import predict_shards

    c = candidate
    strategy = c.strategy()
    world = c.world_size
    strategy.validate(model.spec, c.data_shape(workload), world_size=world)  # type: ignore[arg-type]
    dims = strategy.parallel_dims
    accumulation = dims.grad_accumulation(workload.global_batch_size, c.batch_per_rank)
    if ranks is None:
        ranks = sorted({p * (world // c.pp) for p in range(c.pp)})
    costs = []
    # (ZeRO 0-2 leave parameters whole: one plan for the three.)
    shape_key = replace(
        c, zero=max(c.zero, 1), recompute="none", recompute_every=1, micro_batch_size=1, microbatches=None
    )
    for rank in ranks:
        if shard_cache is None:
            plan = predict_shards(strategy, model, world, rank)
        else:
            if (shape_key, rank) not in shard_cache:
                shard_cache[shape_key, rank] = predict_shards(strategy, model, world, rank)
            plan = shard_cache[shape_key, rank]
        cost = _rank_cost(workload, c, model, plan, rank, accumulation)
        if gpu is not None:
            step_time(workload, c, cost, dims, gpu)
        costs.append(cost)
    return costs
