"""Pipeline-schedule simulator: torch's orders, timed, against the playbook's and the papers' formulas.

Expected numbers come from the formulas (or, for the ordering, from torch's own tools), never from
the simulator. ``bubble time`` below is one rank's idle time, ``makespan - m v (F + B + W)``.
"""

import contextlib
import io
import itertools
import sys

import pytest

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.parallel.pipeline.schedules import SCHEDULES, stage_ranks
from lightning_ultrascale.parallel.pipeline.simulator import (
    OpCosts,
    Timeline,
    bubble_formula,
    simulate,
    torch_order,
)

UNIFORM = OpCosts()
# Backward twice the forward (the playbook's t_b = 2 t_f), and a forward heavier than B and W.
UNEQUAL = (OpCosts(1.0, 1.5, 0.5), OpCosts(2.0, 1.0, 0.5))
# One layout per schedule, small enough to keep the file fast; v = 2 where a schedule needs it.
LAYOUTS = [
    ("afab", 4, 8, 1),
    ("1f1b", 4, 8, 1),
    ("interleaved_1f1b", 4, 8, 2),
    ("looped_bfs", 3, 6, 2),
    ("zero_bubble", 4, 8, 1),
    ("zero_bubble", 2, 4, 3),
    ("zbv", 4, 8, 2),
    ("dualpipev", 3, 6, 2),
]


def bubble_time(t: Timeline) -> float:
    return t.makespan - t.compute_time(0)


# ----------------------------------------------------------------------------- bubbles
@pytest.mark.parametrize("costs", [UNIFORM, *UNEQUAL])
@pytest.mark.parametrize("schedule", ["afab", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (3, 7), (8, 16)])
def test_afab_and_1f1b_bubble_is_p_minus_1_over_m(schedule, p, m, costs):
    assert simulate(schedule, p, m, costs=costs).bubble_ratio == pytest.approx((p - 1) / m, abs=1e-12)
    assert bubble_formula(schedule, p, m, costs=costs) == pytest.approx((p - 1) / m, abs=1e-12)


@pytest.mark.parametrize("costs", [UNIFORM, *UNEQUAL])
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "looped_bfs"])
@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 8, 3), (4, 4, 4), (8, 16, 2)])
def test_looping_v_stages_per_rank_divides_the_bubble_by_v(schedule, p, m, v, costs):
    expected = (p - 1) / (v * m)
    assert simulate(schedule, p, m, v, costs).bubble_ratio == pytest.approx(expected, abs=1e-12)
    assert bubble_formula(schedule, p, m, v, costs) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 1), (4, 8, 1), (8, 16, 1), (4, 8, 2), (4, 12, 3)])
def test_zb_h1_bubble_is_a_third_of_1f1b_at_equal_costs(p, m, v):
    t = simulate("zero_bubble", p, m, v)
    assert bubble_time(t) == pytest.approx((p - 1) * 1.0, abs=1e-12)  # (p-1)(F + B - W)
    assert t.bubble_ratio == pytest.approx((p - 1) / (3 * m * v), abs=1e-12)
    assert bubble_formula("zero_bubble", p, m, v) == pytest.approx(t.bubble_ratio, abs=1e-12)


@pytest.mark.parametrize("costs", UNEQUAL)
@pytest.mark.parametrize(("p", "m"), [(4, 8), (8, 16)])
def test_zb_h1_bubble_is_f_plus_b_minus_w_when_w_is_the_lightest(p, m, costs):
    f, b, w = costs.forward, costs.backward_input, costs.backward_weight
    assert bubble_time(simulate("zero_bubble", p, m, costs=costs)) == pytest.approx((p - 1) * (f + b - w), abs=1e-12)


@pytest.mark.parametrize(("costs", "bound"), [(OpCosts(0.5, 1.0, 2.0), "drain"), (OpCosts(1.0, 0.5, 2.0), "fill")])
def test_zb_h1_keeps_the_fill_or_the_drain_when_w_is_heavy(costs, bound):
    # F + B - W would be negative: torch's order still pays (p-1)F filling or (p-1)B draining.
    p, m = 4, 8
    expected = (p - 1) * (costs.backward_input if bound == "drain" else costs.forward)
    busy = m * (costs.forward + costs.backward_input + costs.backward_weight)
    assert bubble_time(simulate("zero_bubble", p, m, costs=costs)) == pytest.approx(expected, abs=1e-12)
    assert bubble_formula("zero_bubble", p, m, costs=costs) * busy == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zbv_pays_only_the_fill_at_equal_costs(p, m):
    # ZB-V is zero bubble at F = B = W (Qi et al. 2023, section 6) once steps overlap; a single
    # synchronous step cannot avoid rank p-1 waiting (p-1)F for its first input.
    t = simulate("zbv", p, m)
    assert bubble_time(t) == pytest.approx((p - 1) * 1.0, abs=1e-12)
    assert bubble_formula("zbv", p, m) == pytest.approx(t.bubble_ratio, abs=1e-12)


def test_zbv_fixed_order_loses_to_the_fill_with_a_heavy_forward():
    # torch's docstring: ZB-V is zero bubble only if F = B = W; its order is fixed, not cost-aware.
    p, m, costs = 4, 8, UNEQUAL[1]
    assert simulate("zbv", p, m, costs=costs).bubble_ratio > bubble_formula("zbv", p, m, costs=costs) + 0.01


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 12), (8, 16)])
def test_dualpipev_beats_deepseeks_bound_because_torch_runs_overlapped_halves_in_turn(p, m):
    # DeepSeek-V3 Table 2 with PP = 2p stages: (p-1)(F&B + B_full - 3W) = (p-1)(3 + 2 - 3) = 2(p-1) at
    # F = B = W. torch runs OVERLAP_F_B's forward before its backward, each waiting only for its own
    # input, so only the fill (p-1)F remains (torch's visualizer, which waits for both: see below).
    assert bubble_formula("dualpipev", p, m) * 2 * m * 3 == pytest.approx(2 * (p - 1), abs=1e-12)
    assert bubble_time(simulate("dualpipev", p, m)) == pytest.approx((p - 1) * 1.0, abs=1e-12)


@pytest.mark.parametrize("costs", [UNIFORM, *UNEQUAL, OpCosts(1, 1, 1, p2p=0.5)])
@pytest.mark.parametrize(("schedule", "p", "m", "v"), LAYOUTS)
def test_no_schedule_beats_the_fill(schedule, p, m, v, costs):
    # The rank that holds stage p-1 first waits for p-1 forwards (and p-1 sends).
    assert bubble_time(simulate(schedule, p, m, v, costs)) >= (p - 1) * (costs.forward + costs.p2p) - 1e-12


def test_makespans_match_torchs_own_visualizer():
    viz = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    # torch spaces ops with F = I = W = 1, full backward 2 and OVERLAP_F_B 3 (which waits for both inputs).
    widths = {"F": 1, "I": 1, "W": 1, "B": 2, "OVERLAP_F_B": 3}
    for schedule, p, m, v in LAYOUTS:
        if not SCHEDULES[schedule].multi or v < 2:  # the visualizer wants v >= 2 for these classes
            continue
        with contextlib.redirect_stdout(io.StringIO()):  # it prints every time step
            spaced = viz.get_schedule_ops(SCHEDULES[schedule].torch_class, p, m, v, add_spacing=True)
        makespan = 0
        for actions in spaced:
            t = 0
            for a in actions:
                t += 1 if a is None else widths[a.computation_type.value]
                makespan = max(makespan, t) if a is not None else makespan
        ours = simulate(schedule, p, m, v)
        if schedule == "dualpipev":  # blocking on both inputs gives DeepSeek's formula exactly
            assert (makespan - ours.compute_time(0)) / ours.compute_time(0) == pytest.approx(
                bubble_formula(schedule, p, m, v), abs=1e-12
            )
        else:
            assert ours.makespan == makespan, schedule


# ----------------------------------------------------------------------------- activations
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (8, 16), (3, 7)])
def test_1f1b_holds_at_most_p_microbatches_and_exactly_p_on_rank_0(p, m):
    t = simulate("1f1b", p, m)
    assert [t.peak_activations(r) for r in range(p)] == [p - r for r in range(p)]
    assert simulate("afab", p, m).peak_activations(0) == m


@pytest.mark.parametrize(("p", "m", "v"), [(4, 8, 2), (4, 4, 2), (4, 6, 2), (2, 4, 3), (8, 16, 2)])
def test_interleaved_holds_its_warmup_plus_one(p, m, v):
    # torch's (and Megatron's) warm-up: (v-1) m_r + 2(p-1-r) forwards, m_r microbatches per round.
    m_r = m // max(1, m // p)
    t = simulate("interleaved_1f1b", p, m, v)
    assert [t.peak_activations(r) for r in range(p)] == [
        min(m * v, (v - 1) * m_r + 2 * (p - 1 - r) + 1) for r in range(p)
    ]
    # In layers of a rank: p + (p-1)/v microbatches on rank 0 (Narayanan et al. 2021) when p divides m.
    if m % p == 0 and m >= p * v:
        assert t.peak_activations(0) / v == pytest.approx(p + (p - 1) / v)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (8, 16)])
def test_zero_bubble_schedules_hold_1f1b_peak_on_every_rank(p, m):
    zb_h1, zbv, dualpipev = simulate("zero_bubble", p, m), simulate("zbv", p, m), simulate("dualpipev", p, 2 * m)
    for r in range(p):
        assert zb_h1.peak_activations(r) == p  # ZB-H1: 1F1B's rank-0 peak, on every rank
        assert zbv.peak_activations(r) == 2 * p  # 2p half-size stages: the same layers' worth
        assert dualpipev.peak_activations(r) == 2 * p + 1  # DeepSeek: PP + 1, PP = 2p stages


# ----------------------------------------------------------------------------- ordering
@pytest.mark.parametrize("costs", [OpCosts(1.0, 1.5, 0.5, p2p=0.25), OpCosts(2.0, 1.0, 0.0)])
@pytest.mark.parametrize(("schedule", "p", "m", "v"), LAYOUTS)
def test_every_op_waits_for_its_inputs_and_ranks_run_one_op_at_a_time(schedule, p, m, v, costs):
    t = simulate(schedule, p, m, v, costs)
    placement = stage_ranks(schedule, p, v)
    end = {}
    for op in t.ops:
        end["B" if op.kind == "BW" else op.kind, op.stage, op.microbatch] = (op.end, op.rank)
    last = p * v - 1
    for op in t.ops:
        assert op.rank == placement[op.stage]
        assert op.end - op.start == pytest.approx(costs.duration(op.kind))
        if op.kind == "F":
            dep = ("F", op.stage - 1, op.microbatch) if op.stage else None
        elif op.kind == "W":
            dep = ("B", op.stage, op.microbatch)
        else:
            dep = ("F", last, op.microbatch) if op.stage == last else ("B", op.stage + 1, op.microbatch)
        if dep is not None:
            dep_end, dep_rank = end[dep]
            assert op.start >= dep_end + (costs.p2p if dep_rank != op.rank else 0) - 1e-12, op
    for r in range(p):
        ops = t.rank_ops(r)
        assert all(a.end <= b.start + 1e-12 for a, b in itertools.pairwise(ops))


@pytest.mark.parametrize(("schedule", "p", "m", "v"), LAYOUTS)
def test_every_stage_and_microbatch_runs_one_forward_and_one_backward(schedule, p, m, v):
    t = simulate(schedule, p, m, v)
    for stage in range(p * v):
        for mb in range(m):
            kinds = sorted(op.kind for op in t.ops if (op.stage, op.microbatch) == (stage, mb))
            assert kinds in (["BW", "F"], ["B", "F", "W"]), (stage, mb, kinds)


def test_1f1b_order_is_torchs_step_loop():
    # Schedule1F1B._step_microbatches: p - rank warm-up forwards, then backward/forward pairs.
    assert [f"{k}{i}" for _, k, i in torch_order("1f1b", 4, 6, 1)[1]] == (
        "F0 F1 F2 BW0 F3 BW1 F4 BW2 F5 BW3 BW4 BW5".split()
    )


def test_dualpipev_overlapped_pairs_become_a_forward_then_a_backward():
    viz = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    kinds = {"F": "F", "I": "B", "W": "W", "B": "BW"}
    for rank, actions in enumerate(viz.get_schedule_ops("DualPipeV", 2, 4, 2)):
        flat = []
        for a in actions:
            for sub in a.sub_actions or (a,):
                flat.append((sub.stage_index, kinds[sub.computation_type.value], sub.microbatch_index))
        assert list(torch_order("dualpipev", 2, 4, 2)[rank]) == flat


# ----------------------------------------------------------------------------- rendering
def test_text_rendering_has_one_line_per_rank_and_one_cell_per_time_unit():
    assert simulate("1f1b", 2, 3, costs=OpCosts(1, 1, 0)).render_text() == (
        "rank 0 | F0  F1  .   BW0 F2  BW1 .   BW2\nrank 1 | .   F0  BW0 F1  BW1 F2  BW2 ."
    )
    t = simulate("interleaved_1f1b", 4, 8, 2)
    lines = t.render_text().splitlines()
    assert [line.split(" | ")[0] for line in lines] == [f"rank {r}" for r in range(4)]
    for line in lines:
        cells = line.split(" | ")[1].split()
        assert len(cells) == t.makespan  # unit = 1: F is one cell, BW two ("4BW0 ----")
        assert sum(c[1:2] == "F" for c in cells) == 8 * 2  # "0F3": stage 0, forward, microbatch 3


def test_png_rendering(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "zbv.png"
    simulate("zbv", 2, 4).render_png(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install matplotlib"):
        simulate("1f1b", 2, 2).render_png(tmp_path / "x.png")


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": "foo"}, r"PipelineParallel\(schedule='foo'\) is unknown; valid: afab, 1f1b, interleaved_1f1b"),
        ({"schedule": "dualpipev", "m": 6}, r"Parallel\(microbatches=6\) is fewer than .* = 8.*valid: 8 or more"),
        ({"schedule": "1f1b", "m": 2}, r"PipelineParallel\(microbatches=2\) is fewer than"),
        ({"schedule": "1f1b", "v": 2}, r"Parallel\(virtual_stages=2\) does not fit .*Parallel\(schedule='1f1b'\)"),
        ({"schedule": "zbv", "v": 3}, r"PipelineParallel\(virtual_stages=3\) does not fit .* valid: 2"),
        ({"schedule": "interleaved_1f1b", "m": 7, "p": 3}, r"microbatches=7\) must be a multiple of its rounds"),
        ({"p": 0}, r"PipelineParallel\(size=0\) must be a positive integer"),
    ],
)
def test_bad_layouts_raise_config_error(kwargs, message):
    args = {"schedule": "1f1b", "p": 4, "m": 8, "v": None} | kwargs
    for fn in (simulate, bubble_formula):
        with pytest.raises(ConfigError, match=message):
            fn(**args)


def test_negative_costs_raise_config_error():
    with pytest.raises(ConfigError, match=r"OpCosts.p2p=-1 must be >= 0"):
        OpCosts(1, 1, 1, p2p=-1)
