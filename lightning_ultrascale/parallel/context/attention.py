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

The local kernel is one of :data:`KERNELS`: ``"reference"`` (:func:`block_attention`, an exact
fp32 reference in plain matmuls, forward and backward) or ``"sdpa"`` (torch's fused flash-attention
CPU kernel, which returns the log-sum-exp and takes the global output and LSE in its backward,
exactly what the ring needs). A GPU flash / Triton kernel plugs in the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

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
    # torch's CPU flash kernel wants one head size for q, k and v; MLA's v is narrower than q/k.
    # Zero columns add nothing to the scores nor to the output's real columns, forward or backward.
    return x if x.shape[-1] == dim else F.pad(x, (0, dim - x.shape[-1]))


def _sdpa_block(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    if q.device.type != "cpu":
        raise NotImplementedError(
            "the 'sdpa' context-parallel kernel wraps torch's CPU flash attention; on GPU use kernel='reference' "
            "(a CUDA flash kernel with LSE is not built yet)"
        )
    _count(q, k, causal)
    d = max(q.shape[-1], v.shape[-1])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _pad(q, d), _pad(k, d), _pad(v, d), 0.0, causal, scale=scale
    )[:2]
    return out[..., : v.shape[-1]].float(), lse.float()


def _sdpa_block_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    d = max(q.shape[-1], v.shape[-1])
    padded = (_pad(t, d) for t in (dout.to(q.dtype), q, k, v, out.to(q.dtype)))
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*padded, lse, 0.0, causal, scale=scale)
    dq, dk, dv = (g[..., : t.shape[-1]].float() for g, t in zip(grads[:3], (q, k, v)))
    return dq, dk, dv


#: Local kernels: name -> (forward returning (out, lse), backward given the global out and lse).
KERNELS: dict[str, tuple[Callable[..., tuple[Tensor, Tensor]], Callable[..., tuple[Tensor, Tensor, Tensor]]]] = {
    "reference": (block_attention, block_attention_backward),
    "sdpa": (_sdpa_block, _sdpa_block_backward),
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
class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, method: str, group: dist.ProcessGroup, kernel: str) -> Tensor:  # type: ignore[override]
        block_forward = KERNELS[kernel][0]
        ring = RingExchange(group)
        rank, size = ring.rank, ring.size
        n_rep = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        length = q.shape[-2]
        # Laid out [b, s, heads, d_v] in memory: the output projection reads it as [b, s, heads x d_v]
        # without a copy, and the tensor saved for backward is that same memory. (d_v is v's head
        # size, which MLA makes differ from q's and k's.)
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
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.method, ctx.group, ctx.kernel = method, group, kernel
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None, None]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        block_backward = KERNELS[ctx.kernel][1]
        kv_ring, grad_ring = RingExchange(ctx.group), RingExchange(ctx.group)
        rank, size = kv_ring.rank, kv_ring.size
        n_rep = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        length = q.shape[-2]
        dout = dout.float()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = (k.contiguous(), v.contiguous())
        # The gradient accumulators of the K/V block currently held travel with it.
        dkv = (
            torch.zeros(k.shape, dtype=torch.float32, device=k.device),
            torch.zeros(v.shape, dtype=torch.float32, device=v.device),
        )
        for step in range(size):
            src = (rank - step) % size
            incoming = kv_ring.start(*kv) if step < size - 1 else None
            for blk in ring_blocks(ctx.method, rank, src, length):
                gq, gk, gv = block_backward(
                    q[:, :, blk.q], _expand(kv[0][:, :, blk.k], n_rep), _expand(kv[1][:, :, blk.k], n_rep),
                    out[:, :, blk.q], lse[:, :, blk.q], dout[:, :, blk.q], blk.causal, scale,
                )  # fmt: skip
                dq[:, :, blk.q] += gq
                dkv[0][:, :, blk.k] += _fold(gk, n_rep)
                dkv[1][:, :, blk.k] += _fold(gv, n_rep)
            # Every accumulator moves on, size times in all: the last move brings it home.
            arriving = grad_ring.start(*dkv)
            if incoming is not None:
                kv_ring.wait()
                kv = (incoming[0], incoming[1])
            grad_ring.wait()
            dkv = (arriving[0], arriving[1])
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, method: str = "zigzag_ring", kernel: str = "reference"
) -> Tensor:
    """Causal attention of this rank's queries over the whole sequence spread on ``group``.

    ``q``: ``[b, heads, local_len, head_dim]``; ``k``, ``v``: ``[b, kv_heads, local_len, head_dim]``
    (``v``'s head size may differ: MLA's does), the local part of the sequence laid out by
    :func:`local_positions` for ``method``; ``kernel``: a name in :data:`KERNELS`.
    """
    return _RingAttention.apply(q, k, v, method, group, kernel)


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
    method: str, group: dist.ProcessGroup, kernel: str = "reference"
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The ``Attention.attention_fn`` that context parallelism installs for ``method``."""
    if method == "all_to_all":
        return lambda q, k, v: ulysses_attention(q, k, v, group)
    return lambda q, k, v: ring_attention(q, k, v, group, method, kernel)
