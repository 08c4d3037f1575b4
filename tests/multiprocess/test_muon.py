"""Muon under every layout: equal to one process, on whole matrices only, the work divided, resumable anywhere.

Muon's Newton-Schulz step needs each matrix whole; every layout here holds matrices in pieces
(flat ranges, FSDP2 shards, TP shards, expert shards, pipeline stages) or as replicas. Each runs 5
steps of llama_tiny (moe_tiny for expert parallelism) and is compared with one process.

Bounds: losses 1e-5 (measured worst 9.0e-8). Gradients and final parameters after 5 Muon steps
(fp32, lr 3e-3): measured worst 1.3e-6 (gradients) and 1.2e-6 (parameters) over the dense
layouts, 4.6e-6 and 3.5e-6 with expert parallelism (routing's reduction-order noise), so 1e-5 and
2.5e-5: more than 5x either. A matrix orthogonalised by its rows alone is off by 1e-1 or more.
"""

from collections import Counter
from pathlib import Path

import lightning as L
import pytest
from benchmark_scripts import load_benchmark
from llama_runs import GLOBAL_BATCH, SEQ_LEN, SaveCheckpoint, run_tiny_llama

from lightning_ultrascale import (
    ContextParallel,
    DataParallel,
    ExpertParallel,
    LlamaModule,
    OptimConfig,
    PipelineParallel,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import QUIET_TRAINER, ParityRecorder, RunRecord, assert_parity

MUON = OptimConfig(name="muon", lr=3e-3, momentum=0.95, warmup_steps=0)
STEPS = 5
DENSE_RTOL, MOE_RTOL = 1e-5, 2.5e-5


def _sp() -> TensorParallel:
    return TensorParallel(2, sequence_parallel=True)


#: name -> (plugins, world size, data-parallel size, model)
LAYOUTS = {
    "zero1": (lambda: [ZeRO(1, bucket_mb=0.1)], 2, 2, "llama_tiny"),
    "zero2-n4": (lambda: [ZeRO(2, bucket_mb=0.1)], 4, 4, "llama_tiny"),
    "zero3": (lambda: [ZeRO(3)], 2, 2, "llama_tiny"),
    "hsdp-2x2": (lambda: [ZeRO(3, replicate=2)], 4, 4, "llama_tiny"),
    "tp2-sp": (lambda: [_sp()], 2, 1, "llama_tiny"),
    "zero3xtp2-sp": (lambda: [ZeRO(3), _sp()], 4, 2, "llama_tiny"),
    "zero1xtp2-sp": (lambda: [ZeRO(1, bucket_mb=0.1), _sp()], 4, 2, "llama_tiny"),
    "pp2-1f1b": (lambda: [PipelineParallel(2, schedule="1f1b")], 2, 1, "llama_tiny"),
    "pp2-zbv": (lambda: [PipelineParallel(2, schedule="zbv")], 2, 1, "llama_tiny"),
    "dp2": (lambda: [DataParallel()], 2, 2, "llama_tiny"),
    "cp2-zigzag": (lambda: [ContextParallel(2, method="zigzag_ring")], 2, 1, "llama_tiny"),
    "ep2": (lambda: [ExpertParallel(2)], 2, 2, "moe_tiny"),
    "ep2xzero3": (lambda: [ExpertParallel(2), ZeRO(3)], 2, 2, "moe_tiny"),
}


@pytest.fixture(scope="module")
def references():
    return {model: run_tiny_llama(MUON, steps=STEPS, model=model) for model in ("llama_tiny", "moe_tiny")}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_muon_in_every_layout_equals_one_process_on_whole_matrices(references, layout):
    plugins, world_size, dp, model = LAYOUTS[layout]
    ref = references[model]
    run = run_tiny_llama(MUON, plugins, world_size, dp=dp, steps=STEPS, model=model)
    rtol = MOE_RTOL if model == "moe_tiny" else DENSE_RTOL
    assert_parity(run, ref, rtol=1e-5, grad_rtol=rtol, param_rtol=rtol)
    # Whole matrices only, each once: every rank orthogonalised matrices of the model's own shapes, and
    # over the ranks each matrix of each step once (a shard's rows would be a new shape or a count off;
    # a replica that repeated the work, a count off too).
    per_rank = [Counter(c) for c in run.orthogonalized]
    whole = Counter(ref.orthogonalized[0])
    assert all(set(c) <= set(whole) for c in per_rank), (per_rank, whole)
    assert sum(per_rank, Counter()) == whole, (per_rank, whole)
    assert all(per_rank), per_rank  # and every rank took a share


# ------------------------------------------------------------------------------------ checkpoints
SAVED_AT, RESUMED = 2, 4
RESUME = {  # saved under -> resumed under: flat ranges, FSDP2 x TP shards, stages and replicas, each way
    "zero1": ["zero3xtp2-sp", "pp2-1f1b"],
    "zero3xtp2-sp": ["zero1", "cp2-zigzag"],
}


def _fit(layout: str, ckpt_path: str | None = None, save_to: str | None = None) -> RunRecord:
    plugins, world_size, dp, model = LAYOUTS[layout]
    L.seed_everything(0, verbose=False)
    recorder = ParityRecorder()
    callbacks = [recorder] + ([SaveCheckpoint(save_to, step=SAVED_AT, stop=True)] if save_to else [])
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=UltraScaleStrategy(*plugins()), max_steps=RESUMED,
        callbacks=callbacks, **QUIET_TRAINER,
    )  # fmt: skip
    data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // dp, seed=0)
    trainer.fit(LlamaModule(model, optim=MUON), datamodule=data, ckpt_path=ckpt_path)
    return recorder.record


@pytest.mark.parametrize("source", RESUME)
def test_a_muon_checkpoint_resumes_in_another_layout_as_if_uninterrupted(tmp_path, source):
    # The momentum buffers go through the any-layout format: a lost or misplaced buffer changes the
    # first resumed step's update (Nesterov: g + 0.95 m) by the size of the update itself.
    run_pooled(_fit, LAYOUTS[source][1], source, None, str(tmp_path / source), timeout_s=300)
    uninterrupted = run_tiny_llama(MUON, steps=RESUMED)
    reference = RunRecord(uninterrupted.losses[SAVED_AT:], uninterrupted.grads[SAVED_AT:], uninterrupted.params)
    for target in RESUME[source]:
        run = run_pooled(_fit, LAYOUTS[target][1], target, str(Path(tmp_path) / source), timeout_s=300)[0]
        try:
            assert_parity(run, reference, rtol=1e-5, grad_rtol=DENSE_RTOL, param_rtol=DENSE_RTOL)
        except AssertionError as err:
            raise AssertionError(f"{source} -> {target}: {err}") from None


# ------------------------------------------------------------------------------------ the planner
@pytest.mark.parametrize(
    ("model", "layout", "precision"),
    [
        ("llama_tiny", {"dp": 2, "zero": 1}, "32-true"),
        ("llama_tiny", {"dp": 2, "zero": 2}, "bf16-mixed"),
        ("llama_tiny", {"dp": 2, "zero": 3}, "bf16-mixed"),
        ("llama_tiny", {"tp": 2, "zero": 0}, "32-true"),
        ("llama_tiny", {"pp": 2, "zero": 0}, "bf16-mixed"),
        ("moe_tiny", {"dp": 2, "ep": 2, "zero": 3}, "32-true"),
    ],
)
def test_the_planner_predicts_muons_model_state_within_2_percent(model, layout, precision):
    # Muon keeps one momentum for the blocks' matrices, AdamW two moments for the rest: the planner
    # prices each part (Workload(optimizer="muon")), here against what every rank holds after a step.
    row = load_benchmark("muon").compare_memory(model, layout, precision)
    assert row["max_error"] < 0.02, row
    assert row["predicted"][0]["optimizer"] < row["adamw_predicted_rank0"]["optimizer"]
