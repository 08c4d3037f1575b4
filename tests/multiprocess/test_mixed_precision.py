"""Mixed precision as the playbook counts it: bf16 weights and gradients on the device, fp32 masters in the optimizer.

Under ``bf16-mixed`` ZeRO stages 0-2 keep bf16 parameters and the fp32 master copy in the
(sharded) optimizer state; ``reduce_dtype`` picks fp32 main gradients or bf16 buckets. These tests
check the bytes each rank holds part by part, the bytes on the wire, parity with one process of
the same precision (and that the comparison fails without master weights), and checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import lightning as L
import pytest
import torch
from llama_runs import GLOBAL_BATCH, SEQ_LEN, SaveCheckpoint, run_tiny_llama
from torch.distributed.tensor import DTensor

from lightning_ultrascale import (
    ContextParallel,
    ExpertParallel,
    FP8Precision,
    LlamaConfig,
    LlamaModule,
    OptimConfig,
    PipelineParallel,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.core.agreement import SUMS
from lightning_ultrascale.models import get_model_config
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import QUIET_TRAINER, ParityRecorder, RunRecord, relative_error
from lightning_ultrascale.testing.tracing import StepStateAndTraffic
from lightning_ultrascale.utils.memory import layout_model_state_bytes

# Plain SGD with a small learning rate: most updates (lr x gradient ~ 1e-5..1e-4) are below half a
# bf16 rounding step of the weights (~0.02: 6e-5), so a run without fp32 masters loses them.
SGD_SMALL = OptimConfig(name="sgd", lr=0.01, weight_decay=0.0, warmup_steps=0, min_lr_ratio=1.0)
ADAMW = OptimConfig(name="adamw", lr=1e-3, warmup_steps=0)
STEPS = 4

# Bounds against a one-process bf16-mixed run, 4 SGD steps. bf16 keeps 8 mantissa bits (unit
# roundoff u = 2^-8 = 3.9e-3); another batch split rounds each bf16 matmul differently. Worst
# measured over the layouts below: losses 1.4e-5 (the loss averages 512 token losses), gradients
# 8.5e-3 at the first step and 1.0e-2 later (dense; MoE routing flips a token's expert and later
# gradients reach 9e-2: not compared), fp32 masters 1.2e-4, their update (final - initial) 2.8e-2
# (ep2; dense 1.0e-2). Bounds are 5x or more over those; a run without masters (bf16-true) is at
# 2.5e-4 (losses), 3.7e-3 (weights: its own rounding) and 1.0 (updates: lost).
LOSS_RTOL, GRAD_RTOL, MASTER_RTOL, UPDATE_RTOL = 1e-4, 5e-2, 6e-4, 0.15

LAYOUTS = {  # model, world size, data-parallel ranks, plugins
    "zero0-dp2": ("llama_tiny", 2, None, lambda: [ZeRO(0, bucket_mb=0.1)]),
    "zero1-dp2": ("llama_tiny", 2, None, lambda: [ZeRO(1, bucket_mb=0.1)]),
    "zero2-dp2": ("llama_tiny", 2, None, lambda: [ZeRO(2, bucket_mb=0.1)]),
    "zero2-dp2-bf16-reduce": ("llama_tiny", 2, None, lambda: [ZeRO(2, bucket_mb=0.1, reduce_dtype="bf16")]),
    "zero3-dp2": ("llama_tiny", 2, None, lambda: [ZeRO(3)]),
    "zero1-tp2": ("llama_tiny", 2, 1, lambda: [TensorParallel(2), ZeRO(1)]),
    # What a schedule changes for the fp32 main gradients: how many stages a rank holds, and whether
    # backward is split into input and weight parts. afab and looped_bfs hold and run stages as
    # 1f1b and interleaved_1f1b do, in another order (sums into the main gradients do not depend on it).
    **{
        f"zero1-pp2-{name}": ("llama_tiny", 2, 1, lambda name=name: [PipelineParallel(2, name), ZeRO(1)])
        for name in ("1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
    },
    "zero0-tp2-pp2": ("llama_tiny", 4, 1, lambda: [TensorParallel(2), PipelineParallel(2, "1f1b"), ZeRO(0)]),
    "zero1-cp2": ("llama_tiny", 2, 1, lambda: [ContextParallel(2), ZeRO(1)]),
    "zero1-ep2": ("moe_tiny", 2, None, lambda: [ExpertParallel(2), ZeRO(1)]),
}


def _updates(run: RunRecord) -> dict[str, torch.Tensor]:
    return {n: run.params[n].float() - run.initial[n].float() for n in run.params}


def _worst(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(relative_error(got[n].float(), ref[n].float()) for n in ref)


def assert_mixed_parity(run: RunRecord, ref: RunRecord, later_grads: bool = True) -> None:
    """Losses, gradients, fp32 masters and their updates within the bf16 bounds above."""
    losses = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True))
    assert losses <= LOSS_RTOL, f"losses {run.losses} vs {ref.losses}: {losses:.2e} > {LOSS_RTOL}"
    assert _worst(run.grads[0], ref.grads[0]) <= GRAD_RTOL, "first-step gradients"
    if later_grads:
        assert max(_worst(g, r) for g, r in zip(run.grads[1:], ref.grads[1:])) <= GRAD_RTOL, "later gradients"
    assert (masters := _worst(run.params, ref.params)) <= MASTER_RTOL, f"fp32 masters {masters:.2e}"
    assert (updates := _worst(_updates(run), _updates(ref))) <= UPDATE_RTOL, f"updates {updates:.2e}"


_REFERENCES: dict[tuple[str | LlamaConfig, float | None], RunRecord] = {}


def _reference(model: str | LlamaConfig, gradient_clip_val: float | None = None) -> RunRecord:
    """One process of the same precision: our strategy on one rank (bf16 weights, fp32 masters)."""
    if (model, gradient_clip_val) not in _REFERENCES:
        _REFERENCES[model, gradient_clip_val] = run_tiny_llama(
            SGD_SMALL, lambda: [ZeRO(0)], steps=STEPS, model=model, precision="bf16-mixed",
            gradient_clip_val=gradient_clip_val,
        )  # fmt: skip
    return _REFERENCES[model, gradient_clip_val]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_mixed_layouts_match_one_process_bf16_mixed(layout):
    model, world_size, dp, plugins = LAYOUTS[layout]
    run = run_tiny_llama(SGD_SMALL, plugins, world_size, steps=STEPS, dp=dp, model=model, precision="bf16-mixed")
    assert_mixed_parity(run, _reference(model), later_grads=model == "llama_tiny")


@pytest.mark.parametrize(
    ("stage", "reduce_dtype", "ep"), [(0, "fp32", 1), (1, "fp32", 1), (2, "fp32", 1), (2, "bf16", 1), (2, "bf16", 2)]
)
def test_micro_steps_accumulate_in_the_main_gradients(stage, reduce_dtype, ep):
    # Two micro-steps per step: fp32 main gradients (or bf16 buckets) accumulate the first
    # micro-step's gradient under no_sync and reduce the sum once; experts in their own group.
    model = "moe_tiny" if ep > 1 else "llama_tiny"
    plugins = lambda: [ZeRO(stage, reduce_dtype=reduce_dtype), *([ExpertParallel(ep)] if ep > 1 else [])]  # noqa: E731
    run = run_tiny_llama(SGD_SMALL, plugins, 2, accumulate=2, steps=STEPS, model=model, precision="bf16-mixed")
    assert_mixed_parity(run, _reference(model), later_grads=ep == 1)


TIED = dataclasses.replace(get_model_config("llama_tiny"), name="llama_tiny_tied", tie_embeddings=True)


TIED_LAYOUTS = {
    f"zero{stage}-pp2-tied": (TIED, 2, 1, lambda stage=stage: [PipelineParallel(2, "1f1b"), ZeRO(stage)])
    for stage in (0, 1)
}


@pytest.mark.parametrize("layout", ["zero0-dp2", "zero1-tp2", "zero0-tp2-pp2", *TIED_LAYOUTS])
def test_gradient_clipping_clips_the_masters_gradients(layout):
    # Lightning clips what the optimizer steps: the masters' fp32 gradients (sharded or not). A
    # weight tied across pipeline stages sums its two copies' fp32 main gradients, and is counted once.
    model, world_size, dp, plugins = {**LAYOUTS, **TIED_LAYOUTS}[layout]
    run = run_tiny_llama(
        SGD_SMALL, plugins, world_size, steps=STEPS, dp=dp, model=model, gradient_clip_val=0.05, precision="bf16-mixed"
    )
    assert_mixed_parity(run, _reference(model, gradient_clip_val=0.05))
    # The clip did act: far from the unclipped trajectory (one process's: each layout's own
    # unclipped run matches it within UPDATE_RTOL, test_bf16_mixed_layouts_match_one_process_bf16_mixed).
    assert _worst(_updates(_reference(model)), _updates(run)) > 10 * UPDATE_RTOL


@pytest.mark.parametrize("world_size", [1, 2])
def test_without_master_weights_the_comparison_fails(world_size):
    # The negative control: bf16-true keeps no fp32 copy, so updates below a weight's rounding
    # step are lost: the same comparison must fail, on one process and on ZeRO-1 dp2.
    run = run_tiny_llama(SGD_SMALL, lambda: [ZeRO(1 if world_size > 1 else 0)], world_size, steps=STEPS,
                         precision="bf16-true")  # fmt: skip
    with pytest.raises(AssertionError):
        assert_mixed_parity(run, _reference("llama_tiny"))
    assert _worst(_updates(run), _updates(_reference("llama_tiny"))) > 3 * UPDATE_RTOL


def _fp8() -> FP8Precision:
    return FP8Precision("tensorwise", "bf16-mixed")


@pytest.fixture(scope="module")
def reference_fp8() -> RunRecord:
    return run_tiny_llama(SGD_SMALL, lambda: [ZeRO(0)], 1, steps=3, model="llama_small", accumulate=2,
                          precision_plugin=_fp8())  # fmt: skip


@pytest.mark.parametrize("stage", [1, 2])
def test_fp8_linears_train_from_bf16_weights_and_fp32_masters(reference_fp8, stage):
    # FP8 on the bf16-mixed base: the blocks' linears quantise the bf16 weights, the masters stay
    # fp32. Each rank's 4 sequences are the reference's micro-steps (the same dynamic scales), and
    # the fp32 main gradients sum them alike: equal to one process.
    run = run_tiny_llama(SGD_SMALL, lambda: [ZeRO(stage)], 2, steps=3, model="llama_small", precision_plugin=_fp8())
    assert run.losses == pytest.approx(reference_fp8.losses, rel=1e-6)
    assert _worst(run.params, reference_fp8.params) <= 1e-6
    assert {t.dtype for t in run.params.values()} == {torch.float32}  # the masters


# --------------------------------------------------------------------------- bytes held and moved
@functools.cache
def _measured(stage: int, reduce_dtype: str, tp: int, pp: int, world: int) -> dict[str, Any]:
    """:func:`_measure` on ``world`` ranks, once per layout: both tests below read the same runs."""
    return run_pooled(_measure, world, stage, reduce_dtype, tp, pp, world)[0]


def _measure(stage: int, reduce_dtype: str, tp: int, pp: int, world: int) -> dict[str, Any]:
    measure = StepStateAndTraffic()
    plugins = [ZeRO(stage=stage, reduce_dtype=reduce_dtype)]
    plugins += [TensorParallel(tp)] if tp > 1 else []
    plugins += [PipelineParallel(pp, "1f1b")] if pp > 1 else []
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=UltraScaleStrategy(*plugins), precision="bf16-mixed",
        max_steps=2, callbacks=[measure], **QUIET_TRAINER,
    )  # fmt: skip
    module = LlamaModule("llama_tiny", optim=ADAMW)
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=32, micro_batch_size=2))
    assert measure.tracer is not None and measure.state is not None
    # This rank's parameters before ZeRO-3 splits them: tensor- and pipeline-parallel pieces.
    local = sum((p.to_local() if isinstance(p, DTensor) and stage < 3 else p).numel() for p in module.parameters())
    traffic = {op: measure.tracer.total(op=op) for op in ("all_reduce", "reduce_scatter", "all_gather")}
    dtypes = {p.dtype for p in module.parameters()}
    state = (measure.state.params, measure.state.grads, measure.state.optimizer_states)
    return {"state": state, "local": local, "traffic": traffic, "dtypes": dtypes}


@pytest.mark.parametrize(
    ("stage", "reduce_dtype", "tp", "pp", "world"),
    [
        (0, "fp32", 1, 1, 2), (1, "fp32", 1, 1, 2), (2, "fp32", 1, 1, 2), (3, "fp32", 1, 1, 2),
        (0, "bf16", 1, 1, 2), (1, "bf16", 1, 1, 2), (2, "bf16", 1, 1, 2),
        (1, "fp32", 2, 1, 4), (2, "bf16", 1, 2, 4),
    ],
)  # fmt: skip
def test_model_state_is_the_formula_part_by_part(stage, reduce_dtype, tp, pp, world):
    r = _measured(stage, reduce_dtype, tp, pp, world)
    dp = world // (tp * pp)
    formula = layout_model_state_bytes(r["local"], stage, dp, "bf16-mixed", reduce_dtype)
    for part, measured, expected in zip(("params", "grads", "optimizer"), r["state"], formula.__dict__.values()):
        assert abs(measured / expected - 1) <= 0.02, f"{part}: measured {measured} B, formula {expected} B"
    assert r["dtypes"] == ({torch.float32} if stage == 3 else {torch.bfloat16})


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(("reduce_dtype", "grad_bytes"), [("fp32", 4), ("bf16", 2)])
def test_zero12_moves_bf16_weights_and_gradients_in_the_reduce_dtype(stage, reduce_dtype, grad_bytes):
    r = _measured(stage, reduce_dtype, 1, 1, 2)
    psi, traffic = r["local"], r["traffic"]
    # The step's one control all-reduce (core/agreement.py) is not ZeRO's: a float64 row per rank of the
    # guard's status, the stop flag, the two token counts and the logged loss's two sums.
    assert traffic["all_reduce"] <= 2 * (SUMS + 2) * 8
    # One reduce-scatter of every gradient and one all-gather of every (bf16) weight per step;
    # flat buckets are padded to a multiple of N=2: at most one element each.
    assert psi * grad_bytes <= traffic["reduce_scatter"] <= (psi + 8) * grad_bytes
    assert psi * 2 <= traffic["all_gather"] <= (psi + 8) * 2


# --------------------------------------------------------------------------- checkpoints
def _fit(
    plugins: list[Any],
    precision: str,
    world: int,
    steps: int,
    save: str | None,
    save_at: int,
    ckpt: str | None,
    distributed: bool = True,
) -> RunRecord:
    L.seed_everything(0, verbose=False)
    recorder = ParityRecorder()
    callbacks: list[L.Callback] = [recorder] + ([SaveCheckpoint(save, step=save_at, stop=True)] if save else [])
    strategy = UltraScaleStrategy(*plugins, save_distributed_checkpoint=distributed)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, precision=precision,
        max_steps=steps, callbacks=callbacks, **QUIET_TRAINER,
    )  # fmt: skip
    data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // world, seed=0)
    trainer.fit(LlamaModule("llama_tiny", optim=ADAMW), datamodule=data, ckpt_path=ckpt)
    return recorder.record


def test_bf16_checkpoint_holds_the_masters_and_resumes_exactly(tmp_path):
    path = str(tmp_path / "ckpt")
    whole = run_pooled(_fit, 2, [ZeRO(1, bucket_mb=0.1)], "bf16-mixed", 2, STEPS, None, 0, None)[0]
    first = run_pooled(_fit, 2, [ZeRO(1, bucket_mb=0.1)], "bf16-mixed", 2, STEPS, path, 2, None)[0]
    # Another bucket size: other shards, the same per-parameter checkpoint.
    resumed = run_pooled(_fit, 2, [ZeRO(1, bucket_mb=0.05)], "bf16-mixed", 2, STEPS, None, 0, path)[0]
    assert first.losses + resumed.losses == whole.losses
    assert resumed.initial.keys() == first.params.keys()
    assert all(torch.equal(resumed.initial[n], first.params[n]) for n in first.params), "masters restored exactly"
    assert all(torch.equal(resumed.params[n], whole.params[n]) for n in whole.params)


@pytest.mark.parametrize(
    ("save_layout", "load_layout"),
    [("zero1-dp2", "zero0-1"), ("zero2-dp2", "zero1-tp2"), ("zero0-1", "zero2-dp2")],
)
def test_bf16_checkpoint_loads_in_another_layout(tmp_path, save_layout, load_layout):
    layouts = {
        "zero1-dp2": (lambda: [ZeRO(1)], 2), "zero2-dp2": (lambda: [ZeRO(2)], 2), "zero0-1": (lambda: [ZeRO(0)], 1),
        "zero1-tp2": (lambda: [TensorParallel(2), ZeRO(1)], 2),
    }  # fmt: skip
    path = str(tmp_path / "ckpt")
    (save, world), (load, load_world) = layouts[save_layout], layouts[load_layout]
    # One step before the save (the masters already off the bf16 grid), one after the load.
    first = run_pooled(_fit, world, save(), "bf16-mixed", world, 2, path, 1, None)[0]
    resumed = run_pooled(_fit, load_world, load(), "bf16-mixed", load_world, 2, None, 0, path)[0]
    # Loading moves no value: the masters the run starts from are the saved ones, bit for bit.
    assert all(torch.equal(resumed.initial[n], first.params[n]) for n in first.params)
    assert len(resumed.losses) == 1


def test_fp32_and_bf16_checkpoints_load_into_each_other(tmp_path):
    to_bf16, to_fp32 = str(tmp_path / "fp32.ckpt"), str(tmp_path / "bf16.ckpt")
    fp32 = run_pooled(_fit, 2, [ZeRO(1)], "32-true", 2, 3, to_bf16, 1, None)[0]
    bf16 = run_pooled(_fit, 2, [ZeRO(2)], "bf16-mixed", 2, 3, to_fp32, 2, to_bf16)[0]
    back = run_pooled(_fit, 1, [ZeRO(0)], "32-true", 1, 3, None, 0, to_fp32)[0]
    # fp32 weights become the masters exactly, and the masters the fp32 weights.
    assert all(torch.equal(bf16.initial[n], fp32.params[n]) for n in fp32.params)
    assert all(torch.equal(back.initial[n], bf16.params[n]) for n in bf16.params)
    assert {t.dtype for t in bf16.initial.values()} == {torch.float32}


def test_single_file_checkpoint_holds_the_masters(tmp_path):
    # save_distributed_checkpoint=False (one torch.save file) at ZeRO-0: the masters, whole.
    path = str(tmp_path / "ckpt.pt")
    first = run_pooled(_fit, 1, [ZeRO(0)], "bf16-mixed", 1, 2, path, 1, None, False)[0]
    resumed = run_pooled(_fit, 1, [ZeRO(0)], "bf16-mixed", 1, 2, None, 0, path, False)[0]
    assert all(torch.equal(resumed.initial[n], first.params[n]) for n in first.params)
    assert {t.dtype for t in torch.load(path, weights_only=False)["state_dict"].values()} == {torch.float32}


def _fit_twice(stage: int) -> tuple[RunRecord, RunRecord]:
    L.seed_everything(0, verbose=False)
    first, second = ParityRecorder(), ParityRecorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=UltraScaleStrategy(ZeRO(stage)), precision="bf16-mixed", max_steps=2,
        callbacks=[first], **QUIET_TRAINER,
    )  # fmt: skip
    module = LlamaModule("llama_tiny", optim=ADAMW)
    data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // 2, seed=0)
    trainer.fit(module, datamodule=data)
    trainer.callbacks[trainer.callbacks.index(first)] = second
    trainer.fit_loop.epoch_loop.max_steps = 3
    trainer.fit(module, datamodule=data)
    return first.record, second.record


@pytest.mark.parametrize("stage", [0, 1])
def test_a_second_fit_starts_from_the_masters_not_the_bf16_weights(stage):
    # A second setup rebuilds the engines: ZeRO-1 gathers its master slices back first.
    first, second = run_pooled(_fit_twice, 2, stage)[0]
    assert all(torch.equal(second.initial[n], first.params[n]) for n in first.params)
    assert len(second.losses) == 1
