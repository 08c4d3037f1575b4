"""A pipeline stage's microbatch buffers, freed as soon as the microbatch is done with them.

torch's pipeline stages keep, per microbatch, memory the microbatch no longer needs: the buffer
each activation is received into and the one each output gradient is received into (allocated
once per microbatch and kept between steps), and every tensor the stage sent, output or input
gradient (the multi-stage schedules hold each send's ``Work`` until the step ends, and the work
holds its tensor). On a rank with ``s`` stages and ``m`` microbatches that is up to ``4 m s``
hidden states of one microbatch, where the schedule itself only needs the microbatches in flight
(measured here: interleaved 1F1B, pp2, 8 microbatches, width 256, seq 256: 28% of a rank's peak).

:class:`FreeingStage` frees each as soon as it is safe, as Megatron does with its pipeline outputs:

- received activations and output gradients: after the microbatch's backward on this stage (the
  weight half, where backward is split); the storage comes back before the next receive into it;
- sent tensors: once their send has completed (its ``Work``, which :func:`tracking_sends` records
  while the schedule runs) and, for an output, once the stage's backward of it has run (a stage's
  last op may keep its output for backward). On gloo, what the multi-stage schedules send lives
  until the step ends (:class:`SendLedger`);
- an output handed to the next stage on the same rank (V-shaped schedules): after this stage's
  backward of the microbatch, which follows the next stage's.

Freeing resizes a storage to zero bytes (what FSDP does to parameters it re-gathers); every
tensor keeps its shape, so torch's bookkeeping is untouched. Without ``schedules._batch_p2p``
(another torch version), sends are not tracked and their tensors live until the step ends, as
without this class; everything else is still freed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor


def _local(t: Any) -> Tensor | None:
    """The tensor whose storage holds ``t``'s bytes (a DTensor's local shard); None if not a tensor."""
    if isinstance(t, DTensor):
        return t._local_tensor
    return t if isinstance(t, Tensor) else None


def _nbytes(t: Tensor) -> int:
    """Bytes of storage ``t`` spans (from its storage offset to its last element)."""
    if t.numel() == 0:
        return 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (t.storage_offset() + extent) * t.element_size()


def free(t: Any) -> None:
    """Give ``t``'s storage back to the allocator (its shape stays; its bytes are gone)."""
    local = _local(t)
    if local is not None and local.untyped_storage().nbytes() > 0:
        local.untyped_storage().resize_(0)


def restore(t: Any) -> None:
    """Give a freed ``t`` storage again (uninitialised: it is about to be received into)."""
    local = _local(t)
    if local is not None and local.untyped_storage().nbytes() == 0 and local.numel() > 0:
        local.untyped_storage().resize_(_nbytes(local))


def _key(t: Any) -> int:
    """The address of ``t``'s storage: a send's tensor is a detached alias of what the stage holds."""
    local = _local(t)
    return local.untyped_storage().data_ptr() if local is not None else 0


class SendLedger:
    """Sent tensors, freed once every send of them completed and the stage released them.

    An output is released by its stage's backward of it, which needed the next stage's gradient
    of it: the next stage has received it, so its send is waited for (it cannot block). An input
    gradient is released at once and its send only polled (the previous stage may not have asked
    for it yet): NCCL reports a send complete once its kernel has run, gloo only once waited for,
    so on gloo a gradient that a multi-stage schedule sent lives until the step ends (when the
    schedule waits for its sends), as without this class.
    """

    def __init__(self) -> None:
        # storage address -> _Sent
        self._sent: dict[int, _Sent] = {}

    def expect(self, tensors: Iterable[Tensor], output: bool) -> None:
        """The stage is about to send ``tensors``: outputs (held until their backward) or input gradients."""
        for t in tensors:
            entry = self._sent.setdefault(_key(t), _Sent(t, output))
            entry.expected += 1

    def launched(self, t: Tensor, works: list[_Once]) -> None:
        """``t`` was sent by ``works`` (its send's own, or a whole coalesced batch's)."""
        if (entry := self._sent.get(_key(t))) is not None:
            entry.works.extend(works)
            entry.launched += 1

    def holds(self, t: Any) -> bool:
        return _key(t) in self._sent

    def release(self, t: Any) -> None:
        """The stage's backward of output ``t`` has run."""
        if (entry := self._sent.get(_key(t))) is not None:
            entry.released = True

    def sweep(self) -> None:
        """Free every released tensor whose sends have all completed."""
        for key in [k for k, e in self._sent.items() if e.done()]:
            free(self._sent.pop(key).tensor)

    def clear(self) -> None:
        self._sent.clear()


class _Sent:
    __slots__ = ("expected", "launched", "output", "released", "tensor", "works")

    def __init__(self, tensor: Tensor, output: bool) -> None:
        self.tensor, self.output, self.released = tensor, output, not output
        self.works: list[_Once] = []
        self.expected = self.launched = 0

    def done(self) -> bool:
        if not (self.released and self.launched == self.expected):
            return False
        if self.output:  # received already (see SendLedger): the wait returns at once
            for w in self.works:
                w.wait()
            return True
        return all(w.is_completed() for w in self.works)


class _Once:
    """A ``Work`` waited for at most once: the ledger and the schedule may both wait for it (a
    second ``wait`` on a gloo send would wait for another send)."""

    __slots__ = ("waited", "work")

    def __init__(self, work: dist.Work) -> None:
        self.work, self.waited = work, False

    def wait(self, *args: Any) -> bool:
        if not self.waited:
            self.work.wait(*args)
            self.waited = True
        return True

    def is_completed(self) -> bool:
        return self.waited or self.work.is_completed()


@contextlib.contextmanager
def tracking_sends(ledger: SendLedger) -> Iterator[None]:
    """Record the ``Work`` of every send the schedule launches meanwhile (see the module docstring)."""
    from torch.distributed.pipelining import schedules

    launch = getattr(schedules, "_batch_p2p", None)
    if launch is None:
        yield
        return

    def tracked(p2p_ops: list[dist.P2POp], *args: Any, **kwargs: Any) -> list[_Once]:
        works = [_Once(w) for w in launch(p2p_ops, *args, **kwargs) or ()]
        one_each = len(works) == len(p2p_ops)  # gloo, or sends alone: one work per op, in order
        for i, op in enumerate(p2p_ops):
            if op.op is dist.isend:
                ledger.launched(op.tensor, [works[i]] if one_each else works)
        return works

    schedules._batch_p2p = tracked
    try:
        yield
        ledger.sweep()  # the schedule has waited for all its sends
    finally:
        schedules._batch_p2p = launch
        ledger.clear()


class FreeingStage:
    """Mixin for torch's ``PipelineStage``: frees each microbatch's buffers when done (module docstring).

    ``ledger`` is the step's :class:`SendLedger` (shared by the rank's stages).
    """

    ledger: SendLedger
    # (torch's PipelineStage provides these)
    fwd_cache: dict[int, Any]
    args_recv_info: dict[int, Any]
    grad_recv_info: dict[int, Any]
    is_last: bool

    def init_freeing(self, ledger: SendLedger) -> None:
        self.ledger = ledger
        self._received: dict[int, list[Tensor]] = {}  # microbatch -> activation buffers received into
        self._outputs: dict[int, tuple[Any, ...]] = {}  # microbatch -> outputs awaiting a split backward's weight half

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        # A model input is a `_RootArgPlaceholder` (torch 2.11, no buffer) or a `_RecvInfo` with is_root_arg (2.13).
        received = [i for i in self.args_recv_info[fwd_chunk_id] if not getattr(i, "is_root_arg", False)]
        buffers = [b for i in received if (b := getattr(i, "buffer", None)) is not None]
        for b in buffers:
            restore(b)
        self._received[fwd_chunk_id] = buffers
        return super().get_fwd_recv_ops(fwd_chunk_id)  # type: ignore[misc]

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        for info in self.grad_recv_info.get(bwd_chunk_id, ()):
            restore(info.buffer)
        return super().get_bwd_recv_ops(bwd_chunk_id)  # type: ignore[misc]

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)  # type: ignore[misc]
        self.ledger.expect((op.tensor for op in ops), output=True)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)  # type: ignore[misc]
        self.ledger.expect((op.tensor for op in ops), output=False)  # (an input's .grad too: freed once sent)
        return ops

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        outputs = self.fwd_cache[bwd_chunk_id][0] if bwd_chunk_id in self.fwd_cache else ()
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        result = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)  # type: ignore[misc]
        if full:
            self._done(bwd_chunk_id, outputs)
        else:
            self._outputs[bwd_chunk_id] = outputs
        return result

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        result = super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)  # type: ignore[misc]
        self._done(bwd_chunk_id, self._outputs.pop(bwd_chunk_id, ()))
        return result

    def _done(self, chunk: int, outputs: tuple[Any, ...]) -> None:
        """Microbatch ``chunk``'s backward has run on this stage: free what it no longer needs."""
        for b in self._received.pop(chunk, ()):
            free(b)
        for info in self.grad_recv_info.get(chunk, ()):
            free(info.buffer)  # received, or handed over by the next stage on this rank
        if not self.is_last:
            for t in outputs:
                if self.ledger.holds(t):
                    self.ledger.release(t)
                elif isinstance(_local(t), Tensor) and not _local(t)._is_view():  # type: ignore[union-attr]
                    free(t)  # handed to the next stage on this rank, whose backward has run
        self.ledger.sweep()
