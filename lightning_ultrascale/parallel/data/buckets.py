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

Main gradients. Under ``bf16-mixed`` the parameters are bf16 and the optimizer steps their fp32
master copies (``master.py``). With an fp32 reduction the buckets are fp32 *main gradients*
(Megatron's name): each bf16 gradient autograd produces is added into its fp32 slice and dropped
(``param.grad`` stays ``None``), so micro-steps accumulate in fp32 and the reduced bucket is the
masters' gradient with no copy.
"""

from __future__ import annotations

import abc
import contextlib
import itertools
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_ultrascale.utils.tensors import local_tensor


@dataclass
class GradBucket:
    """One flat gradient bucket: its parameters, their offsets, and the state of its reduction."""

    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    grad_buffer: torch.Tensor | None = None  # the parameters' .grad are views into it
    grad_views: list[torch.Tensor] = field(default_factory=list)
    ready: int = 0  # gradients accumulated in this backward
    work: dist.Work | None = None


@dataclass
class _AllReduceBucket(GradBucket):
    # The tensor on the wire when the reduction runs in another dtype than the gradients.
    wire: torch.Tensor | None = None
    # The fp32 copy of a reduced bf16 bucket the master weights step with (until the step is done).
    main: torch.Tensor | None = None


def _holds(grad: torch.Tensor | None, view: torch.Tensor) -> bool:
    """Whether ``grad`` already lives in ``view`` (as itself, or as a DTensor's local tensor)."""
    return (
        grad is not None and local_tensor(grad).data_ptr() == view.data_ptr() and local_tensor(grad).shape == view.shape
    )


def _grad_in(view: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``view`` as a gradient shaped like ``like``: a DTensor with ``like``'s placements if it is one.

    Tensor-parallel parameters are DTensors: their gradient stays a DTensor (with its own
    placements: a sequence-parallel norm's gradient is Partial over tp) whose local tensor is the
    bucket view, so the data-parallel reduction works on local shards.
    """
    if isinstance(like, DTensor):
        return DTensor.from_local(
            view, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
        )
    return view


def _like_param(grad: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """``grad`` with the local shape of ``param``'s shard, for the bucket view.

    DTensor may hand a parameter a gradient in another layout: a vocabulary-parallel embedding gets
    a Replicate one (redistributing is a local slice), a sequence-parallel norm a Partial one (each
    tp rank's sum over its part of the sequence: redistributing all-reduces it, as the optimizer
    would have to anyway). Buckets then hold exactly the parameter's local values.
    """
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def _drain(param: nn.Parameter, view: torch.Tensor) -> None:
    """Add ``param``'s gradient into its main-gradient slice ``view`` (fp32) and drop it."""
    view.add_(local_tensor(_like_param(param.grad, param)))
    param.grad = None


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


class GradientBuckets(abc.ABC):
    """The backward machinery shared by the DP all-reduce and the ZeRO-1/2 engine.

    A post-accumulate-grad hook moves each gradient into its bucket (``param.grad`` becomes a
    view, so later micro-steps accumulate in place), launches every bucket that is complete, in
    index order, and queues a callback that completes the step at the end of backward: buckets of
    parameters that took no part (another rank may have used them) contribute zeros, then every
    collective is waited for. Subclasses say how a bucket's gradient memory is allocated
    (``_allocate_grads``), which collective it launches (``_launch``) and how reductions are
    completed (``_complete``; ``_poll`` may hand over finished ones during backward).
    """

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.sync = True
        #: fp32 main-gradient buffers under bf16 parameters (module docstring): every gradient is
        #: added into its bucket and dropped, instead of living in it as ``param.grad``.
        self.main_grads = False
        self.buckets: list[GradBucket] = []
        self._slot: dict[nn.Parameter, tuple[GradBucket, int]] = {}
        self._next = 0
        self._callback_queued = False
        for p in params:
            # torch keeps a tensor's post-accumulate hooks in a Python-side dict and installs the
            # C++ hook that runs them only when that dict is created. Module.to() swaps a DTensor
            # parameter's tensor (swap_tensors) but not the dict: hooks added to a dict left over
            # from an earlier binding (all removed, so empty) would never fire. A fresh dict
            # installs the hook on the current tensor.
            if p._post_accumulate_grad_hooks is not None and not p._post_accumulate_grad_hooks:
                p._post_accumulate_grad_hooks = None
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        #: Bucket indices in launch order during the last synced backward, with a flag saying
        #: whether backward was still running (True) when each was launched: the overlap proof.
        self.launch_log: list[tuple[int, bool]] = []

    def _set_buckets(self, buckets: Sequence[GradBucket]) -> None:
        self.buckets = list(buckets)
        self._slot = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}

    @abc.abstractmethod
    def _allocate_grads(self, bucket: GradBucket) -> None:
        """Give ``bucket`` its flat gradient buffer and the per-parameter views into it."""

    @abc.abstractmethod
    def _launch(self, bucket: GradBucket) -> dist.Work | None:
        """Start the bucket's asynchronous reduction (all-ranks, index order); ``None``: nothing to wait for."""

    @abc.abstractmethod
    def _complete(self) -> None:
        """Wait for every launched reduction and hand its result to the gradients."""

    def _poll(self) -> None:
        """Hand over reductions that finished while backward is still running (optional)."""

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
            if self.sync:
                self.launch_log = []
        bucket, i = self._slot[param]
        if bucket.grad_buffer is None:
            self._allocate_grads(bucket)
        view = bucket.grad_views[i]
        if self.main_grads:
            _drain(param, view)
        elif not _holds(param.grad, view):
            # First gradient since zero_grad(set_to_none=True) or since the bucket was freed:
            # move it into the bucket so later micro-steps accumulate in place there.
            grad = _like_param(param.grad, param)
            view.copy_(local_tensor(grad))
            param.grad = _grad_in(view, grad)
        bucket.ready += 1
        if self.sync:
            self._launch_ready(during_backward=True)
            self._poll()

    def _launch_ready(self, during_backward: bool) -> None:
        # Strictly in index order: collectives must be issued in the same order on every rank.
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            bucket = self.buckets[self._next]
            with torch.profiler.record_function("ultrascale/grad_sync"):  # named in traces (profiler=torch)
                bucket.work = self._launch(bucket)
            self.launch_log.append((self._next, during_backward))
            self._next += 1

    def _finish_backward(self) -> None:
        self._callback_queued = False
        if self.sync:
            for bucket in self.buckets:
                if self.main_grads:
                    # Gradients a pipeline's weight-only backward assigned without a hook are added
                    # too; parameters without one have nothing to add (their slices hold zeros).
                    if bucket.grad_buffer is None:
                        self._allocate_grads(bucket)
                    for p, view in zip(bucket.params, bucket.grad_views):
                        if p.grad is not None:
                            _drain(p, view)
                    bucket.ready = len(bucket.params)
                    continue
                if bucket.ready == len(bucket.params):
                    continue
                # Parameters that took no part in this backward are still reduced on every rank
                # (another rank may have used them): they contribute zeros.
                if bucket.grad_buffer is None:
                    self._allocate_grads(bucket)
                for p, view in zip(bucket.params, bucket.grad_views):
                    if not _holds(p.grad, view):
                        view.zero_()
                        grad = p if p.grad is None else _like_param(p.grad, p)
                        if p.grad is not None:
                            view.copy_(local_tensor(grad))
                        p.grad = _grad_in(view, grad)
                bucket.ready = len(bucket.params)
            self._launch_ready(during_backward=False)
            with torch.profiler.record_function("ultrascale/grad_sync_wait"):
                self._complete()
        for bucket in self.buckets:
            bucket.ready = 0
        self._next = 0

    def main_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """``param``'s fp32 main-gradient slice, with its pending ``.grad`` added in (``None``: not main gradients).

        For code that must act on a parameter's accumulated gradient before the reduction (a
        pipeline summing a tied weight's two copies).
        """
        if not self.main_grads or param not in self._slot:
            return None
        bucket, i = self._slot[param]
        if bucket.grad_buffer is None:
            self._allocate_grads(bucket)
        view = bucket.grad_views[i]
        if param.grad is not None:
            _drain(param, view)
        return view

    def reduce_now(self) -> None:
        """Reduce the gradients accumulated under :meth:`no_sync`, outside any backward.

        A pipeline schedule runs one backward per microbatch (and zero-bubble schedules compute
        weight gradients with ``autograd.grad``, which fires no hooks): the strategy runs it under
        ``no_sync`` and reduces once, here, when the schedule is done.
        """
        if not self.sync:
            raise RuntimeError("reduce_now() inside no_sync(): the gradients are not complete yet")
        self.launch_log = []
        with torch.no_grad():
            self._finish_backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside this block reduces the sum."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def remove(self) -> None:
        """Detach the hooks (the model can be parallelised again afterwards)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class BucketedAllReduce(GradientBuckets):
    """Average the gradients of ``params`` over ``group`` in buckets, overlapped with backward.

    ``masters``: the fp32 master copy of each (bf16) parameter, which the optimizer steps instead
    (``bf16-mixed``): after the reduction each master's ``.grad`` is its bucket's slice in fp32
    (the bucket itself under an fp32 ``reduce_dtype``, a copy under bf16, dropped after the step),
    and :meth:`after_step` copies the updated masters into the parameters.

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
        masters: Mapping[nn.Parameter, nn.Parameter] | None = None,
    ) -> None:
        managed = [p for p in params if p.requires_grad]
        super().__init__(managed)
        self.group = group
        self.group_size = dist.get_world_size(group)
        # bf16 gradients summed in fp32: a transient fp32 copy per bucket buys exact sums.
        self.reduce_dtype = reduce_dtype
        self.masters = masters
        self.main_grads = masters is not None and reduce_dtype == torch.float32
        buckets = []
        for members in plan_buckets(managed, bucket_bytes):
            offsets = [0, *itertools.accumulate(local_tensor(p).numel() for p in members)]
            buckets.append(_AllReduceBucket(members, offsets[:-1], offsets[-1]))
        self._set_buckets(buckets)

    def _allocate_grads(self, bucket: GradBucket) -> None:
        # Allocated lazily: the plugin is applied while parameters are still on the meta device.
        first = bucket.params[0]
        dtype = torch.float32 if self.main_grads else first.dtype
        bucket.grad_buffer = torch.zeros(bucket.numel, dtype=dtype, device=first.device)
        bucket.grad_views = [
            bucket.grad_buffer[o : o + local_tensor(p).numel()].view_as(local_tensor(p))
            for p, o in zip(bucket.params, bucket.offsets)
        ]

    def _launch(self, bucket: GradBucket) -> dist.Work | None:
        assert isinstance(bucket, _AllReduceBucket) and bucket.grad_buffer is not None
        if self.group_size == 1:  # one data rank (master weights still need the buckets)
            return None
        wire = bucket.grad_buffer
        if self.reduce_dtype is not None and wire.dtype != self.reduce_dtype:
            wire = bucket.wire = wire.to(self.reduce_dtype)
        # Pre-divide so the sum is the mean (DDP does the same; keeps bf16 sums in range).
        wire.div_(self.group_size)
        return dist.all_reduce(wire, group=self.group, async_op=True)

    def _complete(self) -> None:
        for bucket in self.buckets:
            assert isinstance(bucket, _AllReduceBucket)
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            if bucket.wire is not None:
                assert bucket.grad_buffer is not None
                bucket.grad_buffer.copy_(bucket.wire)
                bucket.wire = None
            if self.masters is not None:
                self._to_masters(bucket)

    def _to_masters(self, bucket: _AllReduceBucket) -> None:
        """The reduced bucket becomes the masters' fp32 gradients."""
        assert self.masters is not None and bucket.grad_buffer is not None
        if bucket.grad_buffer.dtype == torch.float32:
            source = bucket.grad_buffer
        else:  # bf16 buckets: the optimizer's fp32 copy lives until the step is done
            source = bucket.main = bucket.grad_buffer.float()
        for p, offset in zip(bucket.params, bucket.offsets):
            master = self.masters[p]
            view = source[offset : offset + local_tensor(p).numel()].view_as(local_tensor(p))
            if not _holds(master.grad, view):
                master.grad = _grad_in(view, master)

    def after_step(self) -> None:
        """After the optimizer stepped the masters: copy them into the parameters, start the next step's gradients.

        The buckets are zeroed (the next backward accumulates into them), the fp32 copies of bf16
        buckets dropped: gradients do not accumulate across optimizer steps.
        """
        assert self.masters is not None
        with torch.no_grad():
            params = list(self.masters)
            torch._foreach_copy_([local_tensor(p) for p in params], [local_tensor(self.masters[p]) for p in params])
            for bucket in self.buckets:
                assert isinstance(bucket, _AllReduceBucket)
                if bucket.grad_buffer is not None:
                    bucket.grad_buffer.zero_()
                if bucket.main is not None:
                    bucket.main = None
                    for p in bucket.params:
                        self.masters[p].grad = None
