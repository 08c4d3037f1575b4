"""Tensor and sequence parallelism: parity with one process alone and composed with ZeRO."""

import dataclasses

import lightning as L
import pytest
from llama_runs import ADAMW, SGD, assert_adamw_parity, run_tiny_llama

from lightning_ultrascale import LlamaModule, Recompute, TensorParallel, UltraScaleDataModule, UltraScaleStrategy, ZeRO
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import get_model_config
from lightning_ultrascale.parallel.dims import DataShape
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import QUIET_TRAINER, assert_parity

# llama_tiny has 2 kv heads; tp=4 needs a variant with 4 (multi-head attention).
TINY_MHA = dataclasses.replace(get_model_config("llama_tiny"), n_kv_heads=4, name="llama_tiny_mha")


@pytest.fixture(scope="module")
def reference_sgd():
    return run_tiny_llama(SGD)


@pytest.fixture(scope="module")
def reference_sgd_mha():
    return run_tiny_llama(SGD, model=TINY_MHA)


@pytest.fixture(scope="module")
def reference_adamw():
    return run_tiny_llama(ADAMW)


@pytest.fixture(scope="module")
def reference_sgd_clipped():
    return run_tiny_llama(SGD, gradient_clip_val=0.05)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_matches_one_process(reference_sgd, sequence_parallel):
    run = run_tiny_llama(SGD, lambda: [TensorParallel(2, sequence_parallel=sequence_parallel)], 2, dp=1)
    assert_parity(run, reference_sgd, rtol=1e-5)


# tp4 with sequence parallelism: the same plan as tp2's, each rank holding one kv head; without
# it the plan is tp2's without the sequence-parallel parts (test_tp2_matches_one_process[False]).
def test_tp4_matches_one_process(reference_sgd_mha):
    run = run_tiny_llama(SGD, lambda: [TensorParallel(4)], 4, dp=1, model=TINY_MHA)
    assert_parity(run, reference_sgd_mha, rtol=1e-5)


# Sequence parallelism changes what the engines receive: its norms' gradients are Partial over tp
# (redistributed into the buckets of stages 0-2, which share that code, and handed to FSDP2 at
# stage 3). Without it the norms are plain tensors beside DTensors. Each stage runs once and each
# engine family (buckets: 0-2; FSDP2: 3) both ways; stages 1 and 3 with sequence parallelism and
# accumulation are test_gradient_clipping_uses_the_global_norm_counted_once's dp2xtp2 cells (SGD,
# 1e-5, gradients recorded before the clip).
@pytest.mark.parametrize(("stage", "sequence_parallel"), [(0, True), (2, True), (1, False), (3, False)])
def test_dp2_x_tp2_with_zero_matches_one_process(reference_sgd, stage, sequence_parallel):
    def plugins():
        return [TensorParallel(2, sequence_parallel=sequence_parallel), ZeRO(stage=stage, bucket_mb=0.1)]

    run = run_tiny_llama(SGD, plugins, 4, accumulate=2, dp=2)
    assert_parity(run, reference_sgd, rtol=1e-5)


def test_tp2_with_recomputation_and_accumulation_matches_one_process(reference_sgd):
    run = run_tiny_llama(SGD, lambda: [TensorParallel(2), Recompute("full")], 2, accumulate=2, dp=1)
    assert_parity(run, reference_sgd, rtol=1e-5)


# Adam's states on tensor-parallel shards are the same code at tp2 and tp4 (tp4 itself is proven
# with SGD in test_tp4_matches_one_process): tp2 alone and composed with each ZeRO engine family.
ADAMW_LAYOUTS = {
    "tp2-sp": (lambda: [TensorParallel(2)], 2, 1),
    "dp2xtp2-zero1": (lambda: [TensorParallel(2), ZeRO(stage=1, bucket_mb=0.1)], 4, 2),
    "dp2xtp2-zero3": (lambda: [TensorParallel(2), ZeRO(stage=3)], 4, 2),
}


@pytest.mark.parametrize("layout", list(ADAMW_LAYOUTS))
def test_tensor_parallel_layouts_match_one_process_with_adamw(reference_adamw, layout):
    plugins, world_size, dp = ADAMW_LAYOUTS[layout]
    run = run_tiny_llama(ADAMW, plugins, world_size, dp=dp)
    assert_adamw_parity(run, reference_adamw)


# Gradient clipping: a bound small enough to clip every step, so the global norm decides the update.
@pytest.mark.parametrize(
    ("layout", "plugins", "world_size", "dp", "accumulate"),
    [
        ("dp2", lambda: [ZeRO(stage=0)], 2, 2, 1),
        ("zero1", lambda: [ZeRO(stage=1, bucket_mb=0.1)], 2, 2, 1),
        ("zero3", lambda: [ZeRO(stage=3)], 2, 2, 1),
        ("tp2-no-sp", lambda: [TensorParallel(2, sequence_parallel=False)], 2, 1, 1),
        # With accumulation: these also stand for test_dp2_x_tp2_with_zero_matches_one_process's
        # stages 1 and 3 with sequence parallelism.
        ("dp2xtp2-zero1", lambda: [TensorParallel(2), ZeRO(stage=1, bucket_mb=0.1)], 4, 2, 2),
        ("dp2xtp2-zero3", lambda: [TensorParallel(2), ZeRO(stage=3)], 4, 2, 2),
    ],
)
def test_gradient_clipping_uses_the_global_norm_counted_once(
    reference_sgd_clipped, layout, plugins, world_size, dp, accumulate
):
    run = run_tiny_llama(SGD, plugins, world_size, accumulate, dp=dp, gradient_clip_val=0.05)
    assert_parity(run, reference_sgd_clipped, rtol=1e-5)


def test_gradient_clipping_by_value_clamps_the_reduced_gradients():
    # Sequence parallelism leaves the norm weights' gradients as partial sums over tp: torch's
    # clip_grad_value_ refused them (in-place clamp of a Partial DTensor); each is reduced first.
    clip = {"gradient_clip_val": 1e-3, "gradient_clip_algorithm": "value"}
    run = run_tiny_llama(SGD, lambda: [TensorParallel(2)], 2, dp=1, steps=3, **clip)
    assert_parity(run, run_tiny_llama(SGD, steps=3, **clip), rtol=1e-5)


def test_bad_tensor_parallel_settings_fail_at_construction():
    with pytest.raises(ConfigError, match=r"TensorParallel\(size=0\) must be a positive integer"):
        TensorParallel(0)
    with pytest.raises(
        ConfigError,
        match=r"DataModule\(seq_len=65\) must be divisible by TensorParallel\(size=2\) .* valid nearby: 64, 66",
    ):
        TensorParallel(2).validate_sequence(DataShape(65, 1))
    TensorParallel(2, sequence_parallel=False).validate_sequence(DataShape(65, 1))


ODD_VOCAB = dataclasses.replace(get_model_config("llama_tiny"), vocab_size=321, name="llama_tiny_vocab321")


@pytest.fixture(scope="module")
def reference_sgd_odd_vocab():
    return run_tiny_llama(SGD, model=ODD_VOCAB)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_vocab_not_divisible_by_tp_trains_like_one_process(reference_sgd_odd_vocab, sequence_parallel):
    # DTensor splits the 321 rows unevenly (161 + 160): no padded logits exist, so none can leak
    # into the softmax (the padding bug Megatron-LM #1754 describes).
    plugins = lambda: [TensorParallel(2, sequence_parallel=sequence_parallel)]  # noqa: E731
    run = run_tiny_llama(SGD, plugins, 2, dp=1, model=ODD_VOCAB)
    assert_parity(run, reference_sgd_odd_vocab, rtol=1e-5)


def test_hsdp_x_tp_on_a_3d_mesh_matches_one_process(reference_sgd):
    # dp_replicate=2 x dp_shard=1 x tp=2: the 3-D mesh on 4 processes (2x2x2 would need 8).
    run = run_tiny_llama(SGD, lambda: [TensorParallel(2), ZeRO(stage=3, replicate=2, size=1)], 4, accumulate=2, dp=2)
    assert_parity(run, reference_sgd, rtol=1e-5)


class _Placements(L.Callback):
    def __init__(self) -> None:
        self.mismatched: dict[str, tuple[str, str]] | None = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.mismatched is None:
            self.mismatched = {
                n: (str(p.placements), str(p.grad.placements))
                for n, p in pl_module.named_parameters()
                if p.grad is not None and p.grad.placements != p.placements
            }


def _gradient_placements() -> dict[str, tuple[str, str]] | None:
    look = _Placements()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=UltraScaleStrategy(TensorParallel(2)), max_steps=1,
        callbacks=[look], **QUIET_TRAINER,
    )  # fmt: skip
    trainer.fit(LlamaModule("llama_tiny", optim=ADAMW), datamodule=UltraScaleDataModule(seq_len=64, micro_batch_size=4))
    return look.mismatched


def test_the_optimizer_sees_each_gradient_in_its_parameter_s_placements():
    # DTensor hands sequence-parallel norms Partial gradients and the vocabulary-parallel embedding a
    # Replicate one; left so, AdamW's ops redistributed them again and again (31 all-reduces in a
    # llama_tiny tp2 step, 5 now; the optimizer phase 31.6 -> 7.6 ms here). The step settles them
    # once after the last backward (parallel/step.py's settle_gradients); parity is the tests above.
    for mismatched in run_pooled(_gradient_placements, 2):
        assert mismatched == {}, mismatched
