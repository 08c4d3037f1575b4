"""Bucketed gradient all-reduce overlapped with backward: where data parallelism moves its bytes.

The playbook's DP optimisations, as PyTorch DDP implements them: gradients are grouped into
buckets of ~``bucket_bytes`` in reverse parameter order (roughly the order backward produces
them); as soon as every gradient of a bucket has been accumulated, that bucket's all-reduce is
launched asynchronously while backward goes on computing earlier layers. A callback queued on the
autograd engine waits for the outstanding reductions at the very end of backward.

Buckets are launched strictly in index order on every rank: collectives must be issued in the
same order everywhere, and backward may finish parameters in a slightly different order than
registration order.

Gradients live in the flat bucket buffers (``param.grad`` is a view), so reducing a bucket costs
no extra copy after the first gradient of a step, and model-state accounting sees one buffer.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    buffer: torch.Tensor | None = None
    ready: int = 0
    work: dist.Work | None = None
    views: list[torch.Tensor] = field(default_factory=list)
    # The tensor on the wire when the reduction runs in another dtype than the gradients.
    wire: torch.Tensor | None = None


def _dtype_and_device(param: nn.Parameter) -> Hashable:
    return param.dtype, param.device


def plan_buckets(
    params: Sequence[nn.Parameter],
    bucket_bytes: int,
    key: Callable[[nn.Parameter], Hashable] = _dtype_and_device,
) -> list[list[nn.Parameter]]:
    """Group ``params`` into buckets of at most ``bucket_bytes``, in the order backward should fill them.

    Parameters are walked in reverse (backward produces gradients roughly last layer first); only
    parameters with equal ``key`` share a bucket (one flat buffer needs one dtype and device; the
    ZeRO engine also keys on the optimizer's param group). Each key keeps one open bucket, closed
    when the next parameter would overflow it, as DDP's bucket assignment does, so interleaved keys
    (weight, bias, weight, ...) do not cut each other's buckets short. A parameter larger than
    ``bucket_bytes`` gets a bucket of its own. Buckets are ordered by the walk position of their
    last parameter: the order in which their last gradient is expected, hence their launch order.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))  # 64 B weights, 16 B biases
        >>> names = {p: n for n, p in model.named_parameters()}
        >>> [[names[p] for p in b] for b in plan_buckets(list(model.parameters()), 96)]
        [['2.bias', '2.weight', '1.bias'], ['1.weight', '0.bias'], ['0.weight']]
        >>> by_kind = lambda p: p.dim()  # weights and biases never share a bucket
        >>> [[names[p] for p in b] for b in plan_buckets(list(model.parameters()), 96, key=by_kind)]
        [['2.weight'], ['1.weight'], ['2.bias', '1.bias', '0.bias'], ['0.weight']]
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    closed: list[tuple[int, list[nn.Parameter]]] = []
    # key -> (its open bucket's params, their bytes, walk position of the last one)
    open_buckets: dict[Hashable, tuple[list[nn.Parameter], int, int]] = {}
    for position, p in enumerate(reversed(params)):
        k = key(p)
        members, size, last = open_buckets.get(k, ([], 0, -1))
        nbytes = p.numel() * p.element_size()
        if members and size + nbytes > bucket_bytes:
            closed.append((last, members))
            members, size = [], 0
        open_buckets[k] = ([*members, p], size + nbytes, position)
    closed.extend((last, members) for members, _, last in open_buckets.values())
    return [members for _, members in sorted(closed, key=lambda c: c[0])]


class BucketedAllReduce:
    """Average the gradients of ``params`` over ``group`` in buckets, overlapped with backward.

    Example:
        >>> reducer = BucketedAllReduce(model.parameters(), mesh["dp_cp"].get_group())  # doctest: +SKIP
        >>> loss.backward()  # gradients are averaged over the group when this returns  # doctest: +SKIP
        >>> with reducer.no_sync():  # doctest: +SKIP
        ...     loss.backward()  # accumulate locally, reduce on the next synced backward
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: dist.ProcessGroup,
        bucket_bytes: int,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.group = group
        # bf16 gradients summed in fp32: a transient fp32 copy per bucket buys exact sums.
        self.reduce_dtype = reduce_dtype
        self.group_size = dist.get_world_size(group)
        self.sync = True
        self.buckets = self._make_buckets([p for p in params if p.requires_grad], bucket_bytes)
        self._slot: dict[nn.Parameter, tuple[_Bucket, int]] = {
            p: (b, i) for b in self.buckets for i, p in enumerate(b.params)
        }
        self._next = 0
        self._callback_queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._slot]
        #: Bucket indices in launch order during the last synced backward, with a flag saying
        #: whether backward was still running (True) when each was launched: the overlap proof.
        self.launch_log: list[tuple[int, bool]] = []

    @staticmethod
    def _make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
        buckets = []
        for members in plan_buckets(params, bucket_bytes):
            offsets = [0, *itertools.accumulate(p.numel() for p in members)]
            buckets.append(_Bucket(members, offsets[:-1], offsets[-1]))
        return buckets

    def _materialise(self, bucket: _Bucket) -> None:
        # Allocated lazily: the plugin is applied while parameters are still on the meta device.
        first = bucket.params[0]
        bucket.buffer = torch.zeros(bucket.numel, dtype=first.dtype, device=first.device)
        bucket.views = [bucket.buffer[o : o + p.numel()].view_as(p) for p, o in zip(bucket.params, bucket.offsets)]

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
            self.launch_log = []
        bucket, i = self._slot[param]
        if bucket.buffer is None:
            self._materialise(bucket)
        view = bucket.views[i]
        if param.grad is not view:
            # First gradient since zero_grad(set_to_none=True): move it into the bucket so later
            # micro-steps accumulate in place there.
            view.copy_(param.grad)
            param.grad = view
        bucket.ready += 1
        if self.sync:
            self._launch_ready(during_backward=True)

    def _launch_ready(self, during_backward: bool) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            bucket = self.buckets[self._next]
            assert bucket.buffer is not None
            wire = bucket.buffer
            if self.reduce_dtype is not None and wire.dtype != self.reduce_dtype:
                wire = bucket.wire = wire.to(self.reduce_dtype)
            # Pre-divide so the sum is the mean (DDP does the same; keeps bf16 sums in range).
            wire.div_(self.group_size)
            bucket.work = dist.all_reduce(wire, group=self.group, async_op=True)
            self.launch_log.append((self._next, during_backward))
            self._next += 1

    def _finish_backward(self) -> None:
        self._callback_queued = False
        if not self.sync:
            for bucket in self.buckets:
                bucket.ready = 0
            return
        for bucket in self.buckets:
            if bucket.ready < len(bucket.params):
                # Parameters that took no part in this backward still have to be reduced on
                # every rank (another rank may have used them): they contribute zeros.
                if bucket.buffer is None:
                    self._materialise(bucket)
                for p, view in zip(bucket.params, bucket.views):
                    if p.grad is not view:
                        view.zero_()
                        if p.grad is not None:
                            view.copy_(p.grad)
                        p.grad = view
                bucket.ready = len(bucket.params)
        self._launch_ready(during_backward=False)
        for bucket in self.buckets:
            assert bucket.work is not None
            bucket.work.wait()
            bucket.work = None
            bucket.ready = 0
            if bucket.wire is not None:
                assert bucket.buffer is not None
                bucket.buffer.copy_(bucket.wire)
                bucket.wire = None
        self._next = 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside this block reduces the sum."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    @property
    def grad_buffers(self) -> list[torch.Tensor]:
        """The flat gradient buffers (for model-state accounting)."""
        return [b.buffer for b in self.buckets if b.buffer is not None]

    def remove(self) -> None:
        """Detach the hooks (the model can be parallelised again afterwards)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
