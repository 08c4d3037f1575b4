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
  block's gathered parameters), plus the gradients backward has made by then;
- the forward's end (no pipeline): every activation kept, the logits, and the last step's gradients where no
  engine holds them, which Lightning's closure clears only after ``training_step`` (``benchmarks/plan.py``:
  the peak of one process and of a folded MoE under tp2 is this moment).

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
                     all-gathered under SP, where the column-parallel matmul saves it; ``h/T``
                     where it stays a sequence shard: a folded MoE's input, and every input
                     under ``TensorParallel(regather=True)``, which gathers it again in backward)
attention            q, k, v after RoPE (k, v repeated to ``n`` heads) and the output
                     ``4 n d / T``, logsumexp ``n / T`` (fp32); ring CP keeps k, v at ``n_kv``
                     heads; all-to-all CP also keeps the re-gathered output (``h / T``)
dense FFN            w1 and w3 outputs, SiLU output, their product: ``4 f / T`` (``3 f / T`` with
                     fused kernels, ``Workload.fused_kernels``: the SiLU is recomputed in backward;
                     their norms keep no ``x * rstd`` either)
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

**Who knows what.** Every technique's terms are its plugin's own
(:meth:`~lightning_ultrascale.parallel.plugin.ParallelPlugin.plan_cost`, see
:mod:`lightning_ultrascale.parallel.pricing`): the data plugin's model state, held gradients,
gathered parameters and traffic; tensor, context, expert and pipeline traffic; the pipeline's
bubble and microbatches in flight; recomputation's extra compute. This module composes them and
counts the model's activations from the plugins' facts.

**Communication** per optimizer step and rank, payload bytes by mesh dim and collective, as
:class:`~lightning_ultrascale.utils.comm.CommTracer` counts them. **Time**: FLOPs (plus what the
plugins add) over the GPU's achieved matmul rate; each plugin's traffic on its links less the
compute it can hide behind (data-parallel: backward, 2/3 of compute; ring attention: half;
tensor, expert and pipeline traffic: none), the traffic inside the step times ``1 + bubble``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_ultrascale.errors import ConfigError, is_positive_int
from lightning_ultrascale.models.common.decoder import LlamaConfig, llama_spec
from lightning_ultrascale.models.spec import ModelSpec, require_spec
from lightning_ultrascale.parallel.dims import MESH_DIMS, ParallelDims
from lightning_ultrascale.parallel.expert.placement import ExpertPlacement, balance_experts
from lightning_ultrascale.parallel.layout import ShardPlan
from lightning_ultrascale.parallel.muon import muon_cost
from lightning_ultrascale.parallel.pricing import CostTerms, RankView, Widths, moe_fold
from lightning_ultrascale.plan.candidate import Candidate
from lightning_ultrascale.plan.compute import model_compute
from lightning_ultrascale.plan.fp8 import converted_numel
from lightning_ultrascale.plan.hardware import Hardware
from lightning_ultrascale.utils.comm import wire_bytes

__all__ = ["Candidate", "Cost", "Workload", "estimate", "expert_load", "priced_spec", "spec_flops_per_token"]

_PRECISIONS = ("32-true", "bf16-mixed")
#: A balanced router's busiest expert over the mean (one expert per rank), as this library's MoE runs measured
#: it: ``benchmarks/expert.py``'s moe_tiny with its default balancing (sequence aux loss and the aux-loss-free
#: bias) after 400 steps, 1.124 with one expert per rank, 1.062 with 2 and 1.030 with 4 (the excess halves as
#: a rank holds twice the experts); a test recomputes it from ``benchmarks/results/expert.json``.
BALANCED_EXCESS = 0.124
_REDUCE_DTYPES = ("fp32", "bf16")
_OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True)
class Workload:
    """What is trained: the model, the batch and the precision.

    ``model``: a configuration of our decoder (``get_model_config(...)``), or any model that declares
    the model contract (``spec: ModelSpec`` with the widths the planner prices), built on the meta
    device: a user's own is priced from its spec as ours is. MFU counts its ``flops_per_token`` where
    it has one, else the spec's (:func:`spec_flops_per_token`).
    ``fused_kernels``: the norms, RoPE and SwiGLU run fused (``kernels=`` other than ``reference``).
    ``reduce_dtype``: the run's ``ZeRO(reduce_dtype=...)``, which the search gives every layout
    it builds (:func:`estimate` refuses a layout whose data plugin says otherwise).
    ``tp_comm_overlap``: a time-model switch for stacks that overlap tensor-parallel collectives
    with the GEMMs beside them (Megatron-Core's ``tp_comm_overlap`` through Transformer Engine's
    userbuffers, torch's async TP). This library's blocks run them on the critical path: leave it
    off to price a run of ours; ``benchmarks/published_runs.py`` turns it on for NeMo's 70B.
    ``fp8``: the FP8 recipe of the blocks' linears, priced from its GEMMs and quantisation
    (:mod:`lightning_ultrascale.plan.fp8`); MFU stays counted against the bf16 peak.
    ``expert_load``: under expert parallelism, the busiest rank's routed rows over the mean, per MoE
    block (:func:`~lightning_ultrascale.plan.expert_load` computes it from a run's expert loads):
    every rank of the group waits for that rank at each dispatch. ``None`` (default): a balanced
    router's, as this library's MoE runs measured it (:data:`BALANCED_EXCESS`: the busiest rank's excess
    over the mean halves as a rank holds twice the experts); a young router is far from it (1.65 on
    ``benchmarks/cpu_time_model.py``'s ep2 run), and a model's ``capacity_factor`` bounds it (the rows
    over capacity are dropped before the dispatch).
    ``force_balanced``: the router sends every expert the same rows (Megatron-Core's
    ``moe_router_force_load_balancing``, which published MoE benchmarks use): an expert load of 1.0.
    ``ep_comm_overlap``: a time-model switch for stacks that run one microbatch's expert-parallel
    dispatch and combine beside another microbatch's GEMMs (Megatron-Core's ``moe_a2a_overlap``, which
    merges the forward and backward of two microbatches in 1F1B's steady state). This library runs
    them on the critical path: leave it off to price a run of ours.
    ``recomputed_matmuls``: a time-model switch for stacks whose op-level recomputation (``selective_op``)
    re-runs a share of the blocks' forward matmuls in backward (torchtitan's policy: every second ``aten.mm``,
    0.5). This library's keeps every matmul output: leave it 0 to price a run of ours.

    Example:
        >>> from lightning_ultrascale.models import get_model_config
        >>> w = Workload(get_model_config("llama3_8b"), seq_len=8192, global_batch_size=512)
        >>> w.tokens_per_step
        4194304
    """

    model: LlamaConfig | nn.Module
    seq_len: int
    global_batch_size: int
    precision: str = "bf16-mixed"
    fused_cross_entropy: bool = False
    #: the memory-bound ops run fused (our Triton/Liger kernels, torch.compile, Transformer Engine):
    #: about one read and write per logical op; otherwise eager, as the reference kernels run them
    fused_kernels: bool = False
    reduce_dtype: str = "fp32"
    expert_load: float | None = None
    force_balanced: bool = False
    tp_comm_overlap: bool = False
    ep_comm_overlap: bool = False
    recomputed_matmuls: float = 0.0
    #: an FP8 recipe of the blocks' linears (``FP8Precision``'s: tensorwise, rowwise, rowwise_with_gw_hp,
    #: blockwise), on top of ``precision`` (its high-precision part); ``None``: no FP8
    fp8: str | None = None
    #: tensorwise under ZeRO-3 all-gathers the converted weights in FP8 (``FP8Precision(fp8_all_gather=...)``)
    fp8_all_gather: bool = True
    #: ``"adamw"``, or ``"muon"``: the blocks' matrices keep one moment instead of two, and each step
    #: orthogonalises them whole (:func:`~lightning_ultrascale.parallel.muon.muon_cost`)
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        if self.precision not in _PRECISIONS:
            raise ConfigError(f"precision={self.precision!r} is not planned; valid: {', '.join(_PRECISIONS)}")
        if self.fp8 is not None:
            from lightning_ultrascale.fp8.precision import BASE_PRECISIONS

            if self.fp8 not in BASE_PRECISIONS:
                raise ConfigError(f"fp8={self.fp8!r} is not a recipe; valid: {', '.join(BASE_PRECISIONS)}, or None")
            if self.precision not in BASE_PRECISIONS[self.fp8]:
                valid = ", ".join(BASE_PRECISIONS[self.fp8])
                raise ConfigError(f"fp8={self.fp8!r} trains on precision={self.precision!r}: valid: {valid}")
        if self.optimizer not in _OPTIMIZERS:
            raise ConfigError(f"optim.name={self.optimizer!r} is not planned; valid: {', '.join(_OPTIMIZERS)}")
        if self.reduce_dtype not in _REDUCE_DTYPES:
            raise ConfigError(f"reduce_dtype={self.reduce_dtype!r}; valid: {', '.join(_REDUCE_DTYPES)}")
        if not 0.0 <= self.recomputed_matmuls <= 1.0:
            raise ConfigError(f"recomputed_matmuls={self.recomputed_matmuls!r} is a share of the matmuls: 0 to 1")
        if self.expert_load is not None and not self.expert_load >= 1.0:
            raise ConfigError(f"expert_load={self.expert_load!r} is a max over a mean: at least 1.0 (1.0: uniform)")
        if self.force_balanced and self.expert_load not in (None, 1.0):
            raise ConfigError(
                f"force_balanced=True routes every expert the same rows, but expert_load={self.expert_load!r}; "
                "valid: one of the two"
            )
        for name in ("seq_len", "global_batch_size"):
            if not is_positive_int(getattr(self, name)):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if not isinstance(self.model, LlamaConfig):
            priced_spec(self.model)

    def load_for(self, experts_per_rank: float) -> float:
        """The busiest expert rank's routed rows over the mean, for ranks holding ``experts_per_rank`` experts each.

        Example:
            >>> from dataclasses import replace
            >>> from lightning_ultrascale.models import get_model_config
            >>> w = Workload(get_model_config("llama_tiny"), 64, 4)
            >>> round(w.load_for(1), 3), round(w.load_for(4), 3), replace(w, force_balanced=True).load_for(1)
            (1.124, 1.031, 1.0)
        """
        if self.force_balanced:
            return 1.0
        load = self.expert_load if self.expert_load is not None else 1.0 + BALANCED_EXCESS / max(1.0, experts_per_rank)
        # A capacity keeps at most capacity_factor x the mean rows of each expert (of each rank, then): the rows
        # over it are dropped before the dispatch, neither sent nor computed (models/common/moe.py).
        capacity = getattr(getattr(self.model, "moe", None), "capacity_factor", None)
        return min(load, capacity) if capacity is not None else load

    def fp8_gathered_numel(self, rank: RankView) -> int:
        """Parameters of ``rank``'s blocks that ZeRO-3 all-gathers in FP8 (tensorwise, ``fp8_all_gather``), else 0."""
        if self.fp8 != "tensorwise" or not self.fp8_all_gather or self.precision != "bf16-mixed":
            return 0
        return converted_numel(rank.spec, rank.layers, rank.widths.tp, "tensorwise")

    @property
    def spec(self) -> ModelSpec:
        """The model's contract: its own spec, or the one our decoder builds from the config."""
        return llama_spec(self.model) if isinstance(self.model, LlamaConfig) else require_spec(self.model)

    @property
    def name(self) -> str:
        return self.spec.name

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the model: its own count where it has one, else its spec's."""
        count = getattr(self.model, "flops_per_token", None)
        return count(seq_len) if callable(count) else spec_flops_per_token(self.spec, seq_len)

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch_size

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element: bf16 under autocast, else fp32."""
        return 2 if self.precision == "bf16-mixed" else 4


def priced_spec(model: nn.Module) -> ModelSpec:
    """``model``'s spec, or a :class:`ConfigError` naming the widths it does not declare and the planner prices."""
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"Workload(model={type(model).__name__}) is not a model; valid: a LlamaConfig "
            "(get_model_config(...)) or an nn.Module with a `spec: ModelSpec`, built on the meta device"
        )
    spec = require_spec(model)
    missing = spec.undeclared_widths()
    if missing:
        raise ConfigError(
            f"model {spec.name}'s spec leaves {', '.join(f'{m}=0' for m in missing)}; the planner prices those "
            "widths: declare them in its ModelSpec (lightning_ultrascale.models.spec)"
        )
    return spec


def spec_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token from a spec's widths: ``6 N + 6 L H (d_qk + d_v) T``, N the parameters
    one token runs through but the embedding (q, k, v, o; SwiGLU, or the router, top-k routed and shared
    experts; the norms; the head), as :meth:`~lightning_ultrascale.models.LlamaConfig.flops_per_token`
    counts them (MLA's: down to its latents, then up per head)."""
    h, qk, v = spec.dim, spec.head_dim, spec.v_head_dim
    attention = h * (spec.n_heads + spec.n_kv_heads) * (qk + v)
    if spec.kv_lora_rank:
        latent, q_rank, nope = spec.kv_lora_rank, spec.q_lora_rank, qk - spec.rope_head_dim
        q = (h + spec.n_heads * qk) * q_rank if q_rank else h * spec.n_heads * qk
        attention = q + h * (latent + spec.rope_head_dim) + latent * spec.n_kv_heads * (nope + v) + spec.n_heads * v * h
    moe = 3 * h * spec.expert_ffn_dim * (spec.top_k + spec.n_shared_experts) + h * spec.n_experts
    ffn = len(spec.moe_blocks) * moe + (spec.n_layers - len(spec.moe_blocks)) * 3 * h * spec.ffn_dim
    matmul = spec.n_layers * (attention + 2 * h) + ffn + h + h * spec.vocab_size
    return float(6 * matmul + 6 * spec.n_layers * spec.n_heads * (qk + v) * seq_len)


@dataclass
class Cost:
    """What a layout costs on its busiest rank (bytes, seconds, FLOP/s), and why.

    ``memory`` holds the peak's parts: ``params``, ``optimizer``, ``grads`` (buckets held between
    steps), ``activations`` (kept for backward at the peak moment) and ``working`` (transients of
    that moment); ``peak`` their sum. ``comm`` maps ``"dim:op"`` to payload bytes per step, ``calls`` to the
    collective calls carrying them (where the plugins count them).
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
    #: each plugin's share (``plan_cost``), composed into the fields above
    terms: list[CostTerms] = field(default_factory=list, repr=False)
    #: the rank as the plugins priced it
    view: RankView | None = field(default=None, repr=False)
    calls: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return sum(self.memory.values())


# ----------------------------------------------------------------------------- activations
def expert_load(loads: torch.Tensor, ep: int, redundant: int | None = None, nodes: int = 1, groups: int = 1) -> float:
    """:attr:`Workload.expert_load` from a run's tokens per expert ``loads [MoE blocks, experts]``.

    Expert rank ``r`` of ``ep`` holds experts ``r E/ep ..``; per block, its rows are the sum of
    its experts' loads; the result is the busiest rank's over the mean, averaged over the blocks
    (``LlamaModule.expert_stats.loads`` after a step holds the global loads of that step). With
    ``redundant`` (0 or more extra slots per block), the balance EPLB's placement computed from these
    loads leaves (:func:`~lightning_ultrascale.parallel.expert.placement.balance_experts`, on ``nodes``
    nodes, experts in ``groups`` routing groups): for loads that persist, as a hot expert does.

    Example:
        >>> loads = torch.tensor([[3.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
        >>> round(expert_load(loads, ep=2), 4), round(expert_load(loads, ep=2, redundant=2), 4)  # (4/3 + 1) / 2
        (1.1667, 1.0)
    """
    if loads.ndim != 2 or (redundant is None and loads.shape[1] % ep):
        raise ConfigError(f"expert_load needs loads [MoE blocks, experts] with experts divisible by ep={ep}")
    blocks, experts = loads.shape
    if redundant is None:
        return ExpertPlacement.contiguous(blocks, experts, ep).max_over_mean(loads)
    return balance_experts(loads, ep, redundant, nodes, groups).max_over_mean(loads)


def widths(spec: ModelSpec, c: Candidate) -> Widths:
    """One rank's widths, read from the model's spec (MLA: queries and keys of qk width, values of v width)."""
    return Widths(
        h=spec.dim, f=spec.ffn_dim, heads=spec.n_heads, kv_heads=spec.n_kv_heads, head_dim=spec.head_dim,
        v_head_dim=spec.v_head_dim, vocab=spec.vocab_size, tp=c.tp, sp=c.tp if c.sequence_parallel else 1,
    )  # fmt: skip


def _norm(s: Widths, e: int, gathered: bool = True, fused: bool = False) -> float:
    """Bytes per token one RMSNorm keeps: input and x*rstd (sequence-sharded under SP; a ``fused`` kernel keeps the
    input only), rstd, and its output as the projections after it save it: all-gathered under SP (``gathered``), or
    the sequence shard (a folded MoE's input, an input regathered in backward)."""
    return ((1 if fused else 2) * s.h * e + 4) / s.sp + s.h * e / (1 if gathered else s.sp)


def _attention(s: Widths, e: int, cp_method: str | None) -> float:
    heads, kv = s.heads / s.tp, s.kv_heads / s.tp
    q, o = heads * s.head_dim, heads * s.v_head_dim
    if cp_method in ("ring", "zigzag_ring"):
        k_v = kv * (s.head_dim + s.v_head_dim)  # the ring sends and keeps K/V at their own heads
        extra = 0.0
    else:
        k_v = heads * (s.head_dim + s.v_head_dim)  # repeated to every query head
        extra = s.h / s.tp if cp_method == "all_to_all" else 0.0  # the output gathered back
    return (q + k_v + o + extra) * e + 4 * heads


def _mla_latents(spec: ModelSpec, s: Widths, e: int, fused: bool) -> float:
    """Bytes per token multi-head latent attention keeps beside q, k, v and o (0 without MLA): its latents, whole
    on every tp rank, as their norms and the up projections save them (``wkv_a``'s output, the key latent's
    norm input, with ``x * rstd`` where not ``fused``, and its output; the query latent's the same), and the
    keys' nope part of each value's storage (``wkv_b`` writes both; attention saves the values as a view)."""
    if not spec.kv_lora_rank:
        return 0.0
    norm = 2 if fused else 3  # input (and x * rstd), output
    latents = spec.kv_lora_rank + spec.rope_head_dim + (norm - 1) * spec.kv_lora_rank + norm * spec.q_lora_rank
    rstds = 4 * (1 + bool(spec.q_lora_rank))
    return (latents + s.heads / s.tp * (s.head_dim - spec.rope_head_dim)) * e + rstds


def _moe_ffn(spec: ModelSpec, s: Widths, e: int, fused: bool = False) -> float:
    k, fe = spec.top_k, spec.expert_ffn_dim
    router = 4 * spec.n_experts + 8 + 32 * k
    routed = k * ((2 * s.h + 4 * fe) * e + s.h * e)  # (the routed experts' own code: no fused kernel)
    shared = _swiglu_kept(fused) * fe * spec.n_shared_experts * e
    return (router + routed + shared) / moe_fold(spec, s)  # (folded over tp: a rank runs its share of the tokens)


def _swiglu_kept(fused: bool) -> int:
    """SwiGLU tensors of ``f`` a block keeps per token: w1's and w3's outputs and the product (w2's input), and the
    SiLU output where it is not ``fused`` (our Triton and Liger kernels recompute it in backward)."""
    return 3 if fused else 4


def _block_kept(
    spec: ModelSpec,
    s: Widths,
    e: int,
    layer: int,
    cp_method: str | None,
    regather: bool = False,
    fused: bool = False,
) -> float:
    """Bytes per token a block keeps for backward without recomputation (``regather``: ``TensorParallel(regather=)``
    keeps the attention's and a dense feed-forward's inputs sequence-sharded; ``fused``: fused norm and SwiGLU
    kernels, ``Workload.fused_kernels``)."""
    moe = spec.is_moe_block(layer)
    ffn = _moe_ffn(spec, s, e, fused) if moe else _swiglu_kept(fused) * s.f / s.tp * e
    ffn_gathered = not regather if not moe else moe_fold(spec, s) == 1  # (a folded MoE runs the sequence shards)
    norms = _norm(s, e, not regather, fused) + _norm(s, e, ffn_gathered, fused)
    return norms + _attention(s, e, cp_method) + _mla_latents(spec, s, e, fused) + ffn


def _block_kept_selective_op(spec: ModelSpec, s: Widths, e: int, layer: int) -> float:
    """Bytes per token ``selective_op`` keeps: the block input, matmul and attention outputs (under SP the
    row-parallel matmuls' outputs before their reduce-scatter, ``h``, and after it, ``h / T``)."""
    heads, kv = s.heads / s.tp, s.kv_heads / s.tp
    attention = (heads * s.head_dim + kv * (s.head_dim + s.v_head_dim) + heads * s.v_head_dim) * e + 4 * heads
    wo = (s.h + (s.h / s.sp if s.sp > 1 else 0)) * e
    if spec.is_moe_block(layer):
        k, fe = spec.top_k, spec.expert_ffn_dim
        ffn = 4 * spec.n_experts + k * (2 * fe + s.h) * e + (2 * fe + s.h) * spec.n_shared_experts * e
        ffn /= moe_fold(spec, s)
    else:
        ffn = 2 * s.f / s.tp * e + wo
    return s.h / s.sp * e + attention + wo + ffn


def _block_working(spec: ModelSpec, s: Widths, e: int, layer: int) -> float:
    """Bytes per token of a block's backward working set (the FFN's input and output gradients)."""
    if spec.is_moe_block(layer):
        return (2 * spec.top_k * spec.expert_ffn_dim + 2 * s.h) * e / moe_fold(spec, s)
    return (2 * s.f / s.tp + 2 * s.h) * e


def _kept(
    spec: ModelSpec, s: Widths, e: int, layer: int, c: Candidate, cp_method: str | None, fused: bool = False
) -> float:
    if c.recomputes(layer):
        return s.h / s.sp * e
    if c.recompute == "selective_op":
        return _block_kept_selective_op(spec, s, e, layer)
    return _block_kept(spec, s, e, layer, cp_method, regather=c.regather, fused=fused)


def _mtp_kept(
    spec: ModelSpec, s: Widths, e: int, c: Candidate, cp_method: str | None, depth: int, fused: bool = False
) -> float:
    """Bytes per token multi-token prediction's ``depth`` blocks keep: each a block, and what it reads (enorm,
    hnorm, their concatenation into eh_proj, post_norm); their heads are counted with the head's."""
    layers = range(spec.n_layers, spec.n_layers + depth)
    return sum(_kept(spec, s, e, i, c, cp_method, fused) + 3 * _norm(s, e, fused=fused) + 2 * s.h * e for i in layers)


def _in_flight(c: Candidate, pp_rank: int) -> tuple[float, int]:
    """(microbatches' worth of this rank's activations held at once, pipeline stages on the rank)."""
    if c.timeline is None:
        return 1.0, 1
    return c.timeline.in_flight(pp_rank), c.timeline.stages_per_rank


def _stage_outputs(
    c: Candidate, s: Widths, e: int, t: float, last: bool, held: tuple[float, int], pp_rank: int, polled: bool
) -> float:
    """Bytes of stage outputs and sent gradients a pipeline rank keeps beyond its blocks' saved tensors.

    A stage keeps each output until its backward of it (``parallel/pipeline/buffers.py`` frees it
    then, and the buffers it received into): the microbatches in flight. The last stage's logits
    live only while their microbatch is in flight (our step runs with return_outputs=False). On a
    backend whose sends are not ``polled`` (gloo), the gradients a multi-stage schedule sent back
    live until the step ends: those sent by the rank's peak moment (the simulated timeline's).
    ``held``: (microbatches in flight, stages on the rank).
    """
    in_flight, stages = held
    unit = t * s.h / s.sp * e  # one microbatch's hidden state
    kept = in_flight * (stages - (1 if last else 0)) * unit
    if not polled and c.timeline is not None and c.timeline.stages_per_rank > 1:
        kept += c.timeline.gradients_sent_at_peak[pp_rank] * unit
    return kept + (in_flight * t * 4 * s.vocab / s.tp if last else 0.0)


def activation_memory(
    workload: Workload,
    spec: ModelSpec,
    c: Candidate,
    layers: list[int],
    first: bool,
    last: bool,
    pp_rank: int,
    backward_grads: int = 0,
    polled: bool = True,
) -> dict[str, int]:
    """``{"activations", "working"}`` at this rank's peak moment (bytes).

    ``backward_grads``: gradient bytes that appear during backward and are not counted as held (a
    single rank's, ZeRO-3's shards without accumulation): present at the block moment, not the loss moment.
    ``polled``: :attr:`Hardware.sends_polled` (a pipeline's sent gradients are freed once sent).
    """
    e = workload.activation_bytes
    s = widths(spec, c)
    t = c.micro_batch_size * workload.seq_len / c.cp  # tokens per microbatch on this rank
    cp_method = c.cp_method if c.cp > 1 else None
    depth = spec.mtp_depth if last else 0  # multi-token prediction's blocks run on the head's rank
    fused = workload.fused_kernels
    blocks = sum(_kept(spec, s, e, i, c, cp_method, fused) for i in layers)
    blocks = (blocks + _mtp_kept(spec, s, e, c, cp_method, depth, fused)) * t
    rotary = spec.rope_head_dim or s.head_dim  # (MLA rotates a part of each head: its tables are that wide)
    rope = 2 * 4 * rotary * workload.seq_len * (c.micro_batch_size if c.cp > 1 else 1) / c.cp
    ids = 8 * t if first else 0.0
    head = head_working = 0.0
    if last:
        ids += 8 * t * (1 + 2 * depth)  # labels, and each depth's tokens and labels ahead
        if workload.fused_cross_entropy:
            head_working = s.h * e * t + 2 * 4 * s.vocab / s.tp * min(t, 1024)
        else:
            log_softmax = 4 * s.vocab / s.tp
            head = (_norm(s, e, fused=fused) + log_softmax) * t * (1 + depth)  # (each MTP depth's logits too)
            # Backward of the loss: the gradients of the log-softmax and of the logits (loss
            # parallelism keeps two more vocabulary-wide tensors), then of the hidden state.
            head_working = (2 + (2 if c.tp > 1 else 0)) * log_softmax * t + s.h * e * t
    held = _in_flight(c, pp_rank)
    outputs = _stage_outputs(c, s, e, t, last, held, pp_rank, polled) if c.pp > 1 else 0.0
    kept = (blocks + head + ids + rope) * held[0] + outputs
    block_moment = _block_moment(spec, s, e, c, layers[-1], cp_method, fused) * t - head if layers else 0.0
    working = max(head_working, block_moment + backward_grads, _forward_end(workload, c, s, t, last, backward_grads))
    return {"activations": round(kept), "working": round(working)}


def _block_moment(
    spec: ModelSpec, s: Widths, e: int, c: Candidate, i: int, cp_method: str | None, fused: bool
) -> float:
    """Bytes per token beside the kept activations when block ``i`` (the rank's last) starts its backward: its
    working set, and what it recomputes; the caller takes the loss's tensors away (gone by then)."""
    moment = _block_working(spec, s, e, i)
    if c.recomputes(i) or c.recompute == "selective_op":
        moment += _block_kept(spec, s, e, i, cp_method, fused=fused) - _kept(spec, s, e, i, c, cp_method, fused)
    return moment


def _forward_end(workload: Workload, c: Candidate, s: Widths, t: float, last: bool, grads: int) -> float:
    """Bytes beside the kept activations when the forward ends (the loss computed): Lightning's closure clears the
    last step's gradients only after ``training_step`` (a pipeline's runner clears them before its schedule), and
    the logits live (their fp32 copy beside them under bf16) until the loss's backward frees them."""
    if c.pp > 1:
        return 0.0
    e = workload.activation_bytes
    logits = 0.0 if workload.fused_cross_entropy or not last else t * s.vocab / s.tp * (e + (4 if e < 4 else 0))
    return grads + logits


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
    """Fill ``cost``'s step time, tokens/s, MFU and bubble (seconds per optimizer step).

    FLOPs (plus what the plugins add: recomputation) over the achieved matmul rate; each plugin's
    traffic timed on its links, minus the compute it can hide behind (its ``hidden_by``); traffic
    inside the step stretches with the pipeline bubble, the rest is paid once per step.
    """
    flops_token = workload.flops_per_token(workload.seq_len)
    peak = gpu.peak_for(workload.precision)  # fp32 runs at the TF32 peak, not the bf16 one
    assert cost.view is not None
    parts = model_compute(cost.view, gpu, workload.precision, [t.host for t in cost.terms if t.host])
    memory_bound = parts["memory_bound"] * (1 + sum(t.extra_memory_bound for t in cost.terms))
    matmul = parts["matmul"] * (1 + sum(t.extra_matmul for t in cost.terms))
    compute = (matmul + parts["attention"] + memory_bound + parts["host"]) * (
        1 + sum(t.extra_compute for t in cost.terms)
    )
    optimizer = sum(t.step_bytes for t in cost.terms) / (gpu.memory_bandwidth * gpu.memory_efficiency)
    optimizer += sum(  # the optimizer's own GEMMs (Muon's Newton-Schulz), in bf16
        flops / (gpu.peak_flops * gpu.matmul_efficiency * gpu.gemm_factor(width))
        for t in cost.terms
        for width, flops in t.step_flops.items()
    )
    seconds: dict[str, float] = {}
    critical = exposed = bubble = 0.0
    fold = moe_fold(cost.view.spec, cost.view.widths)
    for terms in cost.terms:
        for traffic, calls, hidden_by in (
            (terms.traffic, terms.calls, terms.hidden_by),
            (terms.forward_traffic, terms.forward_calls, FORWARD_SHARE),
        ):
            spent = 0.0
            for key, payload in traffic.items():
                dim, took = _collective_seconds(key, payload, c, dims, gpu, fold, calls.get(key, 1))
                seconds[dim] = seconds.get(dim, 0.0) + took
                spent += took
            beside = terms.hidden_by_matmul * parts["matmul"] + terms.hidden_by_attention * parts["attention"]
            hidden = hidden_by * compute + (beside if traffic is terms.traffic else 0)
            shown = max(0.0, spent - hidden)
            critical, exposed = (critical + shown, exposed) if terms.in_step else (critical, exposed + shown)
        bubble += terms.bubble
    total = (compute + critical) * (1 + bubble) + exposed + optimizer
    cost.step_time = total
    cost.tokens_per_s = workload.tokens_per_step / total
    cost.mfu = flops_token * cost.tokens_per_s / (c.world_size * peak)
    cost.bubble = bubble
    cost.time_parts = {"compute": compute, "critical_comm": critical, "exposed_dp_comm": exposed,
                       "optimizer_step": optimizer, **parts, **seconds}  # fmt: skip


#: The forward's share of a step's compute (the backward runs twice its FLOPs).
FORWARD_SHARE = 1 / 3


def _collective_seconds(
    key: str, payload: int, c: Candidate, dims: ParallelDims, gpu: Hardware, fold: int = 1, calls: int = 1
) -> tuple[str, float]:
    """``(dim, seconds)`` of one ``"dim:op"`` payload in ``calls`` calls on the links its group spans (``fold``: tp
    ranks that share the MoE layers' tokens, whose ep groups then hold neighbouring ranks). Each call pays the
    collective's latency (:meth:`~lightning_ultrascale.plan.hardware.Hardware.collective_latency`): a call is a
    launch, the sends of one ``batch_isend_irecv`` together (``CommTracer.launches`` counts them so).

    A ring collective (all-reduce, all-gather, reduce-scatter) over a group spanning nodes runs one ring per
    local rank (NCCL's channels), each leaving the node through another rank's NIC: a rank's wire bytes cross
    the network ``1 / local`` of them, the rest NVLink (nccl-tests' multi-node bus bandwidth of 8-GPU H100
    nodes, ~8 x 46 GB/s, is the node's NICs together). A group with one rank per node, and a point-to-point
    send, use the rank's own NIC.
    """
    dim, op = key.split(":")
    calls = 0 if op == "recv" else calls  # (a receive is the other end of a send: one latency for the two)
    if dim == "ep":  # ep neighbours of the borrowed ranks: tp apart, or neighbours where the MoE folds over tp
        return dim, _all_to_all_seconds(payload, c.ep, 1 if fold > 1 else dims.tp, gpu, calls)
    names = _mesh_dims(dim)
    size = math.prod(getattr(dims, d) for d in names)
    intra = _group_span(dims, names) <= gpu.gpus_per_node
    wire = wire_bytes(op, int(payload), size)
    nvlink = gpu.intra_node_bandwidth * gpu.link_efficiency
    if intra:
        return dim, wire / nvlink + calls * gpu.collective_latency(op, size)
    on_a_node = _ranks_per_node(dims, names, gpu.gpus_per_node)
    latency = calls * gpu.collective_latency(op, size, nodes=max(2, size // on_a_node))
    local = on_a_node if op in RING_OPS else 1
    network = wire / local / (gpu.inter_node_bandwidth * gpu.network_efficiency)
    return dim, max(network, wire * (local - 1) / local / nvlink) + latency


#: The collectives NCCL runs as rings over a group (one ring per channel), whose bytes a node's NICs share.
RING_OPS = ("all_reduce", "all_gather", "reduce_scatter")


def _ranks_per_node(dims: ParallelDims, names: list[str], gpus_per_node: int) -> int:
    """How many members of a group over mesh dims ``names`` share a node (row-major mesh, power-of-two sizes).

    Example:
        >>> from lightning_ultrascale.parallel.dims import ParallelDims
        >>> dims = ParallelDims(dp_shard=16, tp=2)
        >>> _ranks_per_node(dims, ["dp_shard"], 8), _ranks_per_node(dims, ["tp"], 8)  # 4 data ranks a node, tp apart
        (4, 2)
    """
    local, stride = 1, 1
    for d in reversed(MESH_DIMS):
        size = getattr(dims, d)
        if d in names:
            local *= min(size, max(1, gpus_per_node // stride))
        stride *= size
    return local


def _all_to_all_seconds(payload: float, size: int, stride: int, gpu: Hardware, calls: int = 1) -> float:
    """An all-to-all of ``payload`` bytes a rank over ``size`` ranks ``stride`` apart: ``1/size`` of it to each
    peer, those on the rank's node over NVLink while the others go over the network (at the same time).

    Example:
        >>> from lightning_ultrascale.plan.hardware import get_hardware
        >>> h100 = get_hardware("h100")
        >>> one_node, four_nodes = (_all_to_all_seconds(1e9, n, 1, h100) for n in (8, 32))
        >>> round(four_nodes / one_node, 1)  # (3/4 of the bytes leave the node, at the network's rate)
        6.8
    """
    local = max(1, min(size, gpu.gpus_per_node // stride))  # the group's ranks on one node
    nvlink = payload * (local - 1) / size / (gpu.intra_node_bandwidth * gpu.link_efficiency)
    network = payload * (size - local) / size / (gpu.inter_node_bandwidth * gpu.network_efficiency)
    return max(nvlink, network) + calls * gpu.collective_latency("all_to_all", size, nodes=size // local)


@dataclass(frozen=True)
class _Held:
    """What a rank's shard plan holds of the model, as pricing reads it: its blocks, the embedding, the head."""

    plan: ShardPlan
    layers: tuple[int, ...]
    first: bool
    last: bool

    @classmethod
    def of(cls, plan: ShardPlan, spec: ModelSpec) -> _Held:
        prefix = f"{spec.layers}."
        layers = sorted({int(n[len(prefix) :].split(".")[0]) for n in plan.shapes if n.startswith(prefix)})
        first = f"{spec.embedding}.weight" in plan.shapes
        last = f"{spec.head}.weight" in plan.shapes or (spec.head is None and first)
        return cls(plan, tuple(layers), first, last)


def _rank_cost(
    workload: Workload, c: Candidate, model: nn.Module, holds: _Held, rank: int, accumulation: int, polled: bool
) -> Cost:
    """Memory and traffic of one rank holding ``holds.plan``: every plugin's terms composed (no time yet)."""
    spec = priced_spec(model)
    plan, layers, first, last = holds.plan, holds.layers, holds.first, holds.last
    view = RankView(workload, c, plan, layers, first, last, accumulation, widths(spec, c), spec)
    terms = [t for t in (p.plan_cost(view) for p in c.plugins if p.active) if t is not None]
    if workload.optimizer == "muon":
        terms.append(muon_cost(view, c.zero))
    states = [t.state for t in terms if t.state is not None]
    if len(states) != 1:
        raise ConfigError(f"the plugins of {c.label()} state {len(states)} model states; exactly one data plugin must")
    state, held = states[0], sum(t.held_grads for t in terms)
    # Gradients not held between steps still exist by the first block's backward.
    grads = 0 if held else state["grads"]
    act = activation_memory(workload, spec, c, layers, first, last, plan.coordinate["pp"], grads, polled)
    memory = {
        "params": state["params"],
        "optimizer": state["optimizer"],
        "grads": held,
        "activations": act["activations"],
        "working": act["working"] + sum(t.working for t in terms),
    }
    comm: dict[str, int] = {}
    calls: dict[str, int] = {}
    for t in terms:
        for key, payload in (*t.traffic.items(), *t.forward_traffic.items()):
            comm[key] = comm.get(key, 0) + payload
        for key, count in (*t.calls.items(), *t.forward_calls.items()):
            calls[key] = calls.get(key, 0) + count
    return Cost(c, rank, memory, comm, state, terms=terms, view=view, calls=calls)


# ----------------------------------------------------------------------------- one layout
def estimate(
    workload: Workload,
    candidate: Candidate,
    model: nn.Module,
    gpu: Hardware | None = None,
    ranks: list[int] | None = None,
    shard_cache: dict[Any, Any] | None = None,
) -> list[Cost]:
    """The cost of ``candidate`` on each of ``ranks`` (default: the first rank of every pipeline stage).

    ``gpu``: times each rank's step too (without it: memory as on NCCL, ``Hardware.sends_polled``).
    ``model``: the whole model on the meta device (``build_model(cfg, device="meta")``). The layout
    is validated first by the real plugins (``UltraScaleStrategy.validate``). ``shard_cache``: a
    dict kept across calls for the same model (the search does): shard plans depend on the sizes
    and the pipeline placement only, not on batch sizes or recomputation.

    Example:
        >>> from lightning_ultrascale.models import build_model, get_model_config
        >>> w = Workload(get_model_config("llama_tiny"), seq_len=256, global_batch_size=4, precision="32-true")
        >>> layout = Candidate.layout(dp=2, zero=3, micro_batch_size=2)
        >>> [cost] = estimate(w, layout, build_model("llama_tiny", device="meta"))
        >>> cost.model_state
        {'params': 476288, 'grads': 476288, 'optimizer': 952732}
    """
    from lightning_ultrascale.plan.shards import predict_shards

    c, polled = candidate, gpu is None or gpu.sends_polled
    _check_agrees(workload, c)
    strategy = c.strategy()
    world = c.world_size
    strategy.validate(model.spec, c.data_shape(workload), world_size=world)  # type: ignore[arg-type]
    dims = strategy.parallel_dims
    accumulation = dims.grad_accumulation(workload.global_batch_size, c.batch_per_rank)
    if ranks is None:
        ranks = sorted({p * (world // c.pp) for p in range(c.pp)})
    costs = []
    # (ZeRO 0-2 leave parameters whole: one plan for the three.)
    cache, shape_key, spec = {} if shard_cache is None else shard_cache, c.shards_key(), priced_spec(model)
    for rank in ranks:
        if (shape_key, rank) not in cache:
            cache[shape_key, rank] = _Held.of(predict_shards(strategy, model, world, rank), spec)
        cost = _rank_cost(workload, c, model, cache[shape_key, rank], rank, accumulation, polled)
        if gpu is not None:
            step_time(workload, c, cost, dims, gpu)
        costs.append(cost)
    return costs


def _check_agrees(workload: Workload, c: Candidate) -> None:
    if c.reduce_dtype != workload.reduce_dtype:
        raise ConfigError(
            f"the layout's ZeRO(reduce_dtype={c.reduce_dtype!r}) disagrees with Workload(reduce_dtype="
            f"{workload.reduce_dtype!r}); valid: the same value in both (the run's parallel.zero.reduce_dtype)"
        )
