"""A NaN on one rank stops every rank in the same step, with a message that says where (or the step is skipped)."""

import lightning as L
import torch
from llama_runs import SGD

from lightning_ultrascale import LlamaModule, UltraScaleDataModule, UltraScaleStrategy, ZeRO
from lightning_ultrascale.core.guard import NonFiniteError, NonFiniteGuard
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import QUIET_TRAINER


class _NaNOnRank1(LlamaModule):
    """At batch 2, rank 1's loss (``where="loss"``) or its ``norm.weight`` gradient (``"grad"``) becomes NaN."""

    def __init__(self, where: str) -> None:
        super().__init__("llama_tiny", optim=SGD)
        self.where = where

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and batch_idx == 2:
            if self.where == "loss":
                return loss * float("nan")
            self.model.norm.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
        return loss


def _fit(where: str, stage: int, skip_step: bool):
    strategy = UltraScaleStrategy(ZeRO(stage=stage, bucket_mb=0.01), guard=NonFiniteGuard(skip_step=skip_step))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, **QUIET_TRAINER)
    module = _NaNOnRank1(where)
    try:
        trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=32, micro_batch_size=2))
    except NonFiniteError as err:
        return str(err), trainer.global_step
    finite = all(bool(torch.isfinite(p).all()) for p in module.parameters())
    return strategy.guard.skipped, trainer.global_step, finite


def test_a_nan_loss_on_one_rank_stops_every_rank_naming_the_step_and_the_rank():
    results = run_pooled(_fit, 2, "loss", 0, False)
    messages = {message for message, _ in results}
    assert len(messages) == 1, messages  # the same message on every rank, at the same step
    message = messages.pop()
    assert "non-finite loss at step 2 on rank 1" in message
    assert "its first non-finite parameter gradient: model." in message and "guard.skip_step=true" in message
    assert [step for _, step in results] == [2, 2]  # stopped before the optimizer step


def test_a_nan_gradient_in_a_sharded_optimizer_names_its_parameter():
    results = run_pooled(_fit, 2, "grad", 2, False)
    message = results[0][0]
    assert "non-finite gradient at step 2" in message, message
    assert "model.norm.weight (in a sharded optimizer's shard)" in message, message
    assert results[0][0] == results[1][0]


def test_skip_step_skips_and_counts_and_the_run_goes_on():
    for skipped, steps, finite in run_pooled(_fit, 2, "loss", 0, True):
        assert (skipped, steps, finite) == (1, 4, True)
