"""ParallelDims: sizes, inference, coordinates and every up-front validation (no processes)."""

from dataclasses import replace

import pytest

from lightning_ultrascale import ZeRO
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import get_model_config
from lightning_ultrascale.models.spec import ModelSpec
from lightning_ultrascale.parallel.dims import MESH_DIMS, ParallelDims

SPEC = ModelSpec(name="m", n_layers=4, n_heads=8, n_kv_heads=4, dim=64, vocab_size=320, n_experts=8)


def test_product_must_equal_world_size_and_message_names_the_numbers():
    with pytest.raises(ConfigError, match=r"dp_replicate=3 .* multiply to 3, but the job has 4 ranks"):
        ParallelDims(dp_replicate=3).validate(world_size=4)


def test_one_size_is_inferred_from_the_world_size():
    assert ParallelDims.infer(8, infer_dim="dp_replicate", tp=2).shape == (1, 4, 1, 1, 2)
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by tp=4 = 4.*divisors: 1, 2, 3, 6"):
        ParallelDims.infer(6, infer_dim="dp_replicate", tp=4)


@pytest.mark.parametrize("size", [0, -2, 1.5, True])
def test_sizes_must_be_positive_integers(size):
    with pytest.raises(ConfigError, match=r"parallel.tp=.* must be a positive integer"):
        ParallelDims(tp=size)


def test_tp_must_divide_heads_and_kv_heads():
    with pytest.raises(ConfigError, match=r"parallel.tp=3 must divide n_heads=8 of model m; valid: 1, 2, 4, 8"):
        ParallelDims(tp=3).validate_model(SPEC)
    with pytest.raises(ConfigError, match=r"parallel.tp=8 must divide n_kv_heads=4 .* valid: 1, 2, 4"):
        ParallelDims(tp=8).validate_model(SPEC)
    ParallelDims(tp=4).validate_model(SPEC)


def test_pp_cannot_exceed_layers_and_ep_must_divide_experts():
    with pytest.raises(ConfigError, match=r"parallel.pp=5 exceeds n_layers=4"):
        ParallelDims(pp=5).validate_model(SPEC)
    with pytest.raises(ConfigError, match=r"parallel.ep=3 must divide n_experts=8 of model m; valid: 1, 2, 4, 8"):
        ParallelDims(dp_shard=6, ep=3).validate_model(SPEC)
    pool = r"parallel.ep=4 must divide the data-parallel and tensor-parallel ranks .* = 1 x 2 x 1 x 1 = 2"
    with pytest.raises(ConfigError, match=pool):
        ParallelDims(dp_shard=2, ep=4).validate(world_size=2)


def test_global_batch_must_divide_by_micro_batch_times_dp():
    dims = ParallelDims(dp_replicate=4)
    assert dims.grad_accumulation(global_batch_size=16, micro_batch_size=2) == 2
    with pytest.raises(ConfigError, match=r"data.global_batch_size=6 .* 2 x 4 = 8; valid: 8, 16, 24"):
        dims.grad_accumulation(global_batch_size=6, micro_batch_size=2)


def test_coordinates_are_row_major_with_tp_innermost():
    dims = ParallelDims(pp=2, dp_replicate=2, dp_shard=1, cp=1, tp=2)
    coords = [dims.coordinate(r) for r in range(dims.world_size)]
    assert [c["tp"] for c in coords] == [0, 1] * 4
    assert [c["pp"] for c in coords] == [0] * 4 + [1] * 4
    assert list(coords[0]) == list(MESH_DIMS)
    # tp and pp peers read the same data shard; dp replicas read different ones.
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ZeRO(stage=3, replicate=True), r"ZeRO\(replicate=True\) must be a positive integer"),
        (lambda: ZeRO(size=True), r"ZeRO\(size=True\) must be a positive integer"),
        (lambda: replace(get_model_config("llama_tiny"), dim=True).validate(), r"model.dim=True must be a positive"),
    ],
)
def test_a_bool_is_not_a_size(build, message):
    # Every positive-integer check is errors.is_positive_int: True passed as 1 in three of them before.
    with pytest.raises(ConfigError, match=message):
        build()
