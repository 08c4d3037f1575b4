"""How long one rank computes per optimizer step: the model's work, term by term.

- **Matmuls by shape**: every GEMM of a block (q, k, v, o, MLA's down to its latents and up per head;
  w1, w3, w2; an MoE layer's router,
  routed and shared experts; the head) at its local shape under tensor, context and expert
  parallelism, each on the roofline ``max(FLOPs / (peak x matmul_efficiency), bytes / (bandwidth x
  memory_efficiency))``: narrow GEMMs (small ``N`` under TP, few tokens under CP or for an expert)
  fall from compute-bound to memory-bound on their own. Backward runs each shape twice.
- **FP8** (``Workload.fp8``): the block linears a recipe converts run their FP8 GEMMs at the GPU's
  measured FP8/bf16 ratio, plus the recipe's quantisation passes (:mod:`lightning_ultrascale.plan.fp8`).
- **Attention** at its kernel's efficiency: causal, so each of a rank's tokens attends to half the
  sequence on average; flash attention's backward recomputes the scores (2.5x the forward).
- **Memory-bound kernels** by bytes at memory bandwidth: fused (``Workload.fused_kernels``), per
  block two RMSNorms, two residual adds, RoPE on q and k, SwiGLU's product, each read and written
  once forward and twice backward; eager, the elements our block's ops really move (counted:
  ``EAGER_ELEMENTS``); the loss's softmax over the vocabulary.
- **Host time**: kernels per block and for embedding, head and loss, counted by a dispatch mode on
  our Llama in eager mode (torch 2.13: 215 per dense block forward and backward, 307 per MoE
  block, 60 outside the blocks), times the device's unhidden ``op_overhead``, plus its
  ``step_overhead`` per micro-step and each technique's ``host_overheads`` per block (0 on GPUs).

The optimizer step (the data plugin's ``step_bytes``) and what recomputation adds are composed by
:func:`~lightning_ultrascale.plan.cost.step_time`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lightning_ultrascale.parallel.pricing import RankView, moe_fold
from lightning_ultrascale.plan.fp8 import linear_seconds
from lightning_ultrascale.plan.hardware import Hardware

__all__ = ["model_compute"]

#: Elements an eager block reads and writes per token outside its matmuls and attention, forward and
#: backward: ``120 h + 14 f``, counted by a dispatch mode on our Llama at three widths (torch 2.13;
#: views excluded).
EAGER_ELEMENTS = (120, 14)
#: An MoE block's routing on top (dispatch, permutation and combine of each token's k rows):
#: ``24 k h`` (counted at k = 2: 168 h in all).
EAGER_ROUTED_ELEMENTS = 24

#: Kernels dispatched per block (forward + backward) and outside the blocks, counted on our Llama.
OPS_PER_DENSE_BLOCK, OPS_PER_MOE_BLOCK, OPS_OUTSIDE_BLOCKS = 215, 307, 60


def model_compute(rank: RankView, gpu: Hardware, precision: str, hosts: Sequence[str] = ()) -> dict[str, float]:
    """Seconds per optimizer step of ``rank``'s own work: ``matmul``, ``attention``, ``memory_bound``, ``host``.

    ``host``: kernel launches, the loop's own time per micro-step, and per block the host time of
    each technique in ``hosts`` (the device's ``host_overheads``; ``"expert"`` per MoE block).
    """
    peak = gpu.peak_for(precision)
    flop_rate = peak * gpu.matmul_efficiency
    byte_rate = gpu.memory_bandwidth * gpu.memory_efficiency
    e, t, s = rank.element_bytes, rank.tokens, rank.widths
    spec = rank.spec

    def gemm(m: float, k: float, n: float, count: float = 1) -> float:
        rate = flop_rate * gpu.gemm_factor(min(k, n))
        return count * max(2 * m * k * n / rate, e * (m * k + k * n + m * n) / byte_rate)

    linear = _linear(gemm, rank, gpu, byte_rate)

    matmul = attention = memory = 0.0
    ops = OPS_OUTSIDE_BLOCKS * (rank.first or rank.last)
    # Multi-token prediction's blocks run after the head, where it is (a pipeline refuses MTP: every rank).
    mtp = spec.mtp_blocks if rank.last else range(0)
    kinds = [spec.is_moe_block(layer) for layer in [*rank.layers, *mtp]]
    for moe in (False, True):  # every block of a kind costs the same: priced once, counted
        if count := kinds.count(moe):
            block = _block_seconds(rank, gpu, peak, gemm, linear, moe)
            matmul, attention, memory = (
                total + count * part for total, part in zip((matmul, attention, memory), block)
            )
            ops += count * (OPS_PER_MOE_BLOCK if moe else OPS_PER_DENSE_BLOCK)
    if rank.last:  # the head, and again per MTP depth with its [2h -> h] projection before the block
        matmul += gemm(t, s.h, s.vocab / s.tp, 3) * (1 + len(mtp)) + gemm(t, 2 * s.h, s.h, 3 * len(mtp))
        memory += 4 * 4 * t * s.vocab / s.tp / byte_rate * (1 + len(mtp))  # log-softmax: read, write; and back
    m = rank.forwards
    moe_blocks = sum(1 for i in rank.layers if spec.is_moe_block(i))
    per_block = sum(gpu.host_overhead(h) * (moe_blocks if h == "expert" else len(rank.layers)) for h in hosts)
    host = (ops * gpu.op_overhead + per_block) * m + gpu.step_overhead * rank.accumulation
    return {"matmul": matmul * m, "attention": attention * m, "memory_bound": memory * m, "host": host}


def _block_seconds(
    rank: RankView, gpu: Hardware, peak: float, gemm: Callable[..., float], linear: Callable[..., float], moe: bool
) -> tuple[float, float, float]:
    """One block's ``(matmul, attention, memory_bound)`` seconds a forward with its backward."""
    e, t, s, spec = rank.element_bytes, rank.tokens, rank.widths, rank.spec
    byte_rate = gpu.memory_bandwidth * gpu.memory_efficiency
    matmul = _attention_gemms(linear, rank) + (_moe_gemms(gemm, linear, rank) if moe else _dense_gemms(linear, rank))
    pairs = t * rank.workload.seq_len / 2  # causal: half the sequence per token on average
    flops = 2 * pairs * s.heads / s.tp * (s.head_dim + s.v_head_dim)
    attention = 3.5 * flops / (peak * gpu.attention_efficiency)
    # an MoE block's FFN width: its routed (top-k) and shared experts'; its rows are routed k times (a
    # tp rank's share of the tokens where its MoE layers fold over tp)
    fold = moe_fold(spec, s) if moe else 1
    f = (spec.top_k + spec.n_shared_experts) * spec.expert_ffn_dim / fold if moe else s.f / s.tp
    routed = EAGER_ROUTED_ELEMENTS * spec.top_k * s.h * _expert_load(rank) / fold if moe else 0.0
    if rank.workload.fused_kernels:  # each logical op reads and writes once: forward, and twice backward
        per_token = 3 * (10 * s.h / s.sp + 2 * (s.heads + s.kv_heads) * s.head_dim / s.tp + 3 * f) + routed / 4
    else:  # eager, as counted on our block (EAGER_ELEMENTS)
        per_token = EAGER_ELEMENTS[0] * s.h / s.sp + EAGER_ELEMENTS[1] * f + routed
    return matmul, attention, t * per_token * e / byte_rate


def _linear(gemm: Callable[..., float], rank: RankView, gpu: Hardware, byte_rate: float) -> Callable[..., float]:
    """A block linear's three GEMMs (forward, input and weight gradients), in FP8 where the workload's recipe
    converts it."""
    recipe, tp = rank.workload.fp8, rank.widths.tp
    # tensorwise agrees on each activation's scale over the tensor-parallel group: 2 scalar all-reduces a linear
    sync = 2 * gpu.intra_node_latency * (tp - 1) if recipe == "tensorwise" and tp > 1 else 0.0
    return lambda m, k, n: linear_seconds(gemm, m, k, n, recipe, gpu, byte_rate, sync)


def _attention_gemms(linear: Callable[..., float], rank: RankView) -> float:
    """q, k, v and o. MLA's down projections to its latents stay whole on every tp rank; the up projections
    from them split the heads (``mla_tp_plan``)."""
    s, t, spec = rank.widths, rank.tokens, rank.spec
    q, o = s.heads * s.head_dim / s.tp, linear(t, s.heads * s.v_head_dim / s.tp, s.h)
    if not spec.kv_lora_rank:
        return linear(t, s.h, q) + linear(t, s.h, s.kv_heads * (s.head_dim + s.v_head_dim) / s.tp) + o
    latent, nope = spec.kv_lora_rank, s.head_dim - spec.rope_head_dim
    kv = linear(t, s.h, latent + spec.rope_head_dim) + linear(t, latent, s.kv_heads * (nope + s.v_head_dim) / s.tp)
    if spec.q_lora_rank:
        return linear(t, s.h, spec.q_lora_rank) + linear(t, spec.q_lora_rank, q) + kv + o
    return linear(t, s.h, q) + kv + o


def _dense_gemms(linear: Callable[..., float], rank: RankView) -> float:
    s, t = rank.widths, rank.tokens
    return 2 * linear(t, s.h, s.f / s.tp) + linear(t, s.f / s.tp, s.h)  # w1 and w3, w2


def _expert_load(rank: RankView) -> float:
    """How many times the mean routed rows the busiest expert rank runs (the others wait for it)."""
    ep = rank.layout.ep
    return rank.workload.load_for(rank.spec.n_experts / ep) if ep > 1 else 1.0


def _moe_gemms(gemm: Callable[..., float], linear: Callable[..., float], rank: RankView) -> float:
    """Router; each local expert's share of the routed rows (times the busiest rank's load); shared experts.
    Folded over tp, a rank routes its share of the tokens."""
    spec, s = rank.spec, rank.widths
    t = rank.tokens / moe_fold(spec, s)
    fe = spec.expert_ffn_dim
    local = spec.n_experts / rank.layout.ep
    rows = t * spec.top_k / local * _expert_load(rank)  # rows per local expert: t x k rows arrive, spread over them
    routed = gemm(rows, s.h, fe, 6 * local) + gemm(rows, fe, s.h, 3 * local)
    shared = spec.n_shared_experts * fe
    out = gemm(t, s.h, spec.n_experts, 3)
    if shared:
        out += 2 * linear(t, s.h, shared) + linear(t, shared, s.h)
    return routed + out
