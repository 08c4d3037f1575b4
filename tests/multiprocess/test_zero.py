"""ZeRO stages 1-3 and HSDP: parity with one process, meta-device init, bad input."""

import ctypes
import dataclasses
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from llama_runs import ADAMW, SGD, assert_adamw_parity, run_tiny_llama

from lightning_ultrascale import LlamaModule, Recompute, UltraScaleDataModule, UltraScaleStrategy, ZeRO
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import build_model, get_model_config
from lightning_ultrascale.parallel.dims import ParallelDims
from lightning_ultrascale.testing import run_pooled, run_workers
from lightning_ultrascale.testing.parity import QUIET_TRAINER, assert_parity
from lightning_ultrascale.utils.comm import CommTracer


@pytest.fixture(scope="module")
def reference_sgd():
    return run_tiny_llama(SGD)


@pytest.fixture(scope="module")
def reference_adamw():
    return run_tiny_llama(ADAMW)


# Small buckets for stages 0-2: several reductions per backward, so ordering and overlap are exercised.
LAYOUTS = {
    "zero1-n2": (lambda: [ZeRO(stage=1, bucket_mb=0.1)], 2),
    "zero1-n4": (lambda: [ZeRO(stage=1, bucket_mb=0.1)], 4),
    "zero2-n2": (lambda: [ZeRO(stage=2, bucket_mb=0.1)], 2),
    "zero2-n4": (lambda: [ZeRO(stage=2, bucket_mb=0.1)], 4),
    "zero3-n2": (lambda: [ZeRO(stage=3)], 2),
    "zero3-n4": (lambda: [ZeRO(stage=3)], 4),
    "zero3-keep-gathered": (lambda: [ZeRO(stage=3, reshard_after_forward=False)], 2),
    "hsdp-2x2": (lambda: [ZeRO(stage=3, replicate=2)], 4),
}


# The world size sets the shard ranges; accumulation, when gradients are reduced: they do not
# interact, so each stage runs both world sizes and both accumulations once, not their product.
# Parameters kept gathered across micro-steps meet accumulation: that layout runs both ways. HSDP
# with accumulation runs in the AdamW and the recomputation tests below (SGD, 1e-5).
@pytest.mark.parametrize(
    ("layout", "accumulate"),
    [
        ("zero1-n2", 2), ("zero1-n4", 1), ("zero2-n2", 2), ("zero2-n4", 1), ("zero3-n2", 2), ("zero3-n4", 1),
        ("zero3-keep-gathered", 1), ("zero3-keep-gathered", 2), ("hsdp-2x2", 1),
    ],
)  # fmt: skip
def test_zero_stages_and_hsdp_match_one_process_with_sgd(reference_sgd, layout, accumulate):
    plugins, world_size = LAYOUTS[layout]
    assert_parity(run_tiny_llama(SGD, plugins, world_size, accumulate), reference_sgd, rtol=1e-5)


@pytest.mark.parametrize("layout", ["zero1-n2", "zero2-n4", "zero3-n2", "hsdp-2x2"])
def test_zero_stages_and_hsdp_match_one_process_with_adamw(reference_adamw, layout):
    plugins, world_size = LAYOUTS[layout]
    run = run_tiny_llama(ADAMW, plugins, world_size, accumulate=2)
    assert_adamw_parity(run, reference_adamw)


@pytest.mark.parametrize(
    ("stage", "replicate", "world_size", "recompute"),
    [(0, 1, 2, "full"), (1, 1, 2, "selective_op"), (2, 1, 2, "full"), (3, 1, 2, "selective_op"), (3, 2, 4, "full")],
)
def test_every_stage_with_activation_recomputation_matches_one_process(
    reference_sgd, stage, replicate, world_size, recompute
):
    def plugins():
        return [ZeRO(stage=stage, replicate=replicate, bucket_mb=0.1), Recompute(recompute)]

    assert_parity(run_tiny_llama(SGD, plugins, world_size, accumulate=2), reference_sgd, rtol=1e-5)


# --------------------------------------------------------------------------- meta-device init
MEDIUM = dataclasses.replace(
    get_model_config("llama_tiny"), name="medium", dim=512, n_layers=16, n_heads=8, n_kv_heads=4,
    ffn_hidden_dim=1536, vocab_size=32000,
)  # fmt: skip


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class _PeakAfterSetup(L.Callback):
    def __init__(self) -> None:
        # A forked worker inherits the parent's heap, freed blocks included, already resident: reusing
        # them would not grow RSS (earlier tests in the same pytest process made plain DP look like
        # 148 of 318 MiB). Hand every free page back first, so each byte the setup touches counts.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # reset this process's peak RSS (VmHWM)
        self.baseline = _rss_kib("VmRSS")
        self.growth_bytes = 0
        self.local_param_bytes = 0

    def on_fit_start(self, trainer, pl_module):
        self.growth_bytes = (_rss_kib("VmHWM") - self.baseline) * 1024
        self.local_param_bytes = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in pl_module.parameters()
        )


def _setup_peak(stage: int, world_size: int) -> tuple[int, int]:
    peak = _PeakAfterSetup()
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=UltraScaleStrategy(ZeRO(stage=stage)), max_steps=0,
        callbacks=[peak], **QUIET_TRAINER,
    )  # fmt: skip
    trainer.fit(LlamaModule(MEDIUM), datamodule=UltraScaleDataModule(seq_len=16, micro_batch_size=1))
    return peak.growth_bytes, peak.local_param_bytes


def test_zero3_on_meta_never_materialises_the_full_model_on_a_rank():
    full_bytes = MEDIUM.num_params() * 4
    zero3 = run_workers(_setup_peak, 4, 3, 4, timeout_s=300)
    # One process suffices for the control (every plain-DP rank holds the whole model). The test's
    # cost is initialisation: each element a Philox draw, so four DP ranks drew 4x ZeRO-3's work.
    dp = run_workers(_setup_peak, 1, 0, 1, timeout_s=300)
    for growth, local in zero3:
        assert local < full_bytes / 4 * 1.01
        # Each rank holds its quarter plus, while initialising, one full parameter at a time
        # (the largest is the 64 MiB embedding): far below the 318 MiB model.
        message = f"rank grew {growth / 2**20:.0f} MiB for a {full_bytes / 2**20:.0f} MiB model"
        assert growth < 0.75 * full_bytes, message
    # The same measurement sees plain DP materialise the whole model: it can tell the difference.
    # (RSS growth, so memory the process had already mapped and freed is not counted again: a CI
    # run measured 314.7 MiB of the 318; 0.9x stays far above ZeRO-3's 0.75x bound.)
    assert all(growth > 0.9 * full_bytes for growth, _ in dp), [g / 2**20 for g, _ in dp]


def _zero3_initial_weights() -> dict[str, torch.Tensor]:
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=UltraScaleStrategy(ZeRO(stage=3), seed=7), max_steps=0, **QUIET_TRAINER
    )
    module = LlamaModule("llama_tiny")
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=16, micro_batch_size=1))
    return {n: p.full_tensor() for n, p in module.model.named_parameters()}


def test_zero3_initialises_the_weights_of_a_single_process_build():
    sharded = run_pooled(_zero3_initial_weights, 2)[0]
    reference = dict(build_model("llama_tiny", seed=7).named_parameters())
    assert sharded.keys() == reference.keys()
    for name, value in sharded.items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0, msg=name)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 4}, r"ZeRO\(stage=4\) is not a ZeRO stage; valid: 0, 1, 2, 3"),
        ({"stage": 2, "bucket_mb": 0}, r"ZeRO\(bucket_mb=0\) must be > 0"),
        ({"stage": 1, "replicate": 2}, r"ZeRO\(replicate=2\) \(HSDP\) needs ZeRO\(stage=3\), got 1"),
        ({"stage": 3, "reduce_dtype": "fp16"}, r"ZeRO\(reduce_dtype='fp16'\); valid: fp32, bf16"),
    ],
)
def test_bad_zero_settings_fail_at_construction(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ZeRO(**kwargs)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_with_one_data_parallel_rank_warns(stage):
    spec = build_model("llama_tiny", device="meta").spec
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ZeRO(stage=stage).validate(ParallelDims(dp_shard=1), spec, None)
    assert any(f"ZeRO stage {stage} with one data-parallel rank shards nothing" in str(w.message) for w in caught)
    # Context-parallel ranks hold the same parameters and share the shards: nothing to warn about.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ZeRO(stage=stage).validate(ParallelDims(dp_shard=1, cp=2), spec, None)
    assert not [w for w in caught if "shards nothing" in str(w.message)]


# --------------------------------------------------------------------------- bf16
# Against a one-process run in the same precision. bf16 keeps 8 mantissa bits (unit roundoff
# 2^-8 = 3.9e-3). Measured over 5 SGD steps: losses within 3e-4 (the loss averages 512 token
# losses, which averages rounding out), first-step gradients within 8e-3 (a few roundings deep),
# later gradients up to 5e-2 as the layouts' bf16 weights drift apart by single roundings. An
# unreduced or wrongly scaled gradient is off by 0.5-1.0: these bounds still catch it.
BF16_LOSS_RTOL, BF16_FIRST_GRAD_RTOL, BF16_LATER_GRAD_RTOL = 1e-3, 2e-2, 1e-1


@pytest.fixture(scope="module")
def reference_bf16_mixed():
    return run_tiny_llama(SGD, precision="bf16-mixed")


@pytest.mark.parametrize("layout", ["dp-n2", "zero1-n2", "zero2-n2", "zero3-n2", "hsdp-2x2"])
def test_every_stage_in_bf16_mixed_matches_one_process_bf16_mixed(reference_bf16_mixed, layout):
    plugins, world_size = {**LAYOUTS, "dp-n2": (lambda: [ZeRO(stage=0, bucket_mb=0.1)], 2)}[layout]
    run = run_tiny_llama(SGD, plugins, world_size, accumulate=2, precision="bf16-mixed")
    assert_parity(
        run,
        reference_bf16_mixed,
        rtol=BF16_LOSS_RTOL,
        grad_rtol=BF16_FIRST_GRAD_RTOL,
        later_grad_rtol=BF16_LATER_GRAD_RTOL,
        check_params=False,
    )


def _reduction_dtypes(stage: int, precision: str, reduce_dtype: str) -> tuple[set[torch.dtype], int, int]:
    from lightning_ultrascale.utils.comm import CommTracer

    class Trace(L.Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            self.tracer = CommTracer().__enter__()

        def on_after_backward(self, trainer, pl_module):
            self.tracer.__exit__(None, None, None)

    trace = Trace()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=UltraScaleStrategy(ZeRO(stage=stage, reduce_dtype=reduce_dtype)),
        precision=precision, max_steps=1, callbacks=[trace], **QUIET_TRAINER,
    )  # fmt: skip
    module = LlamaModule("llama_tiny")
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=16, micro_batch_size=1))
    master_dtypes = {p.dtype for p in module.parameters()}
    reduction = "reduce_scatter" if stage == 3 else "all_reduce"
    n_params = sum(p.numel() for p in module.parameters())
    return master_dtypes, trace.tracer.total(op=reduction, kind="payload"), n_params


@pytest.mark.parametrize(
    ("stage", "precision", "master_dtype"),
    [
        (0, "bf16-mixed", torch.bfloat16),
        (3, "bf16-mixed", torch.float32),
        (0, "bf16-true", torch.bfloat16),
        (3, "bf16-true", torch.bfloat16),
    ],
)
@pytest.mark.parametrize(("reduce_dtype", "bytes_per_grad"), [("fp32", 4), ("bf16", 2)])
def test_gradients_are_reduced_in_the_chosen_dtype(stage, precision, master_dtype, reduce_dtype, bytes_per_grad):
    master_dtypes, reduced_bytes, n_params = run_pooled(_reduction_dtypes, 2, stage, precision, reduce_dtype)[0]
    # The parameters' dtype: bf16-mixed keeps bf16 weights at stage 0 (the fp32 masters are the
    # optimizer's) and FSDP2's sharded fp32 ones at stage 3 (gathered in bf16); bf16-true: bf16.
    assert master_dtypes == {master_dtype}
    # One reduction of every gradient per backward, in the chosen dtype (FSDP2 pads each
    # parameter's shard to a multiple of the group size: at most a few elements).
    assert n_params * bytes_per_grad <= reduced_bytes <= n_params * bytes_per_grad * 1.01


class _GradsAfterFirstMicroStep(L.Callback):
    """Each parameter's gradient after the first of two accumulation micro-steps: (local numel, full numel)."""

    def __init__(self) -> None:
        self.grads: dict[str, tuple[int, int] | None] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            for name, p in module.model.named_parameters():
                self.grads[name] = None if p.grad is None else (p.grad.to_local().numel(), p.numel())


def _accumulated_grads() -> dict[str, tuple[int, int] | None]:
    probe = _GradsAfterFirstMicroStep()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=UltraScaleStrategy(ZeRO(stage=3)), max_steps=1,
        accumulate_grad_batches=2, callbacks=[probe], **QUIET_TRAINER,
    )  # fmt: skip
    trainer.fit(LlamaModule("llama_tiny"), datamodule=UltraScaleDataModule(seq_len=16, micro_batch_size=1))
    return probe.grads


def test_zero3_accumulates_sharded_gradients_between_micro_steps():
    # Reduce-scattered on every micro-step: between micro-steps each rank holds its half of every
    # gradient (FSDP2's no-sync mode would hold the whole unsharded gradient instead, where
    # param.grad is still None). The planner counts ZeRO-3's gradients sharded for this reason.
    for grads in run_pooled(_accumulated_grads, 2):
        assert grads and all(g is not None for g in grads.values()), grads
        assert all(local <= -(-full // 2) for local, full in grads.values()), grads


def test_hsdp_under_a_pipeline_with_accumulation_matches_one_process(reference_sgd):
    # The replica all-reduce deferred to the last micro-step (FSDPEngine.no_sync) meets torch's pipeline stages,
    # which hold their own reduction to the last microbatch: pp2 x 2 replicas x 1 shard, 2 micro-steps.
    from lightning_ultrascale import PipelineParallel

    plugins = lambda: [PipelineParallel(2, "1f1b", microbatches=2), ZeRO(stage=3, replicate=2, size=1)]  # noqa: E731
    assert_parity(run_tiny_llama(SGD, plugins, 4, accumulate=2, dp=2), reference_sgd, rtol=1e-5)


class _TraceFirstStep(L.Callback):
    """Every collective launch of the first optimizer step (its micro-steps)."""

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if not hasattr(self, "tracer"):
            self.tracer = CommTracer(trainer.strategy.mesh.root).__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == 1 and not hasattr(self, "launches"):
            self.tracer.__exit__(None, None, None)
            self.launches = self.tracer.launches(min_bytes=256)


def _hsdp_launches(precision: str, reduce_dtype: str) -> dict[str, int]:
    probe = _TraceFirstStep()
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=UltraScaleStrategy(ZeRO(3, replicate=2, reduce_dtype=reduce_dtype)),
        max_steps=1, accumulate_grad_batches=2, callbacks=[probe], precision=precision, **QUIET_TRAINER,
    )  # fmt: skip
    trainer.fit(LlamaModule("llama_tiny"), datamodule=UltraScaleDataModule(seq_len=16, micro_batch_size=1))
    return probe.launches


@pytest.mark.parametrize(
    ("precision", "reduce_dtype", "micro_steps"), [("32-true", "fp32", 1), ("bf16-mixed", "bf16", 2)]
)
def test_hsdp_all_reduces_across_replicas_once_a_step_where_fp32_holds_the_sum(precision, reduce_dtype, micro_steps):
    # Each micro-step reduce-scatters inside its shard group; the all-reduce across the replicas waits for the
    # last one (FSDP2 holds the micro-steps' sums, set_requires_all_reduce), one per FSDP unit (4 blocks, the
    # root) a step. It all-reduced every micro-step before. Under a bf16 reduction FSDP2 would hold that sum in
    # bf16, so there it still all-reduces every micro-step. Parity: the HSDP tests above (accumulate=2).
    for launches in run_workers(_hsdp_launches, 4, precision, reduce_dtype, timeout_s=300):
        assert launches["dp_replicate:all_reduce"] == 5 * micro_steps, launches
        assert sum(n for key, n in launches.items() if key.endswith(":reduce_scatter")) == 5 * 2, launches


TIED = dataclasses.replace(get_model_config("llama_tiny"), name="llama_tiny_tied", tie_embeddings=True)


@pytest.fixture(scope="module")
def reference_tied_clipped():
    return run_tiny_llama(SGD, steps=2, model=TIED, gradient_clip_val=0.05)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_clipping_counts_a_weight_tied_across_pipeline_stages_once(reference_tied_clipped, stage):
    # The last stage's copy of a tied embedding is scaled but left out of the gradient norm; under
    # ZeRO-1/2 it lives in a flat shard, so it gets a bucket (a shard) of its own to leave out.
    # It was counted twice: parameters 1.3e-3 away after 2 steps.
    from lightning_ultrascale import PipelineParallel

    plugins = lambda: [PipelineParallel(2, "1f1b"), ZeRO(stage)]  # noqa: E731
    run = run_tiny_llama(SGD, plugins, 4, steps=2, dp=2, model=TIED, gradient_clip_val=0.05)
    assert_parity(run, reference_tied_clipped, rtol=1e-5)
