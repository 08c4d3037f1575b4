"""FP8Precision in training: layouts against one process with the same quantisation, FP8 all-gather, errors.

Which single-process run is "the same quantisation" depends on the recipe. Dynamic scales are
taken over what one forward sees: tensorwise's activation scale over a rank's micro-batch, so a
data-parallel or pipelined layout equals the one-process run with the same micro-batches
(gradient accumulation), not the one that sees the whole batch at once (those two differ by
2e-4 in loss). Blockwise's groups are 1 x 128 tiles per token and 128-token tiles along the
tokens, whole sequences' worth here, so any split into micro-batches or tensor-parallel shards
that keeps 128-aligned groups quantises exactly as one process does.

How tight: FP8 amplifies rounding noise. A 1e-7 relative change of the weights (fp32 summation
order) moves some values across an E4M3 rounding step (6% apart), which moves the next layer's
inputs by ~1e-4, which flips more: measured on llama_small, one process against itself with
weights perturbed by 1e-7, FP8 gradients of the attention projections differ by 3% (fp32: 1e-6).
So:
- layouts that do the same arithmetic as the reference (dp, ZeRO-3, pipeline) equal it: measured
  bit for bit; bound 1e-5 (losses, first-step gradients);
- layouts that sum in another order (TP's partial sums, CP's ring attention) are checked where
  FP8 cannot amplify yet, the first forward: loss within 2e-4 (measured 2.5e-7 tp, 1.9e-5 cp); and
  over three steps losses within 2.5e-3 (measured 2.4e-4 tp, 2.4e-4 cp) and gradients within
  0.5 (measured 0.09 tp, 0.09 cp). A real fault is larger: a linear quantised on one side only
  (a plan that differs under tp) measured loss 5.9e-3 and gradients 0.66; a missing reduction of
  the input gradient under TP measured gradients 0.69.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from llama_runs import SGD, SaveCheckpoint, run_tiny_llama

from lightning_ultrascale import (
    ConfigError,
    ContextParallel,
    FP8Precision,
    LlamaModule,
    PipelineParallel,
    Recompute,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import (
    QUIET_TRAINER,
    ParityRecorder,
    RunRecord,
    assert_parity,
    relative_error,
)
from lightning_ultrascale.testing.tracing import StepCommTracer

MODEL = "llama_small"
STEPS = 3


def _run(recipe: str, base: str, plugins: Any = None, world_size: int = 1, **kwargs: Any) -> RunRecord:
    return run_tiny_llama(
        SGD, plugins, world_size, steps=STEPS, model=MODEL, precision_plugin=FP8Precision(recipe, base), **kwargs
    )


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, int], RunRecord]:
    """One-process FP8 runs: (recipe, micro-batches per step)."""
    return {
        ("tensorwise", 2): _run("tensorwise", "32-true", accumulate=2),
        ("blockwise", 1): _run("blockwise", "32-true"),
    }


@pytest.mark.parametrize(
    ("recipe", "plugins", "kwargs"),
    [
        # dp2 ZeRO-3 with the FP8 all-gather: test_full_recomputation_recomputes_the_same_fp8_forward,
        # which adds recomputation (a second gather of every unit in backward) to that layout.
        ("tensorwise", lambda: [PipelineParallel(2, schedule="1f1b", microbatches=2)], {"dp": 1}),
    ],
    ids=["pp2-1f1b"],
)
def test_layouts_with_the_same_arithmetic_equal_one_process(references, recipe, plugins, kwargs):
    run = _run(recipe, "32-true", plugins, 2, **kwargs)
    # Each rank's (or microbatch's) 4 sequences are the reference's micro-steps: same scales.
    assert_parity(run, references[(recipe, 2)], rtol=1e-5, later_grad_rtol=1e-5, param_rtol=1e-5)


def test_full_recomputation_recomputes_the_same_fp8_forward(references):
    # The recomputed forward sees the same inputs, so it takes the same dynamic scales; under ZeRO-3
    # it gathers the FP8 weights again, and each rank's 4 sequences are the reference's micro-steps.
    run = _run("tensorwise", "32-true", lambda: [ZeRO(stage=3), Recompute("full")], 2)
    assert_parity(run, references[("tensorwise", 2)], rtol=1e-5, later_grad_rtol=1e-5, param_rtol=1e-5)


class _ParamsAtStart(L.Callback):
    """The parameters a run starts from (after Lightning restored a checkpoint into them)."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        recorder = ParityRecorder()
        recorder.on_train_end(trainer, module)  # the full (unsharded) parameters, on every rank
        self.params = recorder.record.params


def _zero3_fit(fp8: bool, max_steps: int, ckpt_path: str | None = None, save_to: str | None = None) -> Any:
    """ZeRO-3 on 2 ranks, FP8 tensorwise (weights wrapped for the FP8 all-gather) or fp32: (start, end) parameters."""
    L.seed_everything(0, verbose=False)
    start, end = _ParamsAtStart(), ParityRecorder()
    callbacks = [start, end] + ([SaveCheckpoint(save_to, step=max_steps, stop=True)] if save_to else [])
    precision = {"plugins": [FP8Precision("tensorwise", "32-true")]} if fp8 else {"precision": "32-true"}
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=UltraScaleStrategy(ZeRO(stage=3)), max_steps=max_steps,
        callbacks=callbacks, **precision, **QUIET_TRAINER,
    )  # fmt: skip
    data = UltraScaleDataModule(seq_len=32, micro_batch_size=2, seed=0)
    trainer.fit(LlamaModule(MODEL, optim=SGD), datamodule=data, ckpt_path=ckpt_path)
    return start.params, end.record.params


def test_a_checkpoint_loads_across_fp8_and_high_precision_runs(tmp_path):
    # Both directions in one chain: FP8 saves at step 2, fp32 resumes from it and saves at step 3,
    # FP8 resumes from that.
    fp8_path, fp32_path = str(tmp_path / "fp8-step2.ckpt"), str(tmp_path / "fp32-step3.ckpt")
    _, fp8_saved = run_pooled(_zero3_fit, 2, True, 2, None, fp8_path)[0]
    fp32_loaded, fp32_saved = run_pooled(_zero3_fit, 2, False, 3, fp8_path, fp32_path)[0]
    fp8_loaded, _ = run_pooled(_zero3_fit, 2, True, 4, fp32_path)[0]
    # FP8 keeps fp32 master weights with their names and shapes: the checkpoint is the same kind.
    for saved, loaded in ((fp8_saved, fp32_loaded), (fp32_saved, fp8_loaded)):
        assert saved.keys() == loaded.keys()
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), name


@pytest.mark.parametrize(
    "plugins",
    [lambda: [TensorParallel(2, sequence_parallel=True)], lambda: [ContextParallel(2)]],
    ids=["tp2-sp", "cp2-zigzag"],
)
def test_layouts_that_sum_in_another_order_match_one_process_within_fp8_noise(references, plugins):
    ref = references[("blockwise", 1)]
    run = _run("blockwise", "32-true", plugins, 2, dp=1)
    first = abs(run.losses[0] - ref.losses[0]) / ref.losses[0]
    assert first < 2e-4, f"first forward's loss differs by {first:.2e}"
    losses = max(abs(a - b) / b for a, b in zip(run.losses, ref.losses))
    assert len(run.losses) == STEPS and losses < 2.5e-3, f"losses differ by {losses:.2e}"
    worst = max((relative_error(g[n], r[n]), n) for g, r in zip(run.grads, ref.grads) for n in r)
    assert worst[0] < 0.5, f"gradient of {worst[1]} differs by {worst[0]:.2e}"


def _zero3_traffic(fp8: bool) -> tuple[int, int, int]:
    """ZeRO-3 on 2 ranks for 2 steps; of the second: all-gather bytes, all-reduces (beyond the gradients'
    reduce-scatters), and the FP8 linears' parameter count."""
    trace = StepCommTracer()
    precision = {"plugins": [FP8Precision("tensorwise")]} if fp8 else {"precision": "bf16-mixed"}
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=UltraScaleStrategy(ZeRO(stage=3)), max_steps=2,
        callbacks=[trace], **precision, **QUIET_TRAINER,
    )  # fmt: skip
    module = LlamaModule(MODEL)
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=16, micro_batch_size=1))
    numel = 0
    if fp8:
        converted = trainer.precision_plugin.swap.conversion.converted
        numel = sum(module.model.get_submodule(n).weight.numel() for n in converted)
        weight = module.model.get_submodule(converted[0]).weight
        assert type(weight.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor"
    reductions = sum(r.op == "all_reduce" for r in trace.tracer.records)
    return trace.tracer.total("all_gather"), reductions, numel


@pytest.fixture(scope="module")
def zero3_traffic() -> dict[bool, tuple[int, int, int]]:
    """:func:`_zero3_traffic` of bf16 (False) and FP8 (True): one pair of runs for the two tests below."""
    return {fp8: run_pooled(_zero3_traffic, 2, fp8)[0] for fp8 in (False, True)}


def test_zero3_all_gathers_fp8_weights_in_half_of_bf16s_bytes(zero3_traffic):
    (bf16, _, _), (fp8, _, numel) = zero3_traffic[False], zero3_traffic[True]
    # Every unit is gathered twice per step (forward; backward after resharding). The 28 FP8
    # linears move 1 byte per parameter instead of 2; norms and the root unit stay bf16.
    assert numel == 4 * (4 * 256 * 256 + 3 * 256 * 768)
    assert fp8 == bf16 - 2 * numel
    linears_bf16, linears_fp8 = 2 * 2 * numel, 2 * 1 * numel
    assert linears_fp8 * 2 == linears_bf16 and bf16 - linears_bf16 == fp8 - linears_fp8


# ------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("fp4",), r"FP8Precision\(recipe='fp4'\) is unknown; valid: tensorwise, rowwise, rowwise_with_gw_hp, bl"),
        (("rowwise", "32-true"), r"precision='32-true'\) cannot carry FP8: the rowwise recipe .* valid: bf16-mixed"),
        (("tensorwise", "bf16-true"), r"keeps fp32 master weights .* valid: bf16-mixed, 32-true"),
    ],
)
def test_bad_recipes_and_precisions_name_the_option_and_the_valid_values(args, message):
    with pytest.raises(ConfigError, match=message):
        FP8Precision(*args)


def test_kernels_a_device_cannot_run_are_refused_with_the_fallback():
    with pytest.raises(ConfigError, match=r"emulate=False\) with the blockwise recipe.*emulated path"):
        FP8Precision("blockwise", emulate=False)


def test_a_model_without_suitable_linears_trains_high_precision_and_says_why(caplog):
    from lightning_ultrascale.models import build_model

    precision = FP8Precision("blockwise")
    model = build_model("llama_tiny", device="meta")
    with caplog.at_level("INFO"):
        precision.convert_module(model)
    conversion = precision.swap.conversion
    assert not conversion.converted and len(conversion.skipped) == 29
    assert "kept layers.0.attention.wq: in_features=64 and out_features=64 not a multiple of 128" in caplog.text
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_fp8_all_gathers_use_scales_precomputed_after_the_step(zero3_traffic):
    # torchao's precompute_float8_dynamic_scale_for_fsdp after each optimizer step: the next step's
    # FP8 all-gathers find every weight's scale, where each gather all-reduced its own amax.
    (_, bf16_reductions, _), (_, reductions, numel) = zero3_traffic[False], zero3_traffic[True]
    assert numel > 0 and reductions == bf16_reductions, (reductions, bf16_reductions)
