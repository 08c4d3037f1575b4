"""ZeRO-1/2 parameter all-gathers overlap the next forward, and nothing reads a parameter still in flight.

The sharded optimizer launches each bucket's all-gather at the step and waits for it where the next
forward first needs it (``sharded_optimizer.py``). Gloo finishes the gathers of a tiny model in
microseconds, so a missing wait would rarely show in the numbers: these runs watch every op instead
(a dispatch mode that reports any op touching a bucket whose gather has not been waited for), in
the real Lightning loop with everything that reads parameters between two forwards: gradient
accumulation, validation, checkpoint saves, recomputation, a tied or a fused head, TP and PP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning as L
import pytest
import torch
from llama_runs import GLOBAL_BATCH, SEQ_LEN, SGD, SaveCheckpoint, run_tiny_llama
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ultrascale import (
    LlamaModule,
    PipelineParallel,
    Recompute,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.models import get_model_config
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import QUIET_TRAINER, ParityRecorder, RunRecord, assert_parity
from lightning_ultrascale.utils.comm import CommTracer, _is_subclass_needing_dispatch

TINY_TIED = dataclasses.replace(get_model_config("llama_tiny"), name="llama_tiny_tied", tie_embeddings=True)
#: Ops that take a tensor's shape, dtype and device only (views are recognised by their schema).
_METADATA_ONLY = {torch.ops.aten.zeros_like, torch.ops.aten.empty_like, torch.ops.aten.ones_like}


class _InFlightReads(TorchDispatchMode):
    """Every op that reads or writes a parameter bucket whose all-gather is still in flight."""

    def __init__(self, buckets: list[Any]) -> None:
        super().__init__()
        self.buckets = buckets
        self.reads: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(_is_subclass_needing_dispatch(t) for t in types):
            return NotImplemented  # a DTensor's local ops come back here
        pending = {b.flat_params.untyped_storage().data_ptr() for b in self.buckets if b.gathering is not None}
        if pending and func.namespace == "aten" and not func.is_view and func.overloadpacket not in _METADATA_ONLY:
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if any(not isinstance(t, FakeTensor) and t.untyped_storage().data_ptr() in pending for t in tensors):
                self.reads.append(str(func))
        return func(*args, **kwargs)


class _WatchGathers(L.Callback):
    """Watches a fit: in-flight reads, buckets still in flight when the first block starts, and at each save."""

    def __init__(self) -> None:
        self.pending_at_first_block: list[tuple[int, bool, int]] = []  # (global step, training, buckets)
        self.pending_at_save: list[int] = []
        self.reads: list[str] = []

    def _pending(self) -> int:
        return sum(b.gathering is not None for b in self.buckets)

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        syncs = trainer.strategy.layout.grad_syncs
        self.buckets = [b for sync in syncs if sync.reducer is not None for b in sync.reducer.buckets]
        first = next(iter(pl_module.model.layers.values()))  # this rank's first block (a pipeline stage's)

        def count(*_: Any) -> None:
            self.pending_at_first_block.append((trainer.global_step, trainer.training, self._pending()))

        first.register_forward_pre_hook(count)
        self.mode = _InFlightReads(self.buckets)
        self.mode.__enter__()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # Lightning has collected the state dicts; DCP writes their tensors after this hook.
        self.pending_at_save.append(self._pending())

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.mode.__exit__(None, None, None)  # after the parity recorder's own on_train_end: its reads count
        self.reads = self.mode.reads


def _watched_fit(plugins: list[Any], world_size: int, dp: int, accumulate: int, module: dict[str, Any], path: str):
    L.seed_everything(0, verbose=False)
    watch = _WatchGathers()
    # Steps 2 and 4 are followed by a validation, step 3 by a checkpoint, step 4 also by the end of
    # training (the parity recorder reads every parameter): each must wait for the gathers.
    settings = {**QUIET_TRAINER, "limit_val_batches": 1, "val_check_interval": 2 * accumulate}
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=UltraScaleStrategy(*plugins), max_steps=4,
        accumulate_grad_batches=accumulate, callbacks=[ParityRecorder(), SaveCheckpoint(path, step=3), watch],
        **settings,
    )  # fmt: skip
    data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // (dp * accumulate), seed=0)
    trainer.fit(LlamaModule(optim=SGD, **module), datamodule=data)
    return watch.reads, watch.pending_at_first_block, watch.pending_at_save


#: name -> (plugins, world size, dp, accumulation, LlamaModule arguments)
WATCHED = {
    "zero2-tied-recompute-accumulate": (
        lambda: [ZeRO(2, bucket_mb=0.05), Recompute("full")], 2, 2, 2, {"model": TINY_TIED}
    ),
    "zero1-fused-head": (lambda: [ZeRO(1, bucket_mb=0.05)], 2, 2, 1, {"fused_cross_entropy": True}),
    "zero1-tp2": (lambda: [ZeRO(1, bucket_mb=0.05), TensorParallel(2)], 4, 2, 1, {}),
    "zero2-pp2": (lambda: [ZeRO(2, bucket_mb=0.05), PipelineParallel(2, "1f1b")], 4, 2, 1, {}),
}  # fmt: skip


@pytest.mark.parametrize("layout", list(WATCHED))
def test_zero12_parameters_are_never_read_while_being_gathered(tmp_path, layout):
    plugins, world_size, dp, accumulate, module = WATCHED[layout]
    args = (plugins(), world_size, dp, accumulate, module, str(tmp_path / "ckpt"))
    results = run_pooled(_watched_fit, world_size, *args)
    for rank, (reads, pending_at_first_block, pending_at_save) in enumerate(results):
        assert reads == [], f"rank {rank} read parameters in flight: {sorted(set(reads))}"
        # The training forward after step 1 and the validation after step 2 start while buckets
        # are still being gathered: the first block computes while later blocks' gathers run.
        first_after = {(step, training): n for step, training, n in reversed(pending_at_first_block)}
        assert first_after[1, True] > 0 and first_after[2, False] > 0, pending_at_first_block
        assert pending_at_save == [0], "a checkpoint must be written from complete parameters"


def _fit_resumed(path: str, max_steps: int, ckpt_path: str | None) -> RunRecord:
    L.seed_everything(0, verbose=False)
    recorder = ParityRecorder()
    save = [SaveCheckpoint(path, step=2, stop=True)] if ckpt_path is None else []
    settings = {**QUIET_TRAINER, "limit_val_batches": 1, "val_check_interval": 2}  # validate after every step
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=UltraScaleStrategy(ZeRO(2, bucket_mb=0.05)), max_steps=max_steps,
        accumulate_grad_batches=2, callbacks=[recorder, *save], **settings,
    )  # fmt: skip
    data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // 4, seed=0)
    trainer.fit(LlamaModule("llama_tiny", optim=SGD), datamodule=data, ckpt_path=ckpt_path)
    return recorder.record


def test_zero2_with_accumulation_validation_and_a_resume_matches_one_process(tmp_path):
    path = str(tmp_path / "ckpt")
    first = run_pooled(_fit_resumed, 2, path, 4, None)[0]  # saves after step 2 and stops
    resumed = run_pooled(_fit_resumed, 2, path, 4, path)[0]
    run = RunRecord(losses=first.losses + resumed.losses, grads=first.grads + resumed.grads, params=resumed.params)
    assert len(first.losses) == 2
    assert_parity(run, run_tiny_llama(SGD, steps=4), rtol=1e-5)


def _gathered(precision: str) -> tuple[set[torch.dtype], int, int]:
    class Trace(L.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            self.tracer = CommTracer().__enter__()

        def on_train_batch_end(self, *args: Any) -> None:
            self.tracer.__exit__(None, None, None)

    trace = Trace()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=UltraScaleStrategy(ZeRO(2)), precision=precision, max_steps=1,
        callbacks=[trace], **QUIET_TRAINER,
    )  # fmt: skip
    module = LlamaModule("llama_tiny")
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=16, micro_batch_size=1))
    n_params = sum(p.numel() for p in module.parameters())
    return {p.dtype for p in module.parameters()}, trace.tracer.total(op="all_gather"), n_params


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("32-true", torch.float32), ("bf16-mixed", torch.bfloat16), ("bf16-true", torch.bfloat16)],
)
def test_zero12_gathers_parameters_in_their_own_dtype(precision, dtype):
    param_dtypes, gathered_bytes, n_params = run_pooled(_gathered, 2, precision)[0]
    # bf16-mixed: bf16 weights on the device (their fp32 masters are the optimizer's shards), so 2
    # bytes move, as under bf16-true; fp32 moves 4. Padding: under N=2 ranks at most one element per
    # bucket (two buckets: the weight-decayed parameters and the others).
    assert param_dtypes == {dtype}
    assert n_params * dtype.itemsize <= gathered_bytes <= (n_params + 2) * dtype.itemsize
