"""Parity harness: a parallel layout must train exactly like one process.

Same seed, same global batch, N optimizer steps, compared with a single-device run of the same
LightningModule under plain Lightning (not our strategy: the reference must not share our code
paths). Every run goes through the real Lightning loop (gradient accumulation, zero_grad,
optimizer step), inside processes forked by :func:`run_workers` (or warm ones: :func:`run_pooled`).

What is compared, per optimizer step: the loss of the global batch (the mean of every rank's
micro-batch losses) and every parameter's full gradient just before the optimizer step; and the
parameters after the last step. Tensors are compared by relative norm error,
``||x - ref|| / ||ref||``, because element-wise relative error is meaningless for gradients that
are near zero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_ultrascale.models.spec import find_model
from lightning_ultrascale.testing.pool import run_pooled

#: Trainer settings for measuring runs: no logging, checkpoints, bars, summaries or validation.
QUIET_TRAINER: dict[str, Any] = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "limit_val_batches": 0,
    "num_sanity_val_steps": 0,
}


@dataclass(frozen=True)
class _Piece:
    """A rank's part of a tensor, and where it sits in the whole: recorded without a collective."""

    local: torch.Tensor
    shape: tuple[int, ...]
    offset: tuple[int, ...]


def _piece(t: torch.Tensor) -> _Piece:
    t = t.detach()
    if isinstance(t, DTensor):
        if all(type(p) in (Shard, Replicate) for p in t.placements):  # a block of the whole on every rank
            _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            return _Piece(t.to_local().clone().float(), tuple(t.shape), tuple(offset))
        t = t.full_tensor()  # (partial sums, strided shards: gathered, by every rank of its mesh alike)
    return _Piece(t.clone().float(), tuple(t.shape), (0,) * t.dim())


def _whole_model(
    parts: list[dict[str, _Piece]], spread: dict[str, float] | None = None, copies: dict[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """Every rank's pieces put together: shards into their places, pipeline stages' parameters side by side.

    ``spread``, if given, receives each name's largest difference between the ranks that hold the
    same piece. ``copies`` maps the other names of a tied weight to its first name: one process
    names it once, a pipeline stage that holds only a copy names the copy; each copy must equal
    the original.
    """
    merged: dict[str, torch.Tensor] = {}
    placed: set[tuple[str, tuple[int, ...]]] = set()
    for part in parts:
        for name, piece in part.items():
            whole = merged.setdefault(name, torch.zeros(piece.shape))
            where = tuple(slice(o, o + n) for o, n in zip(piece.offset, piece.local.shape))
            if (name, piece.offset) not in placed:
                placed.add((name, piece.offset))
                whole[where] = piece.local
            elif spread is not None and piece.local.numel():
                spread[name] = max(spread.get(name, 0.0), float((piece.local - whole[where]).abs().max()))
            if spread is not None:
                spread.setdefault(name, 0.0)
    for copy, original in (copies or {}).items():
        if copy in merged and original in merged:
            value = merged.pop(copy)
            assert torch.equal(value, merged[original]), f"tied weight {original} and its copy {copy} differ"
    return merged


def _tied_copies(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, str]:
    """``{a tied weight's other name: its first name}`` in ``pl_module``'s names, from the strategy's Layout."""
    layout = getattr(trainer.strategy, "_layout", None)
    if layout is None:
        return {}
    _, name = find_model(pl_module)
    prefix = f"{name}." if name else ""
    return {prefix + copy: prefix + group[0] for group in layout.tied for copy in group[1:]}


@dataclass
class RunRecord:
    """What one run did: per-step global-batch loss, per-step gradients, final parameters."""

    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    #: The parameters when training started (the fp32 masters where kept): ``params - initial`` is the update.
    initial: dict[str, torch.Tensor] = field(default_factory=dict)
    #: Final persistent buffers (e.g. MoE routing biases), and how far apart the ranks' copies are.
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    buffer_spread: dict[str, float] = field(default_factory=dict)
    #: Graphs each compiled region kind compiled on rank 0 (``Compile.stats``); empty when nothing compiled.
    compiled_graphs: dict[str, int] = field(default_factory=dict)
    #: Per rank: the logical matrices (by shape) its optimizer orthogonalised (``Muon.orthogonalized``), if any.
    orthogonalized: list[dict[tuple[int, int], int]] = field(default_factory=list)


class ParityRecorder(L.Callback):
    """Records a :class:`RunRecord`; every rank must run it, rank 0 holds the whole record.

    Each rank keeps its own pieces of every tensor as training goes (no collective per step, beyond
    the loss); :meth:`on_train_end` gathers them once on rank 0, which puts the whole model together.
    """

    def __init__(self) -> None:
        self.record = RunRecord()
        self._loss_sum = torch.zeros(())
        self._grads: list[dict[str, _Piece]] = []
        self._initial: dict[str, _Piece] = {}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        # Lightning hands callbacks the loss divided by accumulate_grad_batches: summing the
        # micro-steps gives this rank's mean over its part of the global batch.
        self._loss_sum = self._loss_sum + loss.detach().float().cpu()
        if trainer.fit_loop._should_accumulate():
            return
        metrics = getattr(pl_module, "_step_metrics", None) or {}
        if "train/loss" in metrics:
            # The module's own loss of the step: every labelled token of the global batch once
            # (a mean of rank means is not that when ranks hold unequal labelled tokens), plus
            # the balancing losses it trains with, per token, and multi-token prediction's cross-entropy.
            step_loss = metrics["train/loss"] + metrics.get("train/aux_loss", 0.0) + metrics.get("train/mtp_loss", 0.0)
        else:
            step_loss = trainer.strategy.reduce(self._loss_sum.to(pl_module.device), reduce_op="mean")
        self.record.losses.append(float(step_loss))
        self._loss_sum = torch.zeros(())

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        # A sharded optimizer (ZeRO-1/2) keeps the averaged gradient in its shards, not in .grad
        # (for the parameters it shards: another group's engine may keep them in .grad).
        reduced = getattr(trainer.strategy, "reduced_gradients", lambda: None)() or {}
        grads = {n: reduced.get(p, p.grad) for n, p in pl_module.named_parameters()}
        self._grads.append({n: _piece(g) for n, g in grads.items() if g is not None})

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._initial = _stepped(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Callbacks run before the strategy's on_train_end: a sharded optimizer's gathers may be in flight.
        getattr(trainer.strategy, "wait_for_parameters", lambda: None)()
        persistent = pl_module.state_dict().keys()
        mine = {
            "grads": self._grads,
            "initial": self._initial,
            "params": _stepped(trainer, pl_module),
            "buffers": {n: _piece(b) for n, b in pl_module.named_buffers() if n in persistent},
            "orthogonalized": dict(getattr(trainer.optimizers[0], "orthogonalized", {})) if trainer.optimizers else {},
        }
        ranks: list[Any] = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
            dist.gather_object(mine, ranks or None, dst=0)
            if dist.get_rank() != 0:
                return  # the whole record is rank 0's (what record_run returns)
        copies = _tied_copies(trainer, pl_module)
        record = self.record
        record.grads = [_whole_model([r["grads"][i] for r in ranks], copies=copies) for i in range(len(self._grads))]
        record.initial = _whole_model([r["initial"] for r in ranks], copies=copies)
        record.params = _whole_model([r["params"] for r in ranks], copies=copies)
        record.buffers = _whole_model([r["buffers"] for r in ranks], record.buffer_spread)
        record.orthogonalized = [r["orthogonalized"] for r in ranks]
        for plugin in getattr(trainer.strategy, "plugins", ()):
            record.compiled_graphs.update(getattr(getattr(plugin, "stats", None), "graphs", {}))


def _stepped(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, _Piece]:
    """This rank's pieces of the parameters as the optimizer steps them: the fp32 masters of bf16 weights where kept."""
    masters = getattr(trainer.strategy, "master_weights", dict)()
    return {n: _piece(masters.get(p, p)) for n, p in pl_module.named_parameters()}


def record_run(
    make_module: Callable[[], L.LightningModule],
    make_datamodule: Callable[[], L.LightningDataModule],
    *,
    steps: int,
    accumulate_grad_batches: int = 1,
    strategy: Callable[[], Any] | None = None,
    world_size: int = 1,
    timeout_s: float = 300.0,
    **trainer_kwargs: Any,
) -> RunRecord:
    """Train ``steps`` optimizer steps on ``world_size`` forked CPU processes and record them.

    ``strategy=None`` runs plain Lightning on one device: the reference. Factories (not objects)
    are passed so that each process builds its own.
    """

    def worker() -> RunRecord:
        L.seed_everything(0, verbose=False)
        recorder = ParityRecorder()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=strategy() if strategy is not None else "auto",
            max_steps=steps,
            accumulate_grad_batches=accumulate_grad_batches,
            callbacks=[recorder],
            **{**QUIET_TRAINER, **trainer_kwargs},
        )
        trainer.fit(make_module(), datamodule=make_datamodule())
        return recorder.record

    records = run_pooled(worker, world_size, timeout_s=timeout_s)
    return records[0]


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` (absolute error where ``ref`` is all zeros)."""
    denom = ref.norm().item()
    diff = (x - ref).norm().item()
    return diff / denom if denom > 0 else diff


def assert_parity(
    run: RunRecord,
    ref: RunRecord,
    rtol: float = 1e-5,
    *,
    grad_rtol: float | None = None,
    later_grad_rtol: float | None = None,
    param_rtol: float | None = None,
    check_params: bool = True,
) -> None:
    """Raise ``AssertionError`` naming the first step/tensor whose relative error exceeds its bound.

    ``rtol`` bounds the losses and the final parameters; ``grad_rtol`` (default ``rtol``) the
    first step's gradients; ``later_grad_rtol`` (default ``grad_rtol``) the gradients of later
    steps, which inherit every earlier step's differences: with Adam, reduction-order noise in
    near-zero gradients is amplified by ``1/sqrt(v)`` into parameter differences (measured up to 2.4e-5); in
    bf16, single roundings do the same. ``param_rtol`` (default ``rtol``) bounds the final
    parameters, which inherit the same.
    """
    grad_rtol = rtol if grad_rtol is None else grad_rtol
    later_grad_rtol = grad_rtol if later_grad_rtol is None else later_grad_rtol
    assert len(run.losses) == len(ref.losses) > 0, f"steps differ: {len(run.losses)} vs {len(ref.losses)}"
    for step, (a, b) in enumerate(zip(run.losses, ref.losses)):
        err = abs(a - b) / abs(b)
        assert err <= rtol, f"step {step}: loss {a:.8f} vs reference {b:.8f} (relative error {err:.2e} > {rtol:.0e})"
    assert len(run.grads) == len(ref.grads), f"gradient snapshots differ: {len(run.grads)} vs {len(ref.grads)}"
    for step, (g, g_ref) in enumerate(zip(run.grads, ref.grads)):
        _assert_tensors_close(g, g_ref, grad_rtol if step == 0 else later_grad_rtol, f"step {step} gradient")
    if check_params:
        _assert_tensors_close(run.params, ref.params, rtol if param_rtol is None else param_rtol, "final parameter")


def _assert_tensors_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], rtol: float, what: str) -> None:
    assert got.keys() == ref.keys(), f"{what}: names differ: {sorted(got.keys() ^ ref.keys())[:5]}"
    errors = {n: relative_error(got[n], ref[n]) for n in ref}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= rtol, f"{what} {worst}: relative error {errors[worst]:.2e} > {rtol:.0e}"
