"""Linear + cross-entropy fused over token chunks: the ``[tokens, vocab]`` logits never exist at once.

The output head of a 128k-vocabulary model makes the biggest activation of the whole step: 8192
tokens x 128256 fp32 logits are 4 GiB, twice more for their gradient. Chunking the tokens (as
Liger-Kernel's fused linear cross-entropy does, after mgmalek/efficient_cross_entropy) keeps one
``[chunk, vocab]`` block alive; the gradients of the hidden states and of the head weight are
computed in the forward, chunk by chunk, so backward only scales them by the incoming gradient.

Under tensor parallelism the head weight is vocabulary-parallel (a DTensor sharded over rows):
each rank computes its vocabulary slice of every chunk, and three all-reduces of ``[chunk]``
vectors (max, sum of exponentials, target logit) give the exact softmax (Megatron's
``vocab_parallel_cross_entropy``). The hidden-state gradient of a slice is a partial sum; DTensor
reduces it (an all-reduce, or a reduce-scatter back to sequence shards under sequence parallelism).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_ultrascale.utils.loss import IGNORE_INDEX

__all__ = ["fused_linear_cross_entropy"]


def fused_linear_cross_entropy(h: Tensor, weight: Tensor, labels: Tensor, chunk_size: int | None = None) -> Tensor:
    """Mean cross-entropy of ``h @ weight.T`` over the labels that are not -100, without the full logits.

    Same value and gradients as :func:`~lightning_ultrascale.kernels.reference.linear_cross_entropy`.
    ``h [..., dim]`` and ``labels [...]``; ``weight [vocab, dim]``, or a DTensor sharded over the
    vocabulary on a 1-D (tensor-parallel) mesh. ``chunk_size`` tokens per chunk; by default as many
    as make a chunk's fp32 logits about as large as ``h`` (Liger's rule).

    Example:
        >>> h, w = torch.randn(6, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
        >>> labels = torch.tensor([1, 2, -100, 4, 5, 49])
        >>> loss = fused_linear_cross_entropy(h, w, labels, chunk_size=4)
        >>> ref = torch.nn.functional.cross_entropy(h @ w.T, labels)
        >>> torch.allclose(loss, ref)
        True
    """
    group, vocab_start = None, 0
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
            raise ValueError(
                f"fused_linear_cross_entropy needs the head weight sharded over the vocabulary on one mesh dim "
                f"(placements (Shard(0),)); got {tuple(weight.placements)} on a {mesh.ndim}-D mesh"
            )
        _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
        vocab_start, group = offset[0], mesh.get_group()
        # Every rank needs every token; the gradient of its vocabulary slice is a partial sum.
        if isinstance(h, DTensor):
            full = h.redistribute(mesh, [Replicate()])
        else:
            full = DTensor.from_local(h, mesh, [Replicate()])
        h, weight = full.to_local(grad_placements=[Partial()]), weight.to_local()
    elif isinstance(h, DTensor):
        raise ValueError("fused_linear_cross_entropy got DTensor hidden states, a plain weight: give both or neither")
    flat_h, flat_labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    if chunk_size is None:
        chunk_size = math.ceil(flat_h.shape[0] / math.ceil(weight.shape[0] / weight.shape[1]))
    if chunk_size < 1:
        raise ValueError(f"fused_linear_cross_entropy chunk_size={chunk_size} must be >= 1")
    loss: Tensor = _ChunkedLinearCrossEntropy.apply(flat_h, weight, flat_labels, vocab_start, group, chunk_size)
    return loss


def _all_reduce(t: Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None) -> Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _add_weight_gradient(grad_w: Tensor, g: Tensor, hc: Tensor, product: Tensor | None) -> Tensor | None:
    """Add one chunk's ``g.T @ hc`` into the fp32 sum ``grad_w``, with no weight-sized temporary per chunk.

    fp32 inputs go through ``addmm_`` in place. Low-precision ones (``addmm_`` cannot mix an fp32 sum
    with bf16 inputs) run their GEMM into ``product``, one [V, D] buffer made at the first chunk and
    reused by every later one, and are added into the sum as it is read. Returns that buffer.
    """
    autocast = torch.is_autocast_enabled(hc.device.type)
    if g.dtype == hc.dtype == torch.float32 and not autocast:
        grad_w.addmm_(g.T, hc)
        return product
    low = torch.get_autocast_dtype(hc.device.type) if autocast else g.dtype  # (what g.T @ hc would run in)
    if product is None:
        product = torch.empty(grad_w.shape, dtype=low, device=grad_w.device)
    torch.mm(g.T.to(low), hc.to(low), out=product)
    grad_w.add_(product)
    return product


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        h: Tensor,
        weight: Tensor,
        labels: Tensor,
        vocab_start: int,
        group: dist.ProcessGroup | None,
        chunk_size: int,
    ) -> Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]  # type: ignore[attr-defined]
        ctx.weight_dtype = weight.dtype  # type: ignore[attr-defined]
        v_local = weight.shape[0]
        valid = labels != IGNORE_INDEX
        # Mean over this rank's labelled tokens, like F.cross_entropy (0, not NaN, when none are).
        scale = 1.0 / valid.sum().clamp(min=1).float()
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        product: Tensor | None = None  # a low-precision chunk's weight gradient, one buffer for every chunk
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            hc, yc, vc = h[rows], labels[rows] - vocab_start, valid[rows]
            mine = vc & (yc >= 0) & (yc < v_local)  # the label is in this rank's vocabulary slice
            yc = yc.clamp(0, v_local - 1)
            logits = (hc @ weight.T).float()
            target = _all_reduce(torch.where(mine, logits.gather(1, yc[:, None])[:, 0], 0.0), dist.ReduceOp.SUM, group)
            top = _all_reduce(logits.max(-1).values, dist.ReduceOp.MAX, group)
            probs = logits.sub_(top[:, None]).exp_()  # in place: one [chunk, vocab] buffer per chunk
            sum_exp = _all_reduce(probs.sum(-1), dist.ReduceOp.SUM, group)
            total += torch.where(vc, top + sum_exp.log() - target, 0.0).sum()
            if not (need_h or need_w):
                continue
            # d loss / d logits = (softmax - onehot) / labelled tokens, zero for ignored tokens.
            probs.div_(sum_exp[:, None])
            probs.scatter_add_(1, yc[:, None], -mine.to(probs.dtype)[:, None])  # no host sync, unlike nonzero
            g = probs.mul_((vc * scale)[:, None]).to(weight.dtype)
            if grad_h is not None:
                grad_h[rows] = g @ weight
            if grad_w is not None:
                product = _add_weight_gradient(grad_w, g, hc, product)
        ctx.save_for_backward(grad_h, grad_w)
        return total * scale

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_loss: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad_h, grad_w = ctx.saved_tensors  # type: ignore[attr-defined]
        # Scaled in place (a weight-sized buffer less at the peak). A second backward through the
        # same graph (retain_graph) fails autograd's saved-tensor version check instead of
        # scaling twice.
        dh = grad_h.mul_(grad_loss.to(grad_h.dtype)) if grad_h is not None else None
        dw = grad_w.mul_(grad_loss).to(ctx.weight_dtype) if grad_w is not None else None  # type: ignore[attr-defined]
        return dh, dw, None, None, None, None
