"""A training step reads the device from the host a fixed, small number of times: none per layer or parameter.

On a GPU every host read (``item()``, ``bool(t)``, ``tolist()``, data-sized outputs) stalls the
queue. ``HostSyncCounter`` finds them on a CPU; steps 2-4 of each layout are counted.
"""

from dataclasses import replace

import lightning as L
import pytest
import torch
from llama_runs import MOE_TINY, SGD

from lightning_ultrascale import (
    ExpertParallel,
    LlamaModule,
    PipelineParallel,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.core.fabric import FabricStrategy
from lightning_ultrascale.data.sampler import DataParallelSampler, ResumableDataLoader
from lightning_ultrascale.models import build_model
from lightning_ultrascale.testing import run_workers
from lightning_ultrascale.testing.parity import QUIET_TRAINER
from lightning_ultrascale.testing.syncs import HostSyncCounter
from lightning_ultrascale.training.resilience import Preemption

#: Reads per optimizer step any layout may make: the non-finite guard's verdict (one all-reduced
#: status), Lightning's own SIGTERM check (a broadcast flag it reads each step) and Lightning's
#: progress-bar metrics, which it turns into numbers every step (train/loss; imb for MoE models).
PER_STEP = 4
#: Expert parallelism reads each MoE layer's split sizes once per forward: torch's all_to_all_single
#: takes them as Python lists (a sync-free exchange needs NVSHMEM's all_to_all_vdev, GPU only).
PER_EP_LAYER = 1
CAPPED = replace(MOE_TINY, name="moe_tiny_capped", moe=replace(MOE_TINY.moe, capacity_factor=1.25))

LAYOUTS = {
    "zero1-dp2": ("llama_tiny", lambda: [ZeRO(stage=1)], 0),
    "zero3-dp2": ("llama_tiny", lambda: [ZeRO(stage=3)], 0),
    "pp2": ("llama_tiny", lambda: [PipelineParallel(2, "1f1b", 2)], 0),
    # (stage 0 holds MoE block 1, stage 1 blocks 2 and 3: the bias ranges are a maximum over the stages)
    "pp2-moe": (MOE_TINY, lambda: [PipelineParallel(2, "1f1b", 2)], 0),
    "dp2-moe-capacity": (CAPPED, lambda: [ZeRO(stage=0)], 0),
    "ep2-moe-capacity": (CAPPED, lambda: [ExpertParallel(2)], 3),
}


class _Count(L.Callback):
    def __init__(self) -> None:
        self.counter: HostSyncCounter | None = None
        self.counts: dict[str, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 1 and self.counter is None:
            self.counter = HostSyncCounter().__enter__()

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step == 4 and self.counter is not None and not self.counts:
            self.counter.__exit__(None, None, None)
            self.counts = dict(self.counter.counts)


def _count_syncs(layout: str) -> dict[str, int]:
    model, plugins, _ = LAYOUTS[layout]
    count = _Count()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=UltraScaleStrategy(*plugins()), max_steps=5, gradient_clip_val=1.0,
        callbacks=[count], **{**QUIET_TRAINER, "log_every_n_steps": 1000},
    )  # fmt: skip
    trainer.fit(LlamaModule(model, optim=SGD), datamodule=UltraScaleDataModule(seq_len=64, micro_batch_size=4))
    return count.counts


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_step_syncs_a_fixed_number_of_times(layout):
    # Before: the guard read every gradient's finiteness (51 reads a step for moe_tiny), MoE
    # routing ran bincount and, with a capacity, boolean-mask indexing in every layer, and expert
    # parallelism read its split sizes twice per layer and ran repeat_interleave without a size.
    ep_layers = LAYOUTS[layout][2]
    for counts in run_workers(_count_syncs, 2, layout):
        # The sampler's permutation is a host tensor on every machine: no device read.
        counts = {site: n for site, n in counts.items() if "lightning_ultrascale/data/" not in site}
        steps = 3
        assert sum(counts.values()) <= steps * (PER_STEP + PER_EP_LAYER * ep_layers), counts
        assert not [site for site in counts if "models/" in site], counts  # nothing per layer in the model
        expert_reads = sum(n for site, n in counts.items() if "parallel/expert/" in site)
        assert expert_reads == steps * ep_layers, counts  # one per MoE layer's forward, not two


# ------------------------------------------------------------------------------- the step's control traffic
#: The one control collective a step may issue (an all-reduce or broadcast outside the layouts' gradient
#: and parameter engines): the step's agreement.
AGREEMENT = "allreduce_ at lightning_ultrascale/core/agreement.py"


class _CountControl(_Count):
    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step == 4 and self.counter is not None and not self.counts:
            self.counter.__exit__(None, None, None)
            self.counts = {"reads": dict(self.counter.counts), "collectives": dict(self.counter.collectives)}


#: Layouts whose control traffic is counted, beyond LAYOUTS. Under tensor parallelism torch's
#: vocabulary-parallel embedding masks the other ranks' token ids with a boolean index_put (a host
#: read per forward, torch's code, filed under our embedding call); the collectives are the point here:
#: DTensor left the sequence-parallel norms' gradients Partial, and AdamW all-reduced each three times.
CONTROL_LAYOUTS = {**LAYOUTS, "tp2": ("llama_tiny", lambda: [TensorParallel(2)], 0)}
TORCH_READS = {"tp2": {"index_put_ at lightning_ultrascale/models/common/decoder.py"}}


def _count_control(layout: str, accumulate: int) -> dict[str, dict[str, int]]:
    model, plugins, _ = CONTROL_LAYOUTS[layout]
    count = _CountControl()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=UltraScaleStrategy(*plugins()), max_steps=5,
        accumulate_grad_batches=accumulate, callbacks=[count, Preemption()],
        **{**QUIET_TRAINER, "log_every_n_steps": 1000},
    )  # fmt: skip
    module = LlamaModule(model, optim=SGD)
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=64, micro_batch_size=4, mask_eos_loss=True))
    return count.counts


def _site(key: str) -> str:
    return key.rsplit(":", 1)[0]


@pytest.mark.parametrize(
    ("layout", "accumulate"), [("zero1-dp2", 2), ("zero3-dp2", 1), ("pp2", 1), ("pp2-moe", 1), ("tp2", 1)]
)
def test_a_healthy_step_agrees_in_one_control_collective_and_one_host_read(layout, accumulate):
    # The guard's status, the preemption flag, the token count and the logged loss's sums travel in one
    # all-reduce, read once (core/agreement.py), and Lightning's SIGTERM broadcast before each micro-batch
    # is off under Preemption. Before: four control all-reduces a step, three read back, plus one
    # broadcast and read per micro-batch (and a MAX over the stages for a pipelined MoE model's bias
    # ranges). Ignored labels (mask_eos_loss) make the token weighting work.
    steps = 3
    for counts in run_workers(_count_control, 2, layout, accumulate):
        control: dict[str, int] = {}
        for key, n in counts["collectives"].items():
            op, site = key.split(" at ")
            if op.startswith(("allreduce", "broadcast")) and not site.startswith("lightning_ultrascale/parallel/"):
                control[_site(key)] = control.get(_site(key), 0) + n
        assert control == {AGREEMENT: steps}, counts
        ours = {k: n for k, n in counts["reads"].items() if "lightning_ultrascale/" in k and "/data/" not in k}
        ours = {_site(k): n for k, n in ours.items() if _site(k) not in TORCH_READS.get(layout, ())}
        assert ours == {"tolist at lightning_ultrascale/core/agreement.py": steps}


def _count_fabric_control() -> dict[str, dict[str, int]]:
    # A Fabric loop on ZeRO-1 dp2 with ignored labels: the token weighting's count is its control traffic.
    fabric = L.Fabric(strategy=FabricStrategy(ZeRO(stage=1)), accelerator="cpu", devices=2)
    fabric.launch()
    model = build_model("llama_tiny", seed=0)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=SGD.lr))
    data = UltraScaleDataModule(seq_len=64, micro_batch_size=2, mask_eos_loss=True)
    data.setup("fit")
    dp = fabric.strategy.distributed_sampler_kwargs
    sampler = DataParallelSampler(data.train_dataset, 2, dp["num_replicas"], dp["rank"], seed=0)
    batches = iter(fabric.setup_dataloaders(ResumableDataLoader(data.train_dataset, sampler)))
    counter = HostSyncCounter()
    for step in range(5):
        if step == 1:
            counter.__enter__()
        batch = next(batches)
        fabric.backward(model(batch["input_ids"], labels=batch["labels"]))
        optimizer.step()
        optimizer.zero_grad()
        if step == 4:
            counter.__exit__(None, None, None)
    return {"reads": dict(counter.counts), "collectives": dict(counter.collectives)}


def test_a_healthy_fabric_step_has_one_control_collective_and_no_host_read():
    # Fabric's strategy has no guard or preemption agreement: the token count is its one control
    # all-reduce, and it stays on the device (the scale factor is applied there).
    steps = 4
    for counts in run_workers(_count_fabric_control, 2):
        control: dict[str, int] = {}
        for key, n in counts["collectives"].items():
            op, site = key.split(" at ")
            if op.startswith(("allreduce", "broadcast")) and not site.startswith("lightning_ultrascale/parallel/"):
                control[_site(key)] = control.get(_site(key), 0) + n
        assert control == {"allreduce_ at lightning_ultrascale/utils/loss.py": steps}, counts
        assert not [k for k in counts["reads"] if "lightning_ultrascale/" in k and "/data/" not in k], counts
