"""Every tensor the package hands to a collective is built on the collective's device (NCCL serves CUDA only).

On a CPU every tensor is a CPU tensor, so the check marks the tensors a package module builds
without a device and fails any collective handed one (``testing/collectives.py``).
"""

import lightning as L
import pytest
import torch
import torch.distributed as dist
from llama_runs import MOE_TINY, SGD

from lightning_ultrascale import (
    ContextParallel,
    ExpertParallel,
    LlamaModule,
    PipelineParallel,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.core.guard import NonFiniteGuard
from lightning_ultrascale.testing import run_workers
from lightning_ultrascale.testing.collectives import CollectiveDeviceCheck, CollectiveDeviceError
from lightning_ultrascale.testing.parity import QUIET_TRAINER
from lightning_ultrascale.utils.grad import grad_norm


class _NaNGradientOnRank1(NonFiniteGuard):
    """Rank 1 finds a NaN gradient at step 1: the step is skipped and clipping then sees no gradient at all."""

    steps = 0

    def status(self, optimizer):
        self.steps += 1
        if self.steps == 2 and dist.get_rank() == 1:
            grad = next(p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
            (grad.to_local() if hasattr(grad, "to_local") else grad).fill_(float("nan"))
        return super().status(optimizer)


LAYOUTS = {
    "zero2": ("llama_tiny", lambda: [ZeRO(stage=2)], {}),
    "pp2": ("llama_tiny", lambda: [PipelineParallel(2, schedule="1f1b", microbatches=2)], {}),
    "tp2-fused-loss": ("llama_tiny", lambda: [TensorParallel(2)], {"fused_cross_entropy": True}),
    "ep2xcp2": (MOE_TINY, lambda: [ExpertParallel(2), ContextParallel(2, "ring")], {}),
}


def _fit_checked(layout: str) -> tuple[int, int]:
    model, plugins, module_kwargs = LAYOUTS[layout]
    guard = _NaNGradientOnRank1(skip_step=True)
    strategy = UltraScaleStrategy(*plugins(), guard=guard)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=3, gradient_clip_val=1.0, **QUIET_TRAINER
    )
    module = LlamaModule(model, optim=SGD, **module_kwargs)
    with CollectiveDeviceCheck(strategy.root_device) as check:
        trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=32, micro_batch_size=4))
    return check.checked, guard.skipped


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_collective_gets_tensors_built_on_its_device(layout):
    for checked, skipped in run_workers(_fit_checked, 2, layout):
        assert checked > 20 and skipped == 1


def _norm_without_gradients() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    with CollectiveDeviceCheck():
        grad_norm([p], across=[dist.group.WORLD])


def test_the_check_fails_a_collective_on_a_tensor_built_without_a_device():
    def all_reduce_deviceless() -> None:
        with CollectiveDeviceCheck():
            dist.all_reduce(torch.zeros(2))  # the test's own frame is not the package's: allowed

    run_workers(all_reduce_deviceless, 2)
    run_workers(_norm_without_gradients, 2)  # grad_norm builds its zero on collective_device()
    with pytest.raises(Exception, match=CollectiveDeviceError.__name__):
        run_workers(_deviceless_in_package, 2)


def _deviceless_in_package() -> None:
    import lightning_ultrascale.core.agreement as agreement_module
    from lightning_ultrascale.core.guard import NonFiniteGuard

    # The step agreement's rows built without a device again, as the guard's were: the check must name it.
    original = agreement_module.collective_device
    agreement_module.collective_device = lambda: None
    try:
        with CollectiveDeviceCheck():
            NonFiniteGuard().check(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), 0, lambda t, i: "")
    finally:
        agreement_module.collective_device = original


def test_the_token_weighting_keeps_its_counts_on_the_batch_s_device():
    # Every step of every run ends in TokenNormaliser.finish; its counts were stacked with a CPU
    # scalar (a crash beside CUDA counts at every GPU step, invisible on CPU). The meta device
    # stands in for CUDA: any tensor built off the batch's device fails to stack with it.
    from lightning_ultrascale.utils.loss import TokenNormaliser

    norm = TokenNormaliser()
    norm.weight(torch.zeros(2, 8, dtype=torch.long, device="meta"))
    grad = torch.zeros(3, device="meta")
    norm.finish([grad], group=None, accumulate=1)
