"""A technique is one module: a plugin defined here is searched and priced by the planner, with no edit to plan/.

The toy stages each block's output through a pinned host buffer of ``staging`` MiB (0, 64 or 256):
it holds that buffer on the GPU and moves the buffer's bytes once per step. It declares its search
axis and builds itself at a point of the search, states a fact and prices itself, as
:mod:`lightning_ultrascale.parallel.pricing` describes; the test checks that the planner tries
every value, prices exactly what the toy states, and labels and pins it like a built-in technique.
"""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from lightning_ultrascale.models import get_model_config
from lightning_ultrascale.parallel import plugin as plugin_module
from lightning_ultrascale.parallel.dims import ParallelDims
from lightning_ultrascale.parallel.layout import Layout
from lightning_ultrascale.parallel.plugin import ParallelPlugin, searched_techniques
from lightning_ultrascale.parallel.pricing import CostTerms, PlanAxis, RankView, SearchContext, SearchPoint
from lightning_ultrascale.plan import Candidate, Workload, search
from lightning_ultrascale.plan.hardware import get_hardware
from lightning_ultrascale.plan.search import context_of, search_space

MiB = 2**20
WORKLOAD = Workload(get_model_config("llama3_8b"), seq_len=4096, global_batch_size=64)
# a small space around the toy's axis: tp 1 or 2 on one node, no pipeline or context parallelism
PINS: dict[str, Any] = {"tp": [1, 2], "pp": [1], "cp": [1], "recompute": ["none"], "micro_batch_size": [1]}


@pytest.fixture
def staging(monkeypatch: pytest.MonkeyPatch) -> type[ParallelPlugin]:
    """The toy technique, known to the planner for this test only."""
    searched_techniques()  # (the built-in ones registered before the registry is swapped)
    monkeypatch.setattr(plugin_module, "_SEARCHED", dict(plugin_module._SEARCHED))

    class HostStaging(ParallelPlugin):
        applies_at = "compile"
        plan_order = 60
        plan_names = ("staging",)

        def __init__(self, buffer_mb: int) -> None:
            self.buffer_mb = buffer_mb

        def mesh_sizes(self) -> dict[str, int | None]:
            return {}

        def apply(self, model: nn.Module, layout: Layout) -> nn.Module:
            return model

        @classmethod
        def plan_axes(cls, context: SearchContext) -> tuple[PlanAxis, ...]:
            return (PlanAxis("staging", (0, 64, 256)),)

        @classmethod
        def plan_plugin(cls, point: SearchPoint) -> ParallelPlugin | None:
            size = point.get("staging", 0)
            return cls(size) if size else None

        def plan_label(self, dims: ParallelDims) -> str:
            return f"staging{self.buffer_mb}"

        def plan_facts(self, dims: ParallelDims) -> dict[str, Any]:
            return {"staging_mb": self.buffer_mb}

        def plan_cost(self, rank: RankView) -> CostTerms:
            return CostTerms(working=self.buffer_mb * MiB, step_bytes=1000 * self.buffer_mb * MiB)

    return HostStaging


def test_the_planner_searches_a_technique_it_has_never_seen(staging):
    axes = search_space(context_of(WORKLOAD, 8, get_hardware("h100")))
    assert axes["staging"].values == (0, 64, 256)

    result = search(WORKLOAD, world_size=8, gpu="h100", space=PINS)
    priced = result.fitting + result.too_big
    tried = {p.candidate.facts.get("staging_mb", 0) for p in priced}
    assert tried == {0, 64, 256}, "every value of the toy's axis is priced"
    # the toy only costs: the best layout does without it
    assert "staging" not in result.best.candidate.label()


def test_the_planner_prices_exactly_what_the_technique_states(staging):
    space = PINS | {"staging": [0, 256]}
    result = search(WORKLOAD, world_size=8, gpu="h100", space=space)
    by_label = {p.candidate.label(): p for p in result.fitting + result.too_big}
    pairs = [(label, by_label[label.replace(" staging256", "")]) for label in by_label if "staging256" in label]
    assert pairs, sorted(by_label)
    for label, without in pairs:
        with_it = by_label[label]
        # its working buffer on top of the same layout's peak, its traffic in the step time
        assert with_it.busiest.memory["working"] - without.busiest.memory["working"] == 256 * MiB, label
        assert with_it.peak - without.peak == 256 * MiB, label
        assert with_it.step_time > without.step_time, label


def test_a_pinned_value_of_the_technique_is_in_every_layout_and_in_candidate_layout(staging):
    result = search(WORKLOAD, world_size=8, gpu="h100", space=PINS | {"staging": [64]})
    assert all(" staging64 " in f" {p.candidate.label()} " for p in result.fitting)

    candidate = Candidate.layout(dp=4, tp=2, zero=1, staging=64)
    assert candidate.label() == "dp4 zero1 tp2 staging64 mb1"
    assert candidate.facts == {"staging_mb": 64}
    with pytest.raises(TypeError, match=r"unknown choices \['stagin'\]; valid: .*'staging'"):
        Candidate.layout(dp=4, stagin=64)


def test_without_the_technique_the_planner_does_not_know_its_axis():
    with pytest.raises(Exception, match=r"search space key 'staging' is unknown"):
        search(WORKLOAD, world_size=8, gpu="h100", space=PINS | {"staging": [64]})


def test_every_searched_technique_takes_the_names_of_its_own_axes():
    context = context_of(WORKLOAD, 64, get_hardware("h100"))
    for technique in searched_techniques():
        names = {axis.name for axis in technique.plan_axes(context)}
        assert names and names <= set(technique.plan_names), technique.__name__
