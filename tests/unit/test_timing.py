"""The benchmarks' paired timing (lightning_ultrascale.testing.timing): rounds, ratios, intervals."""

import itertools

import numpy as np
import pytest

from lightning_ultrascale.testing.timing import Alternation, PairedRatio, median_interval


def _arms(figures: dict[str, list[float | str]], calls: list[str]):  # type: ignore[no-untyped-def]
    streams = {name: iter(values) for name, values in figures.items()}

    def arm(name: str):  # type: ignore[no-untyped-def]
        def measure() -> float | str:
            calls.append(name)
            return next(streams[name])

        return measure

    return {name: arm(name) for name in figures}


def test_each_round_runs_every_arm_once_starting_with_the_baseline_then_rotated():
    calls: list[str] = []
    arms = _arms({"ours": [102.0] * 9, "ddp": [100.0] * 9, "other": [90.0] * 9}, calls)
    Alternation(arms, baseline="ddp", min_rounds=3, max_rounds=3, log=None).run()
    assert calls == ["ddp", "ours", "other", "ours", "other", "ddp", "other", "ddp", "ours"]


def test_a_steady_ratio_stops_at_the_fewest_pairs_that_give_an_interval_and_excludes_one():
    calls: list[str] = []
    alternation = Alternation(_arms({"ours": [102.0] * 40, "ddp": [100.0] * 40}, calls), baseline="ddp",
                              min_rounds=2, max_rounds=40, log=None)  # fmt: skip
    ratio = alternation.run()["ours"]
    assert len(ratio.ratios) == 6 and ratio.median == pytest.approx(1.02) and not ratio.straddles_one
    assert "excludes 1.0" in ratio.describe()


def test_noise_wider_than_the_target_runs_every_round_and_says_the_interval_straddles_one():
    rng = np.random.default_rng(0)
    noisy = [float(x) for x in 100 * (1 + 0.1 * rng.standard_normal(12))]
    calls: list[str] = []
    alternation = Alternation(_arms({"ours": noisy, "ddp": [100.0] * 12}, calls), baseline="ddp",
                              min_rounds=2, max_rounds=12, halfwidth=0.001, log=None)  # fmt: skip
    ratio = alternation.run()["ours"]
    assert len(ratio.ratios) == 12 and ratio.straddles_one and "no difference resolved" in ratio.describe()


def test_an_arm_that_measures_nothing_leaves_with_its_reason_and_a_baseline_that_cannot_ends_it():
    calls: list[str] = []
    arms = _arms({"ours": [101.0] * 3, "gpu_only": ["not measured: needs a GPU"], "ddp": [100.0] * 3}, calls)
    alternation = Alternation(arms, baseline="ddp", min_rounds=3, max_rounds=3, log=None)
    assert set(alternation.run()) == {"ours"} and alternation.not_measured == {"gpu_only": "not measured: needs a GPU"}
    calls.clear()
    stopped = Alternation(_arms({"ours": [1.0], "ddp": ["not measured: cpu"]}, calls), baseline="ddp", log=None)
    assert stopped.run() == {} and calls == ["ddp"] and stopped.not_measured == {"ddp": "not measured: cpu"}
    with pytest.raises(ValueError, match="baseline 'fsdp' is not one of the arms"):
        Alternation(arms, baseline="fsdp", log=None).run()


def test_the_bootstrap_interval_of_the_median_has_the_width_the_theory_gives():
    # 400 draws of N(1, 0.05): the median's standard error is 1.2533 * 0.05 / 20 = 0.0031, so a 95%
    # interval is about 0.0123 wide; bootstrap percentiles on one sample land within a factor 2 of it.
    values = list(1 + 0.05 * np.random.default_rng(0).standard_normal(400))
    low, high = median_interval(values)
    assert low < float(np.median(values)) < high
    assert 0.006 < high - low < 0.025
    assert median_interval([1.0, 1.01, 1.02, 1.03, 1.04]) == (float("-inf"), float("inf"))  # 5 values: no interval
    assert PairedRatio.of("a/b", [1.1]).as_dict()["ci_low"] is None  # JSON has no infinity


def test_the_interval_holds_the_true_median_about_as_often_as_its_level_says():
    # Percentile bootstrap of a median under-covers a little at few pairs: measured 91-92% for a nominal
    # 95% at 8 to 30 pairs of N(1, 0.1) ratios. Below 88% the intervals would claim differences that are noise.
    rng = np.random.default_rng(7)
    trials = [list(1 + 0.1 * rng.standard_normal(12)) for _ in range(300)]
    covered = sum(low <= 1.0 <= high for low, high in (median_interval(t, resamples=2000) for t in trials))
    assert covered / len(trials) >= 0.88


def test_the_same_ratios_give_the_same_interval():
    ratios = [1.0 + 0.01 * k for k in itertools.islice(itertools.cycle([3, -2, 5, 0, -1]), 15)]
    assert median_interval(ratios) == median_interval(list(ratios))
