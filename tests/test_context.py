"""Context parallelism: ring / zig-zag / all-to-all attention kernels, load balance, parity, bad input."""

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from llama_runs import ADAMW, SGD, assert_adamw_parity, run_tiny_llama

from lightning_ultrascale import (
    ContextParallel,
    LlamaModule,
    PipelineParallel,
    Recompute,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import build_model
from lightning_ultrascale.parallel.context import attention as context_attention
from lightning_ultrascale.parallel.context.attention import (
    FlopCounter,
    local_positions,
    ring_attention,
    ring_blocks,
    ulysses_attention,
)
from lightning_ultrascale.parallel.dims import DataShape, ParallelDims
from lightning_ultrascale.testing import run_workers
from lightning_ultrascale.testing.parity import assert_parity, record_run, relative_error
from lightning_ultrascale.utils.loss import token_weight


# ------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_zigzag_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r(cp):
    seq = 2 * cp * 3
    parts = [local_positions("zigzag_ring", seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))  # every token exactly once
    for r, part in enumerate(parts):
        assert part.tolist() == [*range(3 * r, 3 * r + 3), *range(3 * (2 * cp - 1 - r), 3 * (2 * cp - r))]


def test_each_ring_step_costs_the_same_on_every_zigzag_rank():
    cp, local = 4, 8
    for step in range(cp):
        work = set()
        for rank in range(cp):
            blocks = ring_blocks("zigzag_ring", rank, (rank - step) % cp, local)
            pairs = sum(
                (b.q.stop - b.q.start) * (b.k.stop - b.k.start) // (2 if b.causal else 1) for b in blocks
            )
            work.add(pairs)
        assert work == {local * local // 2}


# ------------------------------------------------------------------------------------ kernels
def _full_attention(q, k, v):
    n = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(n, 1), v.repeat_interleave(n, 1), is_causal=True)


def kernel_errors(
    method: str, seq: int, heads: int, kv_heads: int, kernel: str = "reference", qk_dim: int = 8, v_dim: int = 8
) -> list[float]:
    """Output and dq/dk/dv relative errors of context-parallel attention against full causal attention."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, seq, qk_dim, generator=g)
    k, v = torch.randn(2, kv_heads, seq, qk_dim, generator=g), torch.randn(2, kv_heads, seq, v_dim, generator=g)
    dout = torch.randn(2, heads, seq, v_dim, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    _full_attention(*full).backward(dout)
    index = local_positions("ring" if method == "all_to_all" else method, seq, cp, rank)
    local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    if method == "all_to_all":
        out = ulysses_attention(*local, dist.group.WORLD)
    else:
        out = ring_attention(*local, dist.group.WORLD, method, kernel)
    out.backward(dout[:, :, index])
    expected = _full_attention(q, k, v)[:, :, index]
    errors = [relative_error(out.detach(), expected)]
    errors += [relative_error(part.grad, whole.grad[:, :, index]) for part, whole in zip(local, full)]
    return errors


@pytest.mark.parametrize("method", ["ring", "zigzag_ring", "all_to_all"])
@pytest.mark.parametrize("cp", [2, 4])
def test_attention_and_its_gradients_equal_full_causal_attention(method, cp):
    # GQA (8 query heads on 2 kv heads); 3 tokens per zig-zag chunk, so no chunk is a power of two.
    errors = run_workers(kernel_errors, cp, method, 2 * cp * 3, 8, 2)
    worst = max(max(e) for e in errors)
    assert worst < 1e-5, f"{method} cp={cp}: output/dq/dk/dv relative errors {errors}"


@pytest.mark.parametrize("method", ["ring", "zigzag_ring"])
def test_fused_sdpa_kernel_gives_the_same_ring_attention(method):
    errors = run_workers(kernel_errors, 2, method, 12, 8, 2, "sdpa")
    assert max(max(e) for e in errors) < 1e-5, errors


def _attention_pairs(method: str, seq: int) -> int:
    context_attention.FLOPS = FlopCounter()
    cp, rank = dist.get_world_size(), dist.get_rank()
    index = local_positions(method, seq, cp, rank)
    q = torch.randn(1, 2, seq, 8)[:, :, index]
    ring_attention(q, q, q, dist.group.WORLD, method)
    pairs = context_attention.FLOPS.pairs
    context_attention.FLOPS = None
    return pairs


def test_zigzag_balances_causal_flops_and_ring_does_not():
    zigzag = run_workers(_attention_pairs, 4, "zigzag_ring", 64)
    ring = run_workers(_attention_pairs, 4, "ring", 64)
    # Together they compute the causal triangle (with the diagonal) of 2 heads: 2 x 64 x 65 / 2.
    assert sum(zigzag) == sum(ring) == 2 * 64 * 65 // 2
    mean = sum(zigzag) / 4
    assert max(abs(x - mean) for x in zigzag) <= 0.01 * mean
    # Ring: rank r does its diagonal plus r full blocks; the last rank does 4.2x the first's work.
    assert ring == sorted(ring) and max(ring) / min(ring) > 4


# ------------------------------------------------------------------------------------ parity
@pytest.fixture(scope="module")
def reference_adamw():
    return run_tiny_llama(ADAMW, steps=3)


@pytest.fixture(scope="module")
def reference_sgd():
    return run_tiny_llama(SGD, steps=3)


@pytest.mark.parametrize("method", ["ring", "zigzag_ring", "all_to_all"])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_matches_one_process(reference_adamw, reference_sgd, method, cp):
    run = run_tiny_llama(SGD, lambda: [ContextParallel(cp, method)], cp, dp=1, steps=3)
    assert_parity(run, reference_sgd, rtol=1e-5)
    run = run_tiny_llama(ADAMW, lambda: [ContextParallel(cp, method)], cp, dp=1, steps=3)
    assert_adamw_parity(run, reference_adamw)


@pytest.mark.parametrize(
    ("name", "plugins", "world_size", "dp"),
    [
        ("cp2-tp2", lambda: [ContextParallel(2), TensorParallel(2)], 4, 1),
        ("cp2-dp2-zero3", lambda: [ContextParallel(2), ZeRO(stage=3)], 4, 2),
        ("cp2-pp2", lambda: [ContextParallel(2), PipelineParallel(2, "1f1b", 2)], 4, 1),
    ],
)
def test_context_parallel_compositions_match_one_process(reference_adamw, name, plugins, world_size, dp):
    run = run_tiny_llama(ADAMW, plugins, world_size, dp=dp, steps=3)
    assert_adamw_parity(run, reference_adamw)


def test_context_parallel_with_recomputation_and_ulysses_under_tp_match_one_process(reference_sgd):
    ref = reference_sgd
    run = run_tiny_llama(SGD, lambda: [ContextParallel(2), Recompute("full")], 2, dp=1, steps=3)
    assert_parity(run, ref, rtol=1e-5)
    # 4 heads / tp 2 = 2 heads per rank, scattered over cp = 2.
    plugins = lambda: [ContextParallel(2, "all_to_all"), TensorParallel(2)]  # noqa: E731
    run = run_tiny_llama(SGD, plugins, 4, dp=1, steps=3)
    assert_parity(run, ref, rtol=1e-5)


# ------------------------------------------------------------------------------------ bad input
def test_unknown_method_is_refused():
    with pytest.raises(ConfigError, match=r"ContextParallel\(method='striped'\) is unknown; valid: ring, zigzag_ring"):
        ContextParallel(2, "striped")


def test_sequence_not_divisible_by_twice_cp_is_refused_for_zigzag():
    spec, dims, data = build_model("llama_tiny", device="meta").spec, ParallelDims(cp=4), DataShape(60, 1)
    with pytest.raises(
        ConfigError, match=r"UltraScaleDataModule\(seq_len=60\) must be divisible by 8 .* \(2 x cp = 8 zig-zag chunks\)"
    ):
        ContextParallel(4, "zigzag_ring").validate(dims, spec, data)
    ContextParallel(4, "ring").validate(dims, spec, data)  # 4 contiguous parts: fine


def test_heads_not_divisible_by_cp_are_refused_for_all_to_all():
    spec = build_model("llama_tiny", device="meta").spec  # 4 heads
    with pytest.raises(ConfigError, match=r"n_heads / tp = 4 / 2 = 2; valid cp: 1, 2"):
        ContextParallel(4, "all_to_all").validate(ParallelDims(cp=4, tp=2), spec, None)
    assert not dist.is_initialized()


def test_trainer_refuses_a_bad_context_layout_before_any_process_group():
    from lightning_ultrascale import LlamaModule, UltraScaleStrategy
    from lightning_ultrascale.testing.parity import QUIET_TRAINER

    strategy = UltraScaleStrategy(ContextParallel(4, "all_to_all"), TensorParallel(2))
    trainer = L.Trainer(accelerator="cpu", devices=8, strategy=strategy, **QUIET_TRAINER)
    trainer.strategy._lightning_module = LlamaModule("llama_tiny")
    message = r"ContextParallel\(size=4\) with ContextParallel\(method='all_to_all'\) must divide"
    with pytest.raises(ConfigError, match=message):
        trainer.strategy.setup_environment()
    assert not dist.is_initialized()


def _weighted_losses() -> float:
    rank = dist.get_rank()
    # Rank 0 holds 8 labelled tokens with mean loss 1.0; rank 1 holds 2 (six ignored) with mean 4.0.
    labels = torch.zeros(1, 8, dtype=torch.long)
    if rank == 1:
        labels[0, 2:] = -100
    loss = torch.tensor(1.0 if rank == 0 else 4.0)
    scaled = loss * token_weight(labels, dist.group.WORLD)
    dist.all_reduce(scaled)
    return float(scaled) / 2  # what the gradient average over the ranks sees


def test_loss_is_weighted_by_each_ranks_labelled_tokens():
    averaged = run_workers(_weighted_losses, 2)[0]
    assert averaged == pytest.approx((8 * 1.0 + 2 * 4.0) / 10)  # the mean over all 10 tokens, not 2.5


class _IgnoringModule(LlamaModule):
    """Ignores labels as padding would: the tail of some samples, and scattered tokens.

    Ranks then hold unequal numbers of labelled tokens, under dp (other samples) and under
    zig-zag cp (the tail is chunk 3 on rank 0 and chunk 2 on rank 1).
    """

    def on_train_batch_start(self, batch, batch_idx):
        labels = batch["labels"]
        labels[labels % 4 == 0] = -100
        labels[labels[:, 0] % 2 == 0, 40:] = -100


@pytest.mark.parametrize(("name", "plugins"), [("dp2", lambda: [ZeRO(stage=0)]), ("cp2", lambda: [ContextParallel(2)])])
def test_ignored_labels_still_give_the_mean_over_all_labelled_tokens(name, plugins):
    def run(strategy, world_size):
        micro = 8 // (2 if name == "dp2" and world_size == 2 else 1)
        return record_run(
            lambda: _IgnoringModule("llama_tiny", optim=SGD),
            lambda: UltraScaleDataModule(seq_len=64, micro_batch_size=micro, seed=0),
            steps=3,
            strategy=strategy,
            world_size=world_size,
        )

    ref = run(None, 1)
    parallel = run(lambda: UltraScaleStrategy(*plugins()), 2)
    assert_parity(parallel, ref, rtol=1e-5)
