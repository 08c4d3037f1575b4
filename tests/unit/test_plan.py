"""The planner's per-rank parameter shards equal what the real plugins put on each rank.

``predict_shards`` composes the plugins' pure rules; ``dry_run`` applies the real plugins to a
meta-device model under torch's fake process group, one rank at a time, at any world size. They
must agree on every parameter's presence and local shape, exactly.
"""

from __future__ import annotations

import pytest

from lightning_ultrascale import (
    ContextParallel,
    ExpertParallel,
    PipelineParallel,
    Recompute,
    TensorParallel,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.models import build_model
from lightning_ultrascale.parallel.layout import ShardPlan, chunk_length
from lightning_ultrascale.plan import dry_run, predict_shards

#: (model, world size, plugins): every way a rank holds a parameter, on small models, every rank checked.
SMALL = {
    "tp2-pp2-zero3": ("llama_tiny", 8, lambda: [TensorParallel(2), PipelineParallel(2, "1f1b"), ZeRO(3)]),
    "hsdp-2x2": ("llama_tiny", 4, lambda: [ZeRO(3, replicate=2)]),
    "zbv-zero1": ("llama_tiny", 4, lambda: [PipelineParallel(2, "zbv"), ZeRO(1)]),
    "cp2-tp2-recompute": ("llama_tiny", 4, lambda: [ContextParallel(2), TensorParallel(2), Recompute("full")]),
    "ep4-zero3": ("moe_tiny", 8, lambda: [ExpertParallel(4), ZeRO(3)]),
    "ep2-tp2-interleaved-zero3": (
        "moe_tiny", 8, lambda: [ExpertParallel(2), TensorParallel(2), PipelineParallel(2, "interleaved_1f1b"), ZeRO(3)]
    ),
    "tied-1b-pp4-tp2": ("llama3_1b", 8, lambda: [PipelineParallel(4, "1f1b"), TensorParallel(2)]),
}  # fmt: skip

#: Published models at full scale: a few ranks each (one per pipeline stage for 70B).
LARGE = {
    "llama3_70b-512": ("llama3_70b", 512, lambda: [TensorParallel(8), PipelineParallel(4, microbatches=8), ZeRO(3)]),
    "llama3_405b-2048": (
        "llama3_405b", 2048,
        lambda: [TensorParallel(8), PipelineParallel(16, "interleaved_1f1b", microbatches=32), ZeRO(3)],
    ),
    "deepseek_v3-2048": (
        "deepseek_v3", 2048,
        lambda: [TensorParallel(8), PipelineParallel(8, "zbv", microbatches=16), ExpertParallel(32), ZeRO(3)],
    ),
}  # fmt: skip


def _check(model: str, world: int, plugins, rank: int) -> ShardPlan:
    measured = dry_run(lambda: UltraScaleStrategy(*plugins()), lambda: build_model(model, device="meta"), world, rank)
    plan = predict_shards(UltraScaleStrategy(*plugins()), build_model(model, device="meta"), world, rank)
    missing, extra = set(measured) - set(plan.shapes), set(plan.shapes) - set(measured)
    assert not missing and not extra, f"rank {rank}: not predicted {sorted(missing)[:3]}, wrongly {sorted(extra)[:3]}"
    wrong = {n: (measured[n], plan.shapes[n]) for n in measured if measured[n] != plan.shapes[n]}
    assert not wrong, f"rank {rank}: (measured, predicted) {dict(list(wrong.items())[:3])}"
    return plan


@pytest.mark.parametrize("layout", list(SMALL))
def test_every_rank_holds_the_predicted_shards(layout):
    model, world, plugins = SMALL[layout]
    for rank in range(world):
        _check(model, world, plugins, rank)


@pytest.mark.parametrize("layout", list(LARGE))
def test_full_scale_dry_runs_hold_the_predicted_shards(layout):
    model, world, plugins = LARGE[layout]
    pp = plugins()[1].size
    per_stage = world // pp
    # The first and the last rank, and one rank of each of up to 4 stages at scattered tp/dp coordinates.
    ranks = {0, world - 1} | {s * per_stage + (37 * s + 5) % per_stage for s in range(0, pp, max(1, pp // 4))}
    totals = [_check(model, world, plugins, rank).numel for rank in sorted(ranks)]
    assert all(t > 0 for t in totals)


def test_llama3_70b_on_512_ranks_holds_a_512th_of_the_blocks_per_rank():
    # tp8 x pp4 x dp16: each rank holds ~1/512 of the 70B parameters; the first stage adds its
    # embedding shard, the last the head's and the final norm's.
    model, world, plugins = LARGE["llama3_70b-512"]
    meta = build_model(model, device="meta")
    first = predict_shards(UltraScaleStrategy(*plugins()), meta, world, 0).numel
    middle = predict_shards(UltraScaleStrategy(*plugins()), meta, world, 200).numel
    blocks = sum(p.numel() for n, p in meta.named_parameters() if n.startswith("layers."))
    embedding = meta.tok_embeddings.weight.numel()
    assert middle == pytest.approx(blocks / world, rel=1e-3)
    assert first - middle == pytest.approx(embedding / (8 * 16), rel=1e-3)


def test_chunks_follow_torch_chunk():
    import torch

    for length, parts in [(10, 4), (5, 4), (3, 8), (128256, 8)]:
        sizes = [c.shape[0] for c in torch.empty(length).chunk(parts)]
        sizes += [0] * (parts - len(sizes))
        assert [chunk_length(length, parts, i) for i in range(parts)] == sizes


def test_plan_check_proves_a_recipe_at_512_ranks_and_prints_each_rank(capsys):
    from lightning_ultrascale.cli.plan import check

    assert check(["recipe=llama3_8b", "parallel.tp=8", "parallel.cp=1"], world_size=512, ranks="0,511")
    out = capsys.readouterr().out
    assert "llama3_8b on 512 ranks: pp=1 x dp_replicate=1 x dp_shard=64 x cp=1 x tp=8" in out
    assert out.count("= planner") == 2


def test_plan_check_refuses_bad_layouts_and_ranks_with_the_runs_message():
    from lightning_ultrascale.cli.plan import main

    with pytest.raises(SystemExit, match=r"ultrascale-plan: parallel.tp=3 must divide n_heads=4 .*valid: 1, 2, 4"):
        main(["--check", "parallel.tp=3", "--world-size", "6"])
    with pytest.raises(SystemExit, match=r"--ranks 0,9: ranks \[9\] are outside the job's 0..7"):
        main(["--check", "--world-size", "8", "--ranks", "0,9"])


def test_plan_of_a_data_node_without_a_sequence_length_names_what_it_needs():
    from lightning_ultrascale.cli.plan import main

    # A DataModule of one's own need not declare seq_len; the planner cannot price a step without it.
    with pytest.raises(SystemExit, match=r"ultrascale-plan: data.seq_len=None: the planner prices .*positive integers"):
        main(["~data.seq_len", "--world-size", "8"])
