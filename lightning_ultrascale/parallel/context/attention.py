"""Attention over a sequence split across the ``cp`` ranks: ring, zig-zag ring and all-to-all (Ulysses).

**Ring** (Liu et al. 2023, the playbook's "Ring Attention"). Each rank keeps its queries; the key
and value blocks travel around the ring, and each rank merges its partial results with their
log-sum-exp in fp32 (the online softmax of FlashAttention). The backward pass sends the K/V blocks
around again, together with their gradient accumulators, which arrive home after a full circle.
Only the kv heads travel; FlashAttention reads them as they are (grouped-query attention), the
other kernels get them expanded per block. The dK/dV accumulators travel in fp32.

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

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_ultrascale.kernels import cuda
from lightning_ultrascale.models.common.documents import document_attention, document_mask, document_tiles, memo
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
    """One local attention call: query rows ``q`` against key rows ``k`` (slices), causal or not.

    Causal compares local rows: query row ``i`` sees key row ``j <= i`` (the local order is the
    window's order, zig-zag included). Without documents a causal block's slices are equal.
    """

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
    """Work of the ring, summed: score pairs computed (query x key, causal half left out) and K/V blocks sent.

    ``pairs`` is for load-balance checks; ``sends`` counts K/V blocks and dK/dV accumulators a
    rank sent, so a test can see a ring step between blocks that share no document move nothing.
    """

    pairs: int = 0
    sends: int = 0


#: Set to a FlopCounter to count the work of every local block (tests and benchmarks).
FLOPS: FlopCounter | None = None


def _count(blk: Block, q: Tensor) -> None:
    """Add a block's score pairs (causal: key ``j`` for query ``i`` when ``j <= i + offset``) to :data:`FLOPS`."""
    if FLOPS is not None:
        rows, cols = blk.q.stop - blk.q.start, blk.k.stop - blk.k.start
        if blk.causal:
            offset = blk.q.start - blk.k.start
            pairs = int(torch.clamp(torch.arange(rows) + offset + 1, 0, cols).sum())
        else:
            pairs = rows * cols
        FLOPS.pairs += pairs * q.shape[0] * q.shape[1]


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float, mask: Tensor | None = None) -> Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal and mask is None:  # a document mask holds the causal part, with the block's offset
        causal_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(causal_mask, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _finite(lse: Tensor) -> Tensor:
    # A query row with no key in the block (another document) has lse -inf; exp(s - lse) must be 0, not NaN.
    return torch.where(torch.isfinite(lse), lse, 0.0)


def _expand(kv: Tensor, heads: int) -> Tensor:
    """K or V with one head per query head (grouped-query attention: each kv head serves ``heads / kv`` of them)."""
    return kv.repeat_interleave(heads // kv.shape[1], dim=1) if kv.shape[1] != heads else kv


def _fold(grad: Tensor, kv_heads: int) -> Tensor:
    """The gradient of :func:`_expand`: summed over the query heads that shared a kv head."""
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def block_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``softmax(q k^T scale) v`` and its log-sum-exp per query row, in fp32 (``[b, h, s, d]`` inputs).

    ``k``, ``v`` may hold fewer heads than ``q`` (grouped-query attention), as every kernel's may.
    ``mask`` (``[b, 1, sq, sk]``, True: attend) keeps documents apart; a row it masks whole has
    output 0 and log-sum-exp -inf.
    """
    heads = q.shape[1]
    s = _scores(q.float(), _expand(k, heads).float(), causal, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - _finite(lse)[..., None]), _expand(v, heads).float())
    return out, lse


def block_attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    causal: bool,
    scale: float,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the GLOBAL output and ``lse`` of its query rows (FlashAttention-2)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k, v = _expand(k, heads).float(), _expand(v, heads).float()
    delta = (dout * out).sum(-1)
    s = _scores(q.float(), k, causal, scale, mask)
    p = torch.exp(s - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta[..., None])
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)


def _pad(x: Tensor, dim: int) -> Tensor:
    # The CPU kernel wants one head size for q, k and v; MLA's v is narrower than q/k. Zero
    # columns add nothing to the scores nor to the output's real columns, forward or backward.
    return x if x.shape[-1] == dim else F.pad(x, (0, dim - x.shape[-1]))


def _cuda_flash(q: Tensor) -> bool:
    """FlashAttention-2 (half precision, head size <= 256); otherwise the memory-efficient kernel (fp32 too)."""
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean mask as the additive bias the fused kernels take (they refuse booleans)."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _bias(mask: Tensor | None, q: Tensor) -> Tensor | None:
    """The memory-efficient kernel's bias: q's dtype, one per head, rows at 16-element multiples."""
    bias = _additive(mask, q.dtype)
    return None if bias is None else cuda.aligned_bias(bias).expand(-1, q.shape[1], -1, -1)


def _flash_block(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """One block through torch's fused attention for the device, with its log-sum-exp: O(block) memory.

    CPU: the CPU flash kernel; CUDA: FlashAttention-2, or the memory-efficient kernel where flash
    does not apply (fp32, head size > 256, or a document ``mask``, which flash cannot take), whose
    LSE is padded to a multiple of 32 rows. A row ``mask`` masks whole gets LSE -inf and output 0
    (the kernels return 0 and 0, or NaN).
    """
    causal = causal and mask is None  # a document mask holds the causal part, with the block's offset
    heads = q.shape[1]
    if not cuda.on_cuda(q):
        d = max(q.shape[-1], v.shape[-1])
        k, v_ = _pad(_expand(k, heads), d), _pad(_expand(v, heads), d)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _pad(q, d), k, v_, 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale
        )[:2]
        out = out[..., : v.shape[-1]]
    elif _cuda_flash(q) and mask is None:  # FlashAttention reads each kv head for its group of query heads
        out, lse = cuda.flash_attention(q, k, v, causal, scale)
    else:
        out, lse = cuda.efficient_attention(q, _expand(k, heads), _expand(v, heads), _bias(mask, q), causal, scale)
        lse = lse[..., : q.shape[-2]]
    out, lse = out.float(), lse.float()
    if mask is not None:
        attends = mask.any(-1)
        lse = torch.where(attends, lse, float("-inf"))
        out = torch.where(attends[..., None], out, 0.0)
    return out, lse


def _flash_block_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    causal: bool,
    scale: float,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The same kernel's backward, given the GLOBAL output and LSE of the block's query rows."""
    causal = causal and mask is None  # as in the forward
    heads, kv_heads = q.shape[1], k.shape[1]
    if not cuda.on_cuda(q):
        d = max(q.shape[-1], v.shape[-1])
        k_, v_ = _expand(k, heads), _expand(v, heads)
        dout_, q_, k_, v_, out_ = (_pad(t, d) for t in (dout.to(q.dtype), q, k_, v_, out.to(q.dtype)))
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout_, q_, k_, v_, out_, lse, 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale
        )
        grads = [g[..., : t.shape[-1]] for g, t in zip(grads[:3], (q, k, v))]
    elif _cuda_flash(q) and mask is None:  # dK/dV come back per kv head
        grads = cuda.flash_attention_backward(dout, q, k, v, out, lse, causal, scale)
    else:
        # With a bias, the kernel's half-precision backward returned dQ and dK 60-70% off on an H100 (torch 2.11;
        # dV and the forward were right), so a masked block takes its fp32 backward: exact, and O(block) memory still.
        work = torch.float32 if mask is not None else q.dtype
        q_, k_, v_ = (t.to(work) for t in (q, _expand(k, heads), _expand(v, heads)))
        grads = cuda.efficient_attention_backward(dout, q_, k_, v_, _bias(mask, q_), out, lse, causal, scale)
    dq, dk, dv = (g.float() for g in grads)
    return dq, _fold(dk, kv_heads), _fold(dv, kv_heads)


#: Local kernels: name -> (forward returning (out, lse), backward given the global out and lse);
#: both take an optional document ``mask``. ``"flash"`` is the device's fused kernel (the
#: default); ``"reference"`` the exact fp32 matmuls.
KERNELS: dict[str, tuple[Callable[..., tuple[Tensor, Tensor]], Callable[..., tuple[Tensor, Tensor, Tensor]]]] = {
    "flash": (_flash_block, _flash_block_backward),
    "reference": (block_attention, block_attention_backward),
}


# ------------------------------------------------------------------------------------ the ring's plan
@dataclass(frozen=True)
class RingPlan:
    """Which blocks every rank computes at every ring step, and how far each K/V block travels.

    ``blocks[rank][src]``: the :class:`Block` s ``rank`` computes with ``src``'s keys, those whose
    queries and keys share a document (all of :func:`ring_blocks` without documents).
    ``last[src]``: the last ring step at which a rank needs ``src``'s K/V: the block is sent on
    while a rank further along the ring needs it, and its dK/dV accumulator goes home from there.
    0: nobody else needs it, and it is never sent. Every rank computes the same plan from the
    whole window's document ids, so senders and receivers agree without a word.
    """

    blocks: tuple[tuple[tuple[Block, ...], ...], ...]
    last: tuple[int, ...]

    def holds(self, rank: int, step: int) -> bool:
        """Whether ``rank`` has the K/V of ``rank - step`` at ``step``."""
        return self.last[(rank - step) % len(self.last)] >= step

    def sends(self, rank: int, step: int) -> bool:
        """Whether ``rank`` passes the K/V it holds at ``step`` on to the next rank."""
        return self.last[(rank - step) % len(self.last)] > step


def _shrink(blk: Block, mine: Tensor, theirs: Tensor) -> Block | None:
    """The part of an off-diagonal block whose queries and keys share a document; None if none do.

    ``mine``/``theirs``: the document ids of this rank's and the source's local rows ``[b, len]``
    (on the CPU). Rows and columns outside the shared documents would be masked whole: the block
    shrinks to the smallest slices holding the others (over the batch), and its kernel call with it.
    """
    q_docs, k_docs = mine[:, blk.q], theirs[:, blk.k]
    rows = torch.stack([torch.isin(q, k) for q, k in zip(q_docs, k_docs)]).any(0).nonzero().flatten()
    if rows.numel() == 0:
        return None
    cols = torch.stack([torch.isin(k, q) for q, k in zip(q_docs, k_docs)]).any(0).nonzero().flatten()
    q0, k0 = blk.q.start or 0, blk.k.start or 0
    return Block(
        slice(q0 + int(rows[0]), q0 + int(rows[-1]) + 1), slice(k0 + int(cols[0]), k0 + int(cols[-1]) + 1), blk.causal
    )


def ring_plan(method: str, size: int, local_len: int, documents: Tensor | None = None) -> RingPlan:
    """The :class:`RingPlan` for a window split over ``size`` ranks (with its ``document_ids [b, s]``, if any).

    With documents, an off-diagonal block is cut to the rows and columns that share a document
    (:func:`_shrink`) or dropped, and the diagonal block is cut into tiles at document starts
    (:func:`~lightning_ultrascale.models.common.documents.document_tiles`).

    Example:
        >>> docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])  # each rank's half is its own document
        >>> plan = ring_plan("ring", 2, 4, docs)
        >>> plan.last, len(plan.blocks[1][0])
        ((0, 0), 0)
    """
    local = None
    if documents is not None:
        cpu = documents.cpu()  # one device read per micro-batch (the plan is memoised)
        local = [_local_documents(cpu, method, size, rank) for rank in range(size)]
    blocks = []
    for rank in range(size):
        row = []
        for src in range(size):
            found = ring_blocks(method, rank, src, local_len)
            if local is not None and src == rank:  # the diagonal, tile by tile within documents
                found = [Block(slice(a, b), slice(k, b), True) for a, b, k in document_tiles(local[rank])]
            elif local is not None:
                shrunk = (_shrink(b, local[rank], local[src]) for b in found)
                found = [b for b in shrunk if b is not None]
            row.append(tuple(found))
        blocks.append(tuple(row))
    last = tuple(
        max(step for step in range(size) if step == 0 or blocks[(src + step) % size][src]) for src in range(size)
    )
    return RingPlan(tuple(blocks), last)


def _plan(method: str, size: int, local_len: int, documents: Tensor | None) -> RingPlan:
    if documents is None:
        return _dense_plan(method, size, local_len)
    return memo(documents, f"ring_plan/{method}/{size}/{local_len}", lambda d: ring_plan(method, size, local_len, d))


@functools.lru_cache(maxsize=64)
def _dense_plan(method: str, size: int, local_len: int) -> RingPlan:
    return ring_plan(method, size, local_len)


def _block_inputs(
    blk: Block, q: Tensor, kv: tuple[Tensor, Tensor], masks: tuple[Tensor, Tensor] | None
) -> tuple[Tensor, Tensor, Tensor, bool, Tensor | None]:
    """One block's q, k and v (its kv heads: each kernel expands them if it must), causal flag and document
    mask (which then holds the causal part too)."""
    k, v = kv[0][:, :, blk.k], kv[1][:, :, blk.k]
    if masks is None:
        return q[:, :, blk.q], k, v, blk.causal, None
    mask = document_mask(masks[0][:, blk.q], masks[1][:, blk.k], blk.causal, blk.q.start - blk.k.start)
    return q[:, :, blk.q], k, v, blk.causal, mask


def _local_documents(documents: Tensor | None, method: str, size: int, rank: int) -> Tensor | None:
    """The document ids of the rows ``rank`` holds, cut once per micro-batch for every rank and layer."""
    if documents is None:
        return None
    return memo(documents, f"local_documents/{method}/{size}", lambda d: _cut_documents(d, method, size))[rank]


def _cut_documents(documents: Tensor, method: str, size: int) -> tuple[Tensor, ...]:
    # The positions are built on the host: one copy to the device for all ranks, not one per ring step,
    # layer and pass (a blocking host-to-device copy each on a GPU).
    seq = documents.shape[1]
    index = torch.cat([local_positions(method, seq, size, r) for r in range(size)]).to(documents.device)
    return documents.index_select(1, index).chunk(size, dim=1)


# ------------------------------------------------------------------------------------ ring attention
def _ring_forward(
    q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None, group_name: str, method: str, kernel: str
) -> tuple[Tensor, Tensor]:
    """This rank's attention output (in q's dtype) and its fp32 log-sum-exp over the whole ring."""
    block_forward = KERNELS[kernel][0]
    ring = RingExchange(_resolve_process_group(group_name))
    rank, size = ring.rank, ring.size
    scale = 1.0 / math.sqrt(q.shape[-1])
    length = q.shape[-2]
    plan = _plan(method, size, length, documents)
    mine = _local_documents(documents, method, size, rank)
    # Laid out [b, s, heads, d_v] in memory: the output projection reads it as [b, s, heads x d_v]
    # without a copy. (d_v is v's head size, which MLA makes differ from q's and k's.)
    b, h, s = q.shape[:3]
    out = torch.zeros(b, s, h, v.shape[-1], dtype=torch.float32, device=q.device).transpose(1, 2)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    kv = (k.contiguous(), v.contiguous())
    for step in range(size):
        src = (rank - step) % size
        # The next block: sent on if a rank further along needs ours, received if we (or one after us) need it.
        incoming = _start(ring, *kv, send=plan.sends(rank, step), recv=plan.sends(rank - 1, step))
        theirs = _local_documents(documents, method, size, src)
        for blk in plan.blocks[rank][src] if plan.holds(rank, step) else ():
            masks = None if mine is None or theirs is None else (mine, theirs)
            q_, k_, v_, causal, mask = _block_inputs(blk, q, kv, masks)
            _count(blk, q)
            o, block_lse = block_forward(q_, k_, v_, causal, scale, mask)
            # Online-softmax merge of two partial results by their log-sum-exp, in fp32.
            old = lse[:, :, blk.q]
            merged = torch.logaddexp(old, block_lse)
            out[:, :, blk.q] = (
                out[:, :, blk.q] * torch.exp(old - _finite(merged))[..., None]
                + o * torch.exp(block_lse - _finite(merged))[..., None]
            )
            lse[:, :, blk.q] = merged
        ring.wait()
        if incoming:
            kv = (incoming[0], incoming[1])
    return out.to(q.dtype), lse


def _ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    documents: Tensor | None, group_name: str, method: str, kernel: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """dQ, dK, dV. The K/V blocks go round again; each block's dK/dV accumulator travels with it.

    An accumulator moves on with its block after the step that adds to it and is waited for only
    after the next step's compute (its transfer overlaps that compute); from the last rank that
    needs the block (:class:`RingPlan`; the rank before its owner when every rank needs it) it
    goes home. It travels in fp32, as torch's context parallel keeps it: rounded to bf16 at every hop,
    ``cp`` roundings of a sum would each lose its low bits.
    """
    group = _resolve_process_group(group_name)
    kv_ring, grad_ring = RingExchange(group), RingExchange(group)
    rank, size = kv_ring.rank, kv_ring.size
    plan = _plan(method, size, q.shape[-2], documents)
    mine = _local_documents(documents, method, size, rank)
    grads = _BlockGrads(q, out, lse, dout, KERNELS[kernel][1])
    # The accumulators' shapes and dtype, for a receive.
    template = (
        torch.empty(k.shape, dtype=torch.float32, device=k.device),
        torch.empty(v.shape, dtype=torch.float32, device=v.device),
    )
    kv = (k.contiguous(), v.contiguous())
    arriving: list[Tensor] = []
    done: dict[int, tuple[Tensor, Tensor]] = {}  # complete accumulators, by the block they belong to
    for step in range(size):
        src = (rank - step) % size
        incoming = _start(kv_ring, *kv, send=plan.sends(rank, step), recv=plan.sends(rank - 1, step))
        moving = None
        if plan.holds(rank, step):
            masks = None if mine is None else (mine, _local_documents(documents, method, size, src))
            dk, dv = grads(plan.blocks[rank][src], kv, masks)
            if step > 0:  # this block's accumulator, sent by the previous rank after its step
                grad_ring.wait()
                dk, dv = dk + arriving[0], dv + arriving[1]
            if plan.sends(rank, step):
                moving = (dk, dv)
            else:
                done[src] = (dk, dv)
        grad_ring.wait()  # our send of the step before
        arriving = _start(grad_ring, *(moving or template), send=moving is not None, recv=plan.sends(rank - 1, step))
        kv_ring.wait()
        if incoming:
            kv = (incoming[0], incoming[1])
    grad_ring.wait()
    dk, dv = _send_home(done, plan, rank, group, template)
    return grads.dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _BlockGrads:
    """Runs the backward of one ring step's blocks: adds into ``dq``, returns the step's dK/dV in fp32."""

    def __init__(self, q: Tensor, out: Tensor, lse: Tensor, dout: Tensor, kernel: Callable[..., Any]):
        self.q, self.out, self.lse, self.dout = q, out, lse, dout.float()
        self.kernel = kernel
        self.scale = 1.0 / math.sqrt(q.shape[-1])
        self.dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

    def __call__(
        self, blocks: tuple[Block, ...], kv: tuple[Tensor, Tensor], masks: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor]:
        dk = torch.zeros(kv[0].shape, dtype=torch.float32, device=kv[0].device)
        dv = torch.zeros(kv[1].shape, dtype=torch.float32, device=kv[1].device)
        for blk in blocks:
            q, k, v, causal, mask = _block_inputs(blk, self.q, kv, masks)
            gq, gk, gv = self.kernel(
                q, k, v, self.out[:, :, blk.q], self.lse[:, :, blk.q], self.dout[:, :, blk.q], causal, self.scale, mask
            )
            self.dq[:, :, blk.q] += gq
            dk[:, :, blk.k] += gk
            dv[:, :, blk.k] += gv
        return dk, dv


def _start(ring: RingExchange, *tensors: Tensor, send: bool, recv: bool) -> list[Tensor]:
    """``ring.start`` where there is something to move (counted in :data:`FLOPS`)."""
    if not (send or recv):
        return []
    if FLOPS is not None and send:
        FLOPS.sends += 1
    return ring.start(*tensors, send=send, recv=recv)


def _send_home(
    done: dict[int, tuple[Tensor, Tensor]], plan: RingPlan, rank: int, group: dist.ProcessGroup,
    template: tuple[Tensor, Tensor],
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Each complete accumulator to its block's owner; returns this rank's own dK/dV (fp32)."""
    size = len(plan.last)
    ops, own = [], done.pop(rank, None)
    for src, (dk, dv) in sorted(done.items()):
        peer = dist.get_global_rank(group, src)
        ops += [dist.P2POp(dist.isend, t.contiguous(), peer, group) for t in (dk, dv)]
    if own is None:  # ours comes back from the last rank that needed it
        peer = dist.get_global_rank(group, (rank + plan.last[rank]) % size)
        received = [torch.empty_like(t) for t in template]
        ops += [dist.P2POp(dist.irecv, t, peer, group) for t in received]
    if FLOPS is not None:
        FLOPS.sends += len(done)
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return own if own is not None else (received[0], received[1])


def _resolve_process_group(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


# One op to torch, not a Python autograd Function: selective recomputation (which sees every op
# dispatched while a block runs) keeps this op's output and LSE, and none of the per-block
# kernels' outputs or score blocks inside it (an autograd Function would expose them all: cp
# block outputs per layer, or O(block^2) scores with the reference kernel).
@torch.library.custom_op("ultrascale::ring_attention", mutates_args=())
def _ring_attention_op(
    q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None, group_name: str, method: str, kernel: str
) -> tuple[Tensor, Tensor]:
    return _ring_forward(q, k, v, documents, group_name, method, kernel)


@_ring_attention_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None, group_name: str, method: str, kernel: str
) -> tuple[Tensor, Tensor]:
    b, h, s = q.shape[:3]
    out = q.new_empty(b, s, h, v.shape[-1]).transpose(1, 2)
    return out, q.new_empty(b, h, s, dtype=torch.float32)


@torch.library.custom_op("ultrascale::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    documents: Tensor | None, group_name: str, method: str, kernel: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return _ring_backward(dout, q, k, v, out, lse, documents, group_name, method, kernel)


@_ring_attention_backward_op.register_fake  # the op's schema again, as torch.library needs
def _(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    documents: Tensor | None, group_name: str, method: str, kernel: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    # Contiguous, as the real op returns them: q, k, v may be transposed views, and a compiled
    # backward traced with their strides would view the real gradients wrongly.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, documents, group_name, method, kernel = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.documents = documents  # integers, no gradient: held as they are
    ctx.settings = (group_name, method, kernel)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse = ctx.saved_tensors
    grads = _ring_attention_backward_op(dout, q, k, v, out, lse, ctx.documents, *ctx.settings)
    return (*grads, None, None, None, None)


_ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    method: str = "zigzag_ring",
    kernel: str = "flash",
    documents: Tensor | None = None,
) -> Tensor:
    """Causal attention of this rank's queries over the whole sequence spread on ``group``.

    ``q``: ``[b, heads, local_len, head_dim]``; ``k``, ``v``: ``[b, kv_heads, local_len, head_dim]``
    (``v``'s head size may differ: MLA's does), the local part of the sequence laid out by
    :func:`local_positions` for ``method``; ``kernel``: a name in :data:`KERNELS`; ``documents``:
    the WHOLE window's ``document_ids [b, cp x local_len]`` (every rank has them): attention stays
    inside documents, and blocks that share none are neither computed nor sent (:class:`RingPlan`).
    """
    return _ring_attention_op(q, k, v, documents, group.group_name, method, kernel)[0]


def ulysses_attention(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, documents: Tensor | None = None
) -> Tensor:
    """All-to-all attention: heads scattered, the (contiguously split) sequence gathered, then back.

    ``documents``: the whole window's ``document_ids``; the gathered sequence is the whole window.
    """
    cp = dist.get_world_size(group)
    if k.shape[1] % cp:
        # Fewer kv heads than ranks: give every query head its kv head before scattering heads.
        k, v = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    q, k, v = (all_to_all(t, scatter_dim=1, gather_dim=2, group=group) for t in (q, k, v))
    if documents is not None:
        out = document_attention(q, k, v, documents)
    else:
        out = F.scaled_dot_product_attention(q, _expand(k, q.shape[1]), _expand(v, q.shape[1]), is_causal=True)
    return all_to_all(out, scatter_dim=2, gather_dim=1, group=group)


def attention_fn(method: str, group: dist.ProcessGroup, kernel: str = "flash") -> Callable[..., Tensor]:
    """The ``Attention.attention_fn(q, k, v, documents=None)`` that context parallelism installs for ``method``."""
    if method == "all_to_all":
        return lambda q, k, v, documents=None: ulysses_attention(q, k, v, group, documents)
    return lambda q, k, v, documents=None: ring_attention(q, k, v, group, method, kernel, documents)
