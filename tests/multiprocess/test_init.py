"""Shard-local initialisation: a counter-based draw, so each rank computes only its shard and every layout agrees.

Each layout runs on forked gloo ranks: the strategy's plugins rewrite a meta model, ``to_empty``
and ``init_weights`` materialise this rank's part (what ``UltraScaleStrategy.parallelize`` does),
and every local shard must equal torch's own cut (``distribute_tensor``) of the one-process
build, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from llama_runs import MIXTRAL_TINY
from torch import nn

import lightning_ultrascale.models.llama as llama
from lightning_ultrascale import ExpertParallel, PipelineParallel, TensorParallel, UltraScaleStrategy, ZeRO
from lightning_ultrascale.models import build_model, get_model_config, shard_init
from lightning_ultrascale.models.llama import param_seed
from lightning_ultrascale.models.shard_init import normal_at, philox4x32
from lightning_ultrascale.parallel.layout import Layout
from lightning_ultrascale.parallel.mesh import build_mesh
from lightning_ultrascale.parallel.plugin import ParallelPlugin, apply_all
from lightning_ultrascale.testing import run_pooled, run_workers

TINY = get_model_config("llama_tiny")
# An odd vocabulary and FFN width: FSDP2 and TP leave uneven shards (161 + 160 rows, ...).
ODD = replace(TINY, name="llama_tiny_odd", vocab_size=321, ffn_hidden_dim=191)
# Two experts over ep2 x ZeRO-3 on 4 ranks: FSDP splits inside each expert (dim 1).
FEW_EXPERTS = replace(MIXTRAL_TINY, name="mixtral_tiny_2e", moe=replace(MIXTRAL_TINY.moe, n_routed_experts=2))
SEED = 5


# ------------------------------------------------------------------------------ the generator
# Random123's published known answers for Philox-4x32-10 (its tests/kat_vectors): counter, key words, output.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("counter", "key", "expected"), PHILOX_KAT)
def test_philox_matches_random123_known_answers(counter, key, expected) -> None:
    words = philox4x32([torch.tensor([c]) for c in counter], key[0] | key[1] << 32)
    assert tuple(words[0].tolist()) == expected


def test_normals_are_a_pure_function_of_key_and_index() -> None:
    key = param_seed(SEED, "layers.0.attention.wq.weight")
    full = normal_at(key, torch.arange(10_000))
    assert torch.equal(normal_at(key, torch.arange(10_000)), full)
    # Any range, any subset in any order: the same bits as the full draw's slice.
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        a, b = sorted(torch.randint(0, 10_001, (2,), generator=g).tolist())
        assert torch.equal(normal_at(key, torch.arange(a, b)), full[a:b]), (a, b)
    subset = torch.randperm(10_000, generator=g)[:777]
    assert torch.equal(normal_at(key, subset), full[subset])
    # The key depends on the run seed and on the name.
    assert not torch.equal(normal_at(param_seed(SEED + 1, "layers.0.attention.wq.weight"), torch.arange(8)), full[:8])
    assert not torch.equal(normal_at(param_seed(SEED, "layers.1.attention.wq.weight"), torch.arange(8)), full[:8])


def test_normals_are_standard_and_uncorrelated() -> None:
    x = normal_at(param_seed(SEED, "tok_embeddings.weight"), torch.arange(1_000_000))
    other = normal_at(param_seed(SEED, "output.weight"), torch.arange(1_000_000))
    n = len(x)
    # Bounds at 5 standard errors: mean 1/sqrt(n) = 1e-3, std 1/sqrt(2n) = 7e-4, correlation 1/sqrt(n).
    assert abs(x.mean().item()) < 5e-3
    assert abs(x.std().item() - 1) < 3.5e-3
    assert abs((x.abs() > 2).double().mean().item() - 0.0455) < 5 * (0.0455 * 0.9545 / n) ** 0.5  # the normal's tails
    # Lags 1-4 cross the four normals of one Philox call and the Box-Muller pairs; squares would
    # show a shared radius; the second key must be a stream of its own.
    pairs = [(x[:-lag], x[lag:]) for lag in (1, 2, 3, 4)]
    pairs += [(x[:-1] ** 2, x[1:] ** 2), (x, other)]
    for a, b in pairs:
        assert abs(torch.corrcoef(torch.stack((a, b)))[0, 1].item()) < 5e-3


def test_one_process_weights_are_the_counter_based_draw() -> None:
    model = build_model(get_model_config("moe_tiny"), seed=SEED)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        std = model._init_std(name)
        expected = (normal_at(param_seed(SEED, name), torch.arange(p.numel())) * std).float().view(p.shape)
        assert torch.equal(p, expected), name


# ------------------------------------------------------------------------------ every layout
LAYOUTS: dict[str, tuple[Callable[[], list[ParallelPlugin]], Any, int]] = {
    "tp2": (lambda: [TensorParallel(2)], TINY, 2),
    "zero3_dp2_uneven": (lambda: [ZeRO(stage=3)], ODD, 2),
    "hsdp_2x2_uneven": (lambda: [ZeRO(stage=3, replicate=2)], ODD, 4),
    "ep2": (lambda: [ExpertParallel(2)], get_model_config("moe_tiny"), 2),
    "ep2_x_zero3_inside_experts": (lambda: [ExpertParallel(2), ZeRO(stage=3)], FEW_EXPERTS, 4),
    "zero3_over_tp2": (lambda: [TensorParallel(2), ZeRO(stage=3)], TINY, 4),
    "pp2_tied": (lambda: [PipelineParallel(2, "1f1b")], replace(TINY, tie_embeddings=True, name="tied"), 2),
}


def _materialise(plugins: Callable[[], list[ParallelPlugin]], cfg: Any, world_size: int) -> nn.Module:
    """This rank's part of ``cfg`` under ``plugins``, as ``UltraScaleStrategy.parallelize`` builds it."""
    strategy = UltraScaleStrategy(*plugins(), seed=SEED)
    model: nn.Module = build_model(cfg, device="meta")
    strategy.validate(model.spec, world_size=world_size)  # type: ignore[arg-type]
    layout = Layout(strategy.parallel_dims, build_mesh(strategy.parallel_dims, "cpu"))
    model = apply_all(strategy.applied_plugins(), model, layout)
    model.to_empty(device="cpu")
    model.init_weights(SEED)  # type: ignore[operator]
    return model


def _compare_with_one_process(layout: str) -> dict[str, Any]:
    """Per parameter: does this rank's shard equal torch's cut of the one-process build? What placements?"""
    from torch.distributed.tensor import DTensor, distribute_tensor

    plugins, cfg, world_size = LAYOUTS[layout]
    model = _materialise(plugins, cfg, world_size)
    reference = dict(build_model(cfg, seed=SEED).named_parameters(remove_duplicate=False))  # a tied head too
    found: dict[str, Any] = {}
    for fqn, p in model.named_parameters():
        name = fqn.replace("_checkpoint_wrapped_module.", "")
        if isinstance(p, DTensor):
            expected = distribute_tensor(reference[name].detach(), p.device_mesh, p.placements, src_data_rank=None)
            whole = p.full_tensor()  # a collective: every rank gathers, whatever its own shard holds
            same = torch.equal(p.to_local(), expected.to_local()) and torch.equal(whole, reference[name])
            found[name] = (same, [str(x) for x in p.placements], tuple(p.to_local().shape))
        else:
            found[name] = (torch.equal(p, reference[name]), [], tuple(p.shape))
    return found


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_holds_its_slice_of_the_one_process_weights(layout: str) -> None:
    ranks = run_pooled(_compare_with_one_process, LAYOUTS[layout][2], layout)
    for rank, found in enumerate(ranks):
        wrong = [name for name, (same, _, _) in found.items() if not same]
        assert not wrong, f"{layout} rank {rank}: {wrong}"
    placements = {str(pl) for found in ranks for _, pl, _ in found.values()}
    shapes = {name: [found[name][2] for found in ranks if name in found] for found in ranks for name in found}
    # Each layout really is the kind it is named after.
    if layout == "zero3_over_tp2":
        assert any("_S(" in p for p in placements), placements  # torch's str of _StridedShard
    if layout.endswith("uneven"):
        assert len(set(shapes["tok_embeddings.weight"])) > 1, shapes["tok_embeddings.weight"]
    if layout == "ep2_x_zero3_inside_experts":
        assert "['S(1)', 'S(0)']" in placements, placements
        assert (0, TINY.dim) in shapes["layers.0.feed_forward.router.weight"]  # 2 rows over 4 ranks: empty shards
    if layout == "pp2_tied":  # the last stage's head is drawn as the first stage's embedding
        assert "tok_embeddings.weight" in ranks[0] and "tok_embeddings.weight" not in ranks[1]
        assert "output.weight" in ranks[1]


# ------------------------------------------------------------------------------ nothing drawn in full
def _count_draws(plugins: Callable[[], list[ParallelPlugin]], cfg: Any, world_size: int) -> tuple[int, int, int, list]:
    """Elements drawn, elements held and elements of the whole model on this rank; full-shape distribute calls."""
    import torch.distributed.tensor as dtensor

    drawn, distributed = [0], []
    normals, distribute_tensor = shard_init._normals, dtensor.distribute_tensor

    def counting_normals(counters: torch.Tensor, key: int) -> torch.Tensor:
        drawn[0] += 4 * counters.numel()
        return normals(counters, key)

    def recording_distribute(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        distributed.append(tuple(tensor.shape))
        return distribute_tensor(tensor, *args, **kwargs)

    shard_init._normals, dtensor.distribute_tensor = counting_normals, recording_distribute  # type: ignore[assignment]
    model = _materialise(plugins, cfg, world_size)
    held = sum(p.to_local().numel() for n, p in model.named_parameters() if not n.endswith("norm.weight"))
    whole = sum(p.numel() for n, p in model.named_parameters() if not n.endswith("norm.weight"))
    return drawn[0], held, whole, [s for s in distributed if len(s) > 1]


@pytest.mark.parametrize("layout", ["zero3_dp2_uneven", "ep2_x_zero3_inside_experts", "zero3_over_tp2"])
def test_sharded_parameters_draw_only_their_shard(layout: str) -> None:
    plugins, cfg, world_size = LAYOUTS[layout]
    for drawn, held, whole, full_shape_calls in run_pooled(_count_draws, world_size, plugins, cfg, world_size):
        assert not full_shape_calls, full_shape_calls  # distribute_tensor only ever cuts 1-D index lists
        # A Philox call makes four normals: a shard's edges and a strided shard's rows round up to them.
        assert held <= drawn <= 1.1 * held, (drawn, held)
        assert drawn < 0.6 * whole, (drawn, whole)


def _fallback_equals_shard_local(layout: str) -> bool:
    """Init FSDP-over-TP again with the whole-parameter fallback forced: the same local shards?"""
    plugins, cfg, world_size = LAYOUTS[layout]
    shard_local = {n: p.to_local().clone() for n, p in _materialise(plugins, cfg, world_size).named_parameters()}
    llama.local_indices = lambda param: None  # type: ignore[assignment]
    fallback = {n: p.to_local() for n, p in _materialise(plugins, cfg, world_size).named_parameters()}
    return all(torch.equal(shard_local[n], fallback[n]) for n in shard_local)


def test_whole_parameter_fallback_gives_the_same_shards() -> None:
    assert run_workers(_fallback_equals_shard_local, 4, "zero3_over_tp2") == [True] * 4


def test_init_zeroes_the_expert_bias_and_reties_the_head() -> None:
    model = build_model(replace(get_model_config("moe_tiny"), tie_embeddings=True, name="moe_tied"), seed=SEED)
    moe = model.layers["1"].feed_forward
    moe.router.expert_bias.fill_(0.5)
    model.output.weight = nn.Parameter(model.output.weight.detach().clone())  # as to_empty unties them
    model.init_weights(SEED)
    assert torch.equal(moe.router.expert_bias, torch.zeros_like(moe.router.expert_bias))
    assert model.output.weight is model.tok_embeddings.weight


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run `pytest -m gpu` on one")
def test_a_gpu_build_draws_the_cpu_values() -> None:
    # Philox's words are integers: equal bit for bit. The values pass through float64 log/cos/sin,
    # whose last bit CUDA's libm and the CPU's may round differently; fp32 rounding hides that except
    # on a tie (about one element in 10**11 expected), and then by one fp32 ulp.
    n = 1 << 24
    counter = torch.arange(n, dtype=torch.int64)
    zero = torch.zeros_like(counter)
    words = philox4x32((counter, counter >> 3, zero, counter), key=2**63 + 5)
    on_gpu = philox4x32([c.cuda() for c in (counter, counter >> 3, zero, counter)], key=2**63 + 5)
    assert torch.equal(on_gpu.cpu(), words)
    cpu = build_model(get_model_config("moe_tiny"), seed=SEED)
    gpu = dict(build_model(get_model_config("moe_tiny"), device="cuda", seed=SEED).named_parameters())
    differing = sum(int((p != gpu[name].cpu()).sum()) for name, p in cpu.named_parameters())
    assert differing == 0, f"{differing} elements differ between the CPU and the GPU build"
    values = shard_init.fill_normal_(torch.empty(n), 7, 1.0, (n,))
    on_gpu_values = shard_init.fill_normal_(torch.empty(n, device="cuda"), 7, 1.0, (n,)).cpu()
    torch.testing.assert_close(on_gpu_values, values, rtol=2**-23, atol=0)
    assert int((on_gpu_values != values).sum()) <= 2
