"""Attention over a sequence split across the ``cp`` ranks: ring, zig-zag ring and all-to-all (Ulysses).

**Ring** (Liu et al. 2023, the playbook's "Ring Attention"). Each rank keeps its queries; the key
and value blocks travel around the ring, and each rank merges its partial results with their
log-sum-exp in fp32 (the online softmax of FlashAttention). The backward pass sends the K/V blocks
around again, together with their gradient accumulators, which arrive home after a full circle.
Only the kv heads travel (grouped-query attention expands them locally).

Which blocks a rank computes at ring step ``i`` (keys from rank ``src = rank - i``):

* contiguous split (``ring``): rank ``r`` holds chunk ``r``. ``src == r``: the causal diagonal;
  ``src < r``: all of it; ``src > r``: nothing, so rank ``cp - 1`` does ``cp`` times the work of rank 0;
* zig-zag split (``zigzag_ring``): the sequence is cut into ``2 cp`` chunks of ``c`` tokens and rank
  ``r`` holds chunks ``r`` and ``2cp-1-r``. ``src == r``: the causal diagonal of its ``2c`` tokens;
  ``src < r``: all queries against the source's first chunk; ``src > r``: the second query chunk
  against both source chunks. Every step costs ``2c^2`` score pairs on every rank: balanced.

**All-to-all** (Ulysses, Jacobs et al. 2023): scatter heads and gather the sequence, run ordinary
causal attention on whole sequences of ``h / cp`` heads, and scatter back. Heads must divide by cp.

The local kernel is one of :data:`KERNELS`: ``"flash"`` (the default: torch's fused attention
kernel for the tensors' device, which returns the log-sum-exp and takes the global output and LSE
in its backward, exactly what the ring needs, as torch's own context parallel uses it; on CPU the
CPU flash kernel, on CUDA FlashAttention-2 or the memory-efficient kernel; one code path, so the
CPU tests run the ring logic the GPU runs) or ``"reference"`` (:func:`block_attention`, an exact
fp32 reference in plain matmuls, O(block^2) memory: for tests). The ring is one torch op
(``ultrascale::ring_attention``) with its backward op, so activation recomputation sees it whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_ultrascale.parallel.context.comms import RingExchange, all_to_all

METHODS = ("ring", "zigzag_ring", "all_to_all")


# ------------------------------------------------------------------------------------ sequence layout
def local_positions(method: str, seq_len: int, cp: int, rank: int) -> Tensor:
    """The positions of the sequence that ``rank`` holds (zig-zag: chunks ``r`` and ``2cp-1-r``).

    Example:
        >>> local_positions("zigzag_ring", 8, 2, 0).tolist(), local_positions("ring", 8, 2, 1).tolist()
        ([0, 1, 6, 7], [4, 5, 6, 7])
    """
    if method == "zigzag_ring":
        c = seq_len // (2 * cp)
        first, second = rank * c, (2 * cp - 1 - rank) * c
        return torch.cat((torch.arange(first, first + c), torch.arange(second, second + c)))
    n = seq_len // cp
    return torch.arange(rank * n, (rank + 1) * n)


@dataclass(frozen=True)
class Block:
    """One local attention call: query rows ``q`` against key rows ``k`` (slices), causal or not."""

    q: slice
    k: slice
    causal: bool


def ring_blocks(method: str, rank: int, src: int, local_len: int) -> list[Block]:
    """What ``rank`` computes with the keys of ``src`` (see the module docstring)."""
    everything = slice(0, local_len)
    if src == rank:
        return [Block(everything, everything, causal=True)]
    if method == "ring":
        return [Block(everything, everything, causal=False)] if src < rank else []
    half = local_len // 2
    if src < rank:
        return [Block(everything, slice(0, half), causal=False)]
    return [Block(slice(half, local_len), everything, causal=False)]


# ------------------------------------------------------------------------------------ local kernel
@dataclass
class FlopCounter:
    """Attention score pairs computed (query x key, unmasked), summed: for load-balance checks."""

    pairs: int = 0


#: Set to a FlopCounter to count the work of every local block (tests and benchmarks).
FLOPS: FlopCounter | None = None


def _count(q: Tensor, k: Tensor, causal: bool) -> None:
    if FLOPS is not None:
        n = q.shape[-2] * k.shape[-2]
        pairs = n - (q.shape[-2] * (q.shape[-2] - 1)) // 2 if causal else n
        FLOPS.pairs += pairs * q.shape[0] * q.shape[1]


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def block_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """``softmax(q k^T scale) v`` and its log-sum-exp per query row, in fp32 (``[b, h, s, d]`` inputs)."""
    _count(q, k, causal)
    s = _scores(q.float(), k.float(), causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse[..., None]), v.float())
    return out, lse


def block_attention_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the GLOBAL output and ``lse`` of its query rows (FlashAttention-2)."""
    delta = (dout * out).sum(-1)
    s = _scores(q.float(), k.float(), causal, scale)
    p = torch.exp(s - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, v.float().transpose(-1, -2)) - delta[..., None])
    dq = torch.matmul(ds, k.float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    return dq, dk, dv


def _pad(x: Tensor, dim: int) -> Tensor:
    # The fused kernels want one head size for q, k and v; MLA's v is narrower than q/k. Zero
    # columns add nothing to the scores nor to the output's real columns, forward or backward.
    return x if x.shape[-1] == dim else F.pad(x, (0, dim - x.shape[-1]))


def _cuda_flash(q: Tensor) -> bool:
    """FlashAttention-2 (half precision, head size <= 256); otherwise the memory-efficient kernel (fp32 too)."""
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def _flash_block(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """One block through torch's fused attention for the device, with its log-sum-exp: O(block) memory.

    CPU: the CPU flash kernel; CUDA: FlashAttention-2, or the memory-efficient kernel where flash
    does not apply (fp32, head size > 256), whose LSE is padded to a multiple of 32 rows.
    """
    _count(q, k, causal)
    d = max(q.shape[-1], v.shape[-1])
    q_, k_, v_ = _pad(q, d), _pad(k, d), _pad(v, d)
    aten = torch.ops.aten
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q_, k_, v_, 0.0, causal, scale=scale)[:2]
    elif _cuda_flash(q):
        out, lse = aten._scaled_dot_product_flash_attention(q_, k_, v_, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = aten._scaled_dot_product_efficient_attention(q_, k_, v_, None, True, 0.0, causal, scale=scale)[:2]
        lse = lse[..., : q.shape[-2]]
    return out[..., : v.shape[-1]].float(), lse.float()


def _flash_block_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The same kernel's backward, given the GLOBAL output and LSE of the block's query rows."""
    d = max(q.shape[-1], v.shape[-1])
    dout_, q_, k_, v_, out_ = (_pad(t, d) for t in (dout.to(q.dtype), q, k, v, out.to(q.dtype)))
    aten = torch.ops.aten
    if q.device.type == "cpu":
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout_, q_, k_, v_, out_, lse, 0.0, causal, scale=scale
        )
    elif _cuda_flash(q):
        # Dense (not variable-length) batches and no dropout: empty cumulative lengths and RNG state.
        none = torch.empty(0, dtype=torch.int64, device=q.device)
        lengths = (q.shape[-2], k.shape[-2])
        grads = aten._scaled_dot_product_flash_attention_backward(
            dout_, q_, k_, v_, out_, lse, none, none, *lengths, 0.0, causal, none, none, scale=scale
        )
    else:
        padded = F.pad(lse, (0, -lse.shape[-1] % 32))  # the kernel's own LSE layout
        none = torch.empty(0, dtype=torch.int64, device=q.device)
        grads = aten._scaled_dot_product_efficient_attention_backward(
            dout_, q_, k_, v_, None, out_, padded, none, none, 0.0, [True, True, True, False], causal, scale=scale
        )
    dq, dk, dv = (g[..., : t.shape[-1]].float() for g, t in zip(grads[:3], (q, k, v)))
    return dq, dk, dv


#: Local kernels: name -> (forward returning (out, lse), backward given the global out and lse).
#: ``"flash"`` is the device's fused kernel (the default); ``"reference"`` the exact fp32 matmuls.
KERNELS: dict[str, tuple[Callable[..., tuple[Tensor, Tensor]], Callable[..., tuple[Tensor, Tensor, Tensor]]]] = {
    "flash": (_flash_block, _flash_block_backward),
    "reference": (block_attention, block_attention_backward),
}


def _expand(kv: Tensor, n_rep: int) -> Tensor:
    return kv.repeat_interleave(n_rep, dim=1) if n_rep > 1 else kv


def _fold(grad: Tensor, n_rep: int) -> Tensor:
    # The gradient of repeat_interleave: sum over the query heads that shared a kv head.
    if n_rep == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // n_rep, n_rep, s, d).sum(2)


# ------------------------------------------------------------------------------------ ring attention
def _ring_forward(q: Tensor, k: Tensor, v: Tensor, group_name: str, method: str, kernel: str) -> tuple[Tensor, Tensor]:
    """This rank's attention output (in q's dtype) and its fp32 log-sum-exp over the whole ring."""
    block_forward = KERNELS[kernel][0]
    ring = RingExchange(_resolve_process_group(group_name))
    rank, size = ring.rank, ring.size
    n_rep = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    length = q.shape[-2]
    # Laid out [b, s, heads, d_v] in memory: the output projection reads it as [b, s, heads x d_v]
    # without a copy. (d_v is v's head size, which MLA makes differ from q's and k's.)
    b, h, s = q.shape[:3]
    out = torch.zeros(b, s, h, v.shape[-1], dtype=torch.float32, device=q.device).transpose(1, 2)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    kv = (k.contiguous(), v.contiguous())
    for step in range(size):
        src = (rank - step) % size
        incoming = ring.start(*kv) if step < size - 1 else None  # overlaps the compute below
        for blk in ring_blocks(method, rank, src, length):
            o, block_lse = block_forward(
                q[:, :, blk.q], _expand(kv[0][:, :, blk.k], n_rep), _expand(kv[1][:, :, blk.k], n_rep),
                blk.causal, scale,
            )  # fmt: skip
            # Online-softmax merge of two partial results by their log-sum-exp, in fp32.
            old = lse[:, :, blk.q]
            merged = torch.logaddexp(old, block_lse)
            out[:, :, blk.q] = (
                out[:, :, blk.q] * torch.exp(old - merged)[..., None] + o * torch.exp(block_lse - merged)[..., None]
            )
            lse[:, :, blk.q] = merged
        if incoming is not None:
            ring.wait()
            kv = (incoming[0], incoming[1])
    return out.to(q.dtype), lse


def _ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, group_name: str, method: str, kernel: str
) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV. The K/V blocks go round again; each block's dK/dV accumulator travels with it.

    An accumulator moves on after the step that adds to it and is waited for only after the next
    step's compute (its transfer overlaps that compute); it travels in the compute dtype (q's) and
    is summed in fp32 on each rank.
    """
    block_backward = KERNELS[kernel][1]
    group = _resolve_process_group(group_name)
    kv_ring, grad_ring = RingExchange(group), RingExchange(group)
    rank, size = kv_ring.rank, kv_ring.size
    n_rep = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    length = q.shape[-2]
    dout = dout.float()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = (k.contiguous(), v.contiguous())
    arriving: list[Tensor] = []
    for step in range(size):
        src = (rank - step) % size
        incoming = kv_ring.start(*kv) if step < size - 1 else None
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for blk in ring_blocks(method, rank, src, length):
            gq, gk, gv = block_backward(
                q[:, :, blk.q], _expand(kv[0][:, :, blk.k], n_rep), _expand(kv[1][:, :, blk.k], n_rep),
                out[:, :, blk.q], lse[:, :, blk.q], dout[:, :, blk.q], blk.causal, scale,
            )  # fmt: skip
            dq[:, :, blk.q] += gq
            dk[:, :, blk.k] += _fold(gk, n_rep)
            dv[:, :, blk.k] += _fold(gv, n_rep)
        if step > 0:  # this block's accumulator, sent by the previous rank after its last step
            grad_ring.wait()
            dk, dv = dk + arriving[0].float(), dv + arriving[1].float()
        if size == 1:  # home already
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        # Every accumulator moves on, size times in all: the last move brings it home.
        arriving = grad_ring.start(dk.to(q.dtype), dv.to(q.dtype))
        if incoming is not None:
            kv_ring.wait()
            kv = (incoming[0], incoming[1])
    grad_ring.wait()
    return dq.to(q.dtype), arriving[0].to(k.dtype), arriving[1].to(v.dtype)


def _resolve_process_group(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


# One op to torch, not a Python autograd Function: selective recomputation (which sees every op
# dispatched while a block runs) keeps this op's output and LSE, and none of the per-block
# kernels' outputs or score blocks inside it (an autograd Function would expose them all: cp
# block outputs per layer, or O(block^2) scores with the reference kernel).
@torch.library.custom_op("ultrascale::ring_attention", mutates_args=())
def _ring_attention_op(
    q: Tensor, k: Tensor, v: Tensor, group_name: str, method: str, kernel: str
) -> tuple[Tensor, Tensor]:
    return _ring_forward(q, k, v, group_name, method, kernel)


@_ring_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, group_name: str, method: str, kernel: str) -> tuple[Tensor, Tensor]:
    b, h, s = q.shape[:3]
    out = q.new_empty(b, s, h, v.shape[-1]).transpose(1, 2)
    return out, q.new_empty(b, h, s, dtype=torch.float32)


@torch.library.custom_op("ultrascale::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, group_name: str, method: str, kernel: str
) -> tuple[Tensor, Tensor, Tensor]:
    return _ring_backward(dout, q, k, v, out, lse, group_name, method, kernel)


@_ring_attention_backward_op.register_fake
def _(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, group_name: str, method: str, kernel: str
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, group_name, method, kernel = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.settings = (group_name, method, kernel)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse = ctx.saved_tensors
    return (*_ring_attention_backward_op(dout, q, k, v, out, lse, *ctx.settings), None, None, None)


_ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, method: str = "zigzag_ring", kernel: str = "flash"
) -> Tensor:
    """Causal attention of this rank's queries over the whole sequence spread on ``group``.

    ``q``: ``[b, heads, local_len, head_dim]``; ``k``, ``v``: ``[b, kv_heads, local_len, head_dim]``
    (``v``'s head size may differ: MLA's does), the local part of the sequence laid out by
    :func:`local_positions` for ``method``; ``kernel``: a name in :data:`KERNELS`.
    """
    return _ring_attention_op(q, k, v, group.group_name, method, kernel)[0]


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup) -> Tensor:
    """All-to-all attention: heads scattered, the (contiguously split) sequence gathered, then back."""
    cp = dist.get_world_size(group)
    if k.shape[1] % cp:
        # Fewer kv heads than ranks: give every query head its kv head before scattering heads.
        n_rep = q.shape[1] // k.shape[1]
        k, v = _expand(k, n_rep), _expand(v, n_rep)
    q, k, v = (all_to_all(t, scatter_dim=1, gather_dim=2, group=group) for t in (q, k, v))
    n_rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, _expand(k, n_rep), _expand(v, n_rep), is_causal=True)
    return all_to_all(out, scatter_dim=2, gather_dim=1, group=group)


def attention_fn(
    method: str, group: dist.ProcessGroup, kernel: str = "flash"
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The ``Attention.attention_fn`` that context parallelism installs for ``method``."""
    if method == "all_to_all":
        return lambda q, k, v: ulysses_attention(q, k, v, group)
    return lambda q, k, v: ring_attention(q, k, v, group, method, kernel)
