"""The plugins price themselves: the planner composes their terms, holds no rules of its own.

Three checks: today's predictions equal the planner's from before the plugins priced themselves
(a committed snapshot of 88 layouts); a real run's model state and traffic equal what its plugins
predict (computed here, in the real Lightning loop, not read from a file); and a plugin defined in
this file is planned, by ``estimate`` and by ``search``, without a line of ``plan/`` knowing it.
"""

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from benchmark_scripts import load_benchmark
from torch import nn

from lightning_ultrascale import ZeRO
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import build_model, get_model_config
from lightning_ultrascale.parallel.dims import ParallelDims
from lightning_ultrascale.parallel.layout import Layout
from lightning_ultrascale.parallel.pipeline.schedules import SPLIT_BACKWARD
from lightning_ultrascale.parallel.plugin import ParallelPlugin
from lightning_ultrascale.parallel.pricing import CostTerms, RankView, add_traffic
from lightning_ultrascale.plan import Candidate, Workload, estimate, get_hardware, search

SNAPSHOT = Path(__file__).parents[1] / "data" / "plan_predictions_before_plugins_priced.json"


def _snapshot_rows() -> list[dict[str, Any]]:
    return json.loads(SNAPSHOT.read_text())["rows"]


def test_every_prediction_is_the_planner_s_from_before_the_plugins_priced_themselves():
    rows, models = _snapshot_rows(), {}
    assert len(rows) == 88 and {r["workload"][0] for r in rows} >= {"llama3_8b", "llama3_70b", "mixtral_8x7b"}
    for row in rows:
        name, seq, batch, precision, reduce_dtype = row["workload"]
        workload = Workload(get_model_config(name), seq, batch, precision=precision, reduce_dtype=reduce_dtype)
        candidate = Candidate.layout(**row["layout"], reduce_dtype=reduce_dtype)
        # (a label names virtual stages only where they are not the schedule's default: v2 here)
        assert candidate.label() == row["label"].replace("interleaved_1f1b,v2,", "interleaved_1f1b,")
        meta = models.setdefault(name, build_model(name, device="meta"))
        if candidate.recompute == "selective_op" and candidate.schedule in SPLIT_BACKWARD and candidate.pp > 1:
            # refused since (it crashed at the first backward): the one change of the plugins' rules
            with pytest.raises(ConfigError, match="cannot run under PipelineParallel"):
                estimate(workload, candidate, meta, get_hardware(row["gpu"]))
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            costs = estimate(workload, candidate, meta, get_hardware(row["gpu"]))
        for old, new in zip(row["ranks"], costs, strict=True):
            where = f"{row['label']} rank {old['rank']}"
            assert new.memory == old["memory"] and new.model_state == old["model_state"], where
            expected = _loss_forward_only(_fp32_ring_gradients(old["comm"], row), new.view)
            assert new.comm == expected and new.bubble == old["bubble"], where
            # Step times: commit e73443a reproduced these to 1e-12 (but the two dp1 x cp2 layouts, whose
            # gradient all-reduce over cp was timed as ring traffic before); the time model
            # has changed since (matmuls by shape, attention, memory-bound kernels, the optimizer
            # step, per-phase overlap): tests/unit/test_plan_time.py and the benchmarks hold it now.


def _fp32_ring_gradients(comm: dict[str, int], row: dict[str, Any]) -> dict[str, float]:
    """The snapshot's traffic with the ring's dK/dV accumulators in fp32, as torch's context parallel sends
    them (the snapshot's ring sent them in the compute dtype): per layer 2 (cp - 1) K/V blocks in it, cp in fp32."""
    cp, method = row["layout"]["cp"], row["layout"]["cp_method"]
    if cp == 1 or method == "all_to_all":
        return comm
    e = 4 if row["workload"][3] == "32-true" else 2
    factor = (2 * (cp - 1) * e + 4 * cp) / ((3 * cp - 2) * e)
    return {k: v * factor if k in ("cp:send", "cp:recv") else v for k, v in comm.items()}


def _loss_forward_only(comm: dict[str, float], rank: Any) -> dict[str, float]:
    """The snapshot's traffic with the vocabulary-parallel loss's all-reduces in its forward alone, as traced (three
    of a fp32 per token: target logit, max, sum of exponentials; the snapshot counted six)."""
    if rank.widths.tp == 1 or not rank.last:
        return comm
    return comm | {"tp:all_reduce": comm.get("tp:all_reduce", 0) - 3 * 4 * rank.tokens * rank.forwards}


def test_the_retimed_layouts_now_overlap_their_data_reduction_with_backward():
    row = next(r for r in _snapshot_rows() if r["label"] == "dp1 zero0 cp2(ring) mb2")
    workload = Workload(get_model_config("llama_tiny"), 256, 8, precision="32-true")
    [cost] = estimate(workload, Candidate.layout(**row["layout"]), build_model("llama_tiny", device="meta"),
                      get_hardware("h100"))  # fmt: skip
    data, ring = cost.terms[0], cost.terms[1]
    assert set(data.traffic) == {"cp:all_reduce"} and not data.in_step and data.hidden_by == pytest.approx(2 / 3)
    assert set(ring.traffic) == {"cp:send", "cp:recv"} and ring.in_step


# ----------------------------------------------------------------------------- live: a run's own numbers
@pytest.mark.parametrize(
    "layout",
    [
        dict(dp=2, zero=2, micro_batch_size=2),
        dict(dp=2, zero=3, micro_batch_size=2, recompute="full"),
        dict(tp=2, zero=0, micro_batch_size=2),
        dict(pp=2, zero=0, schedule="1f1b", microbatches=4, micro_batch_size=1),
        dict(cp=2, zero=0, cp_method="zigzag_ring", micro_batch_size=2),
    ],
    ids=["zero2-dp2", "zero3-dp2-full-ac", "tp2", "pp2-1f1b", "cp2-zigzag"],
)
def test_a_real_run_holds_and_sends_what_its_plugins_predict(layout):
    # Computed now, not read from a committed file: a change of a plugin's cost terms (or of what
    # the plugin really does) that makes the two disagree fails here. Model state exactly; traffic
    # per parallelism within 1% (scalar collectives below 256 B are not counted by either).
    bench = load_benchmark("plan")
    row = bench.compare("llama_tiny", Candidate.layout(**layout))
    for rank in row["ranks"]:
        # (the vocabulary-parallel embedding's gradient arrives whole, a Replicate DTensor of a Shard(0)
        # parameter; the step keeps its shard after the last backward: parallel/step.py's settle_gradients)
        assert rank["predicted_model_state"] == rank["measured_model_state"], rank["rank"]
        assert set(rank["comm_errors"]) == set(rank["measured_comm_by_dim"]), rank["rank"]
        for dim, error in rank["comm_errors"].items():
            assert abs(error) < bench.COMM_BOUND, (rank["rank"], dim, error)
    # and calls as many as traced (each pays a collective's latency), up to the once-a-step ones it does not count
    assert bench.calls_off(row["ranks"]) <= bench.CALLS_EXTRA, [
        (r["measured_calls_by_dim"], r["predicted_calls_by_dim"]) for r in row["ranks"]
    ]


# ----------------------------------------------------------------------------- a plugin plan/ never heard of
class StatisticsAllReduce(ParallelPlugin):
    """A made-up technique: all-reduce a ``megabytes`` statistic over the data ranks every forward,
    waited at once, and keep a ``buffer_mb`` buffer at the peak."""

    applies_at = "recompute"  # (any free place in the order)

    def __init__(self, megabytes: float = 64.0, buffer_mb: float = 512.0) -> None:
        self.megabytes, self.buffer_mb = megabytes, buffer_mb

    def mesh_sizes(self) -> dict[str, int | None]:
        return {}

    def apply(self, model: nn.Module, layout: Layout) -> nn.Module:
        return model

    def plan_facts(self, dims: ParallelDims) -> dict[str, Any]:
        return {}

    def plan_cost(self, rank: RankView) -> CostTerms:
        terms = CostTerms(in_step=True, working=int(self.buffer_mb * 2**20))
        add_traffic(terms.traffic, "dp_shard", "all_reduce", self.megabytes * 2**20 * rank.forwards)
        return terms


def test_a_plugin_defined_here_is_estimated_without_editing_the_planner():
    workload = Workload(get_model_config("llama3_1b"), 4096, 64)
    meta, h100 = build_model("llama3_1b", device="meta"), get_hardware("h100")
    [plain] = estimate(workload, Candidate.from_plugins([ZeRO(1)], 8, 8), meta, h100)
    [extra] = estimate(workload, Candidate.from_plugins([ZeRO(1), StatisticsAllReduce()], 8, 8), meta, h100)
    assert extra.memory["working"] - plain.memory["working"] == 512 * 2**20
    accumulation = 64 // (8 * 8)
    added = extra.comm["dp_shard:all_reduce"] - plain.comm.get("dp_shard:all_reduce", 0)
    assert added == 64 * 2**20 * accumulation
    # waited in the step: the all-reduce's time on NVLink is added to the critical path, unhidden
    link = h100.intra_node_bandwidth * h100.link_efficiency
    wire = 2 * 7 / 8 * 64 * 2**20
    assert extra.time_parts["critical_comm"] - plain.time_parts["critical_comm"] == pytest.approx(
        wire / link + h100.collective_latency("all_reduce", 8)  # (a plugin counting no calls: one call)
    )
    assert extra.step_time > plain.step_time


def test_a_plugin_defined_here_is_searched_with_every_layout():
    workload = Workload(get_model_config("llama3_1b"), 4096, 64)
    space = {"tp": [1, 2], "cp": [1], "pp": [1], "micro_batch_size": [1], "recompute": ["none"], "zero": [1]}
    plain = search(workload, 8, "h100", space=space)
    heavy = search(workload, 8, "h100", space=space, plugins=[StatisticsAllReduce(megabytes=2048, buffer_mb=4096)])
    assert [p.candidate.label() for p in heavy.fitting] == [p.candidate.label() for p in plain.fitting]
    for a, b in zip(plain.fitting, heavy.fitting):
        assert b.peak == a.peak + 4096 * 2**20
        assert b.step_time > a.step_time
        assert any(isinstance(p, StatisticsAllReduce) for p in b.candidate.plugins)
