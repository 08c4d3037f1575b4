"""A pipeline stage frees each microbatch's buffers once done with them (parallel/pipeline/buffers.py)."""

import dataclasses
import gc

import lightning as L
import pytest
import torch

from lightning_ultrascale import LlamaModule, OptimConfig, PipelineParallel, UltraScaleDataModule, UltraScaleStrategy
from lightning_ultrascale.models import get_model_config
from lightning_ultrascale.parallel.pipeline.buffers import SendLedger, _Once, free, restore
from lightning_ultrascale.testing import run_workers
from lightning_ultrascale.testing.parity import QUIET_TRAINER

SEQ, DIM = 64, 48
WIDE = dataclasses.replace(get_model_config("llama_tiny"), dim=DIM, n_layers=4, n_heads=4, n_kv_heads=2, name="wide")


class _Inspect(L.Callback):
    """After each step: the bytes of the stages' receive buffers, and of every hidden-state-shaped tensor alive."""

    def __init__(self) -> None:
        self.receive_buffers: list[int] = []
        self.hidden_states: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: object) -> None:
        schedule = trainer.strategy.step._schedule
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        buffers = [
            info.buffer
            for stage in stages
            for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
            for info in infos
            if not getattr(info, "is_root_arg", False) and getattr(info, "buffer", None) is not None
        ]
        self.receive_buffers.append(sum(b.untyped_storage().nbytes() for b in buffers))
        gc.collect()
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        alive = {
            o.untyped_storage().data_ptr(): o.untyped_storage().nbytes()
            for o in gc.get_objects()
            if isinstance(o, torch.Tensor) and o.shape[-2:] == (SEQ, DIM) and o.untyped_storage().nbytes() > 0
        }
        self.hidden_states.append(sum(n for ptr, n in alive.items() if ptr not in params))


def _fit(schedule: str) -> tuple[list[int], list[int]]:
    inspect = _Inspect()
    strategy = UltraScaleStrategy(PipelineParallel(2, schedule=schedule, microbatches=8))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, callbacks=[inspect],
                        **QUIET_TRAINER)  # fmt: skip
    module = LlamaModule(WIDE, optim=OptimConfig(name="adamw", lr=1e-3, warmup_steps=0))
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=SEQ, micro_batch_size=8))
    return inspect.receive_buffers, inspect.hidden_states


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zbv"])
def test_no_microbatch_buffer_outlives_its_step(schedule):
    # torch's stages keep a receive buffer per microbatch between steps, and (multi-stage
    # schedules) every sent tensor until the step ends: 8 microbatches x up to 4 hidden states
    # per stage. Ours free each once its microbatch is done (the parity tests check the numbers).
    for receive_buffers, hidden_states in run_workers(_fit, 2, schedule):
        assert receive_buffers == [0, 0]
        assert hidden_states == [0, 0]


# ----------------------------------------------------------------------------- the pieces
def test_a_freed_buffer_keeps_its_shape_and_gets_its_bytes_back():
    t = torch.arange(12.0).view(3, 4)[1:]  # a view at an offset: 12 floats of storage
    free(t)
    assert t.shape == (2, 4) and t.untyped_storage().nbytes() == 0
    restore(t)
    assert t.untyped_storage().nbytes() == 12 * 4
    t.fill_(1.0)


class _Work:
    def __init__(self, done: bool = False) -> None:
        self.done, self.waits = done, 0

    def wait(self) -> bool:
        self.waits += 1
        self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


def test_a_work_is_waited_for_at_most_once():
    # A second wait on a gloo send waits for another send (a hang): the ledger and the schedule
    # may both wait for the same one.
    work = _Work()
    once = _Once(work)
    once.wait()
    once.wait()
    assert work.waits == 1 and once.is_completed()


def test_an_output_is_freed_after_its_backward_and_a_gradient_once_its_send_completed():
    ledger = SendLedger()
    output, gradient = torch.ones(4), torch.ones(4)
    ledger.expect([output], output=True)
    ledger.expect([gradient], output=False)
    output_work, gradient_work = _Once(_Work()), _Once(_Work())
    ledger.launched(output, [output_work])
    ledger.launched(gradient, [gradient_work])
    ledger.sweep()
    # The output is not released (its backward has not run); the gradient's send is not complete.
    assert output.untyped_storage().nbytes() == gradient.untyped_storage().nbytes() == 16
    ledger.release(output)
    ledger.sweep()  # released: its send is waited for (the next stage has received it)
    assert output.untyped_storage().nbytes() == 0 and output_work.work.waits == 1
    assert gradient.untyped_storage().nbytes() == 16  # polled only: never waited for by the ledger
    gradient_work.work.done = True
    ledger.sweep()
    assert gradient.untyped_storage().nbytes() == 0 and gradient_work.work.waits == 0
