"""The layout search and ``ultrascale-plan``'s table: what fits, what wins, why the others lose, and bad input.

Searches here pin part of the space (``space=``) so that each takes about a second.
"""

import math
import re

import pytest

from lightning_ultrascale.cli.plan import compose_run
from lightning_ultrascale.cli.plan import main as plan_main
from lightning_ultrascale.cli.train import RECIPES_DIR, plugins, workload
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import build_model, get_model_config
from lightning_ultrascale.plan import Candidate, NoLayoutFits, Workload, estimate, get_hardware, search

LLAMA_8B = get_model_config("llama3_8b")
SMALL_SPACE = {"cp": [1], "micro_batch_size": [1], "schedule": ["1f1b"], "hsdp": [False]}


def test_search_ranks_the_layouts_that_fit_fastest_first_and_each_is_priced_as_estimate_prices_it():
    workload = Workload(LLAMA_8B, seq_len=4096, global_batch_size=64)
    result = search(workload, world_size=8, gpu="h100", space=SMALL_SPACE)
    usable = get_hardware("h100").usable_bytes
    assert result.fitting and result.too_big
    assert all(p.peak <= usable for p in result.fitting) and all(p.peak > usable for p in result.too_big)
    speeds = [p.tokens_per_s for p in result.fitting]
    assert speeds == sorted(speeds, reverse=True)
    # The winner, priced again on its own, on every rank: the same numbers, and it fits on all of them.
    best = result.best.candidate
    assert best.world_size == 8
    costs = estimate(workload, best, build_model(LLAMA_8B, device="meta"), get_hardware("h100"), ranks=list(range(8)))
    assert max(c.peak for c in costs) == result.best.peak <= usable
    assert math.isclose(min(c.tokens_per_s for c in costs), result.best.tokens_per_s)
    # Layouts the plugins refuse never appear (tp must divide the 8 KV heads: tp=16 is not tried on 8 GPUs).
    assert all(8 % p.candidate.tp == 0 for p in result.fitting + result.too_big)


def test_tensor_parallelism_across_nodes_loses_and_the_search_says_why():
    # Nodes of 4 GPUs: tp=8 spans two of them (the playbook's collapse beyond a node).
    gpu = {"name": "h100x4", "peak_flops": 989e12, "memory_bytes": 80 * 2**30, "gpus_per_node": 4}
    workload = Workload(LLAMA_8B, seq_len=4096, global_batch_size=64)
    space = {**SMALL_SPACE, "tp": [4, 8], "pp": [1], "recompute": ["full"], "zero": [1]}
    result = search(workload, world_size=16, gpu=gpu, space=space)
    by_tp = {p.candidate.tp: p for p in result.fitting}
    assert by_tp[8].mfu < 0.8 * by_tp[4].mfu
    assert result.best.candidate.tp == 4
    rows = {family: why for family, _, why in result.alternatives()}
    assert "tensor parallelism across nodes (tp=8 > 4 GPUs per node)" in rows["tensor parallel across nodes"]


def test_an_out_of_memory_family_is_reported_with_how_much_it_misses_by():
    workload = Workload(LLAMA_8B, seq_len=8192, global_batch_size=64)
    result = search(workload, world_size=8, gpu="h100", space={**SMALL_SPACE, "recompute": ["none"]})
    rows = {family: (priced, why) for family, priced, why in result.alternatives()}
    priced, why = rows["data parallel only (ZeRO-1)"]
    over = (priced.peak - get_hardware("h100").usable_bytes) / 2**30
    assert why == f"out of memory by {over:.1f} GiB at its smallest" and over > 0


def test_a_model_that_fits_no_layout_gets_the_memory_it_needs_and_the_closest_layouts():
    workload = Workload(get_model_config("llama3_70b"), seq_len=8192, global_batch_size=64)
    with pytest.raises(NoLayoutFits) as err:
        search(workload, world_size=8, gpu="h100", space=SMALL_SPACE)
    message = str(err.value)
    assert "llama3_70b (seq_len=8192, global_batch_size=64) on 8 x h100: no layout fits in 74.0 GiB" in message
    assert "the smallest needs" in message and "Closest layouts:" in message
    assert message.count(" GiB (params ") == 3  # three layouts, each with its memory parts
    assert "more GPUs, a GPU with more memory (--gpu h200)" in message


@pytest.mark.parametrize(
    ("world", "gpu", "space", "message"),
    [
        (12, "h100", None, r"world_size=12 is not a whole number of h100 nodes \(8 GPUs each\); valid: 1..8 GPUs on "
                           r"one node, or a multiple of 8 \(e.g. 8 or 16\)"),
        (0, "h100", None, r"world_size=0 must be a positive number of GPUs"),
        (8, "b300", None, r"gpu=b300 is not a built-in profile; valid: h100, h200, a100"),
        (8, "h100", {"tpp": [2]}, r"search space key 'tpp' is unknown; valid: tp, pp, cp, micro_batch_size, zero, .*"),
        (8, "h100", {"tp": []}, r"search space tp=\[\] leaves nothing to search"),
        (8, "h100", {"tp": [3], "pp": [1], "cp": [1]}, r"no layout of llama3_8b .* no tp x pp x cp .* divides"),
    ],
)  # fmt: skip
def test_bad_search_input_is_refused_with_the_valid_choices(world, gpu, space, message):
    workload = Workload(LLAMA_8B, seq_len=4096, global_batch_size=64)
    with pytest.raises(ConfigError, match=message):
        search(workload, world_size=world, gpu=gpu, space=space)


def test_a_run_config_becomes_the_candidate_its_plugins_make():
    from lightning_ultrascale import ContextParallel, PipelineParallel, Recompute, TensorParallel, ZeRO

    plugins = [ZeRO(3, replicate=2), TensorParallel(4), PipelineParallel(2, "1f1b", 8), ContextParallel(2),
               Recompute("selective", every=2)]  # fmt: skip
    c = Candidate.from_plugins(plugins, world_size=64, micro_batch_size=16)
    assert (c.dp, c.replicate, c.zero, c.tp, c.pp, c.n_microbatches, c.cp) == (4, 2, 3, 4, 2, 8, 2)
    assert (c.micro_batch_size, c.recompute, c.recompute_every) == (2, "selective", 2)
    assert c.plugins[0].replicate == 2 and c.world_size == 64


def test_ultrascale_plan_prints_the_table_and_the_heatmap(tmp_path, capsys):
    png = tmp_path / "mfu.png"
    argv = ["model=llama3_8b", "data.seq_len=4096", "data.global_batch_size=64", "precision=bf16_mixed",
            "--world-size", "8", "--top", "3", "--space", "cp=1", "--space", "micro_batch_size=1",
            "--space", "schedule=1f1b", "--plot", str(png)]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        plan_main(argv)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "llama3_8b: seq_len 4096, global batch 64 (262,144 tokens), bf16-mixed, on 8 x h100" in out
    assert "  1  dp" in out and "  3  " in out and "  4  " not in out.split("Popular")[0]
    assert "Popular alternatives:" in out and "ZeRO-3 / FSDP only" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_ultrascale_plan_prices_an_fp8_recipe_and_says_so(capsys):
    # Before: precision=fp8_tensorwise printed bf16-mixed and bf16's tokens/s (FP8 priced at exactly 1.000).
    base = ["model=llama3_8b", "data.seq_len=4096", "data.global_batch_size=64", "--world-size", "8", "--top", "1",
            "--space", "cp=1", "--space", "micro_batch_size=1", "--space", "schedule=1f1b"]  # fmt: skip
    tokens = {}
    for precision in ("bf16_mixed", "fp8_tensorwise"):
        with pytest.raises(SystemExit):
            plan_main([*base, f"precision={precision}"])
        out = capsys.readouterr().out
        tokens[precision] = float(out.split("\n  1  ")[1].split("\n")[0].split()[-2].replace(",", ""))
    assert "bf16-mixed + FP8 tensorwise, on 8 x h100" in out and "MFU from the time model, against the bf16 peak" in out
    assert 1.1 < tokens["fp8_tensorwise"] / tokens["bf16_mixed"] < 1.6, tokens


def test_ultrascale_plan_takes_the_expert_load_a_router_shows(capsys):
    # The busiest expert rank sets an expert-parallel step: a skewed router (2.0) is slower than Megatron's
    # forced balance; a load under 1.0 or a word other than 'forced' is refused naming the option.
    base = ["model=moe_tiny", "data.seq_len=256", "data.global_batch_size=8", "precision=bf16_mixed",
            "--world-size", "2", "--top", "1", "--space", "ep=2", "--space", "micro_batch_size=1"]  # fmt: skip
    tokens = {}
    for load in ("forced", "2.0"):
        with pytest.raises(SystemExit):
            plan_main([*base, "--expert-load", load])
        line = capsys.readouterr().out.split("\n  1  ")[1].split("\n")[0]
        assert " ep2 " in line, line
        tokens[load] = float(line.split()[-2].replace(",", ""))
    assert tokens["2.0"] < tokens["forced"], tokens
    for bad in ("0.5", "skewed"):
        with pytest.raises(SystemExit):
            plan_main([*base, "--expert-load", bad])
        assert f"--expert-load={bad}: a number >= 1.0" in capsys.readouterr().err


def test_ultrascale_plan_exits_with_one_readable_line_when_nothing_fits(capsys):
    argv = ["model=llama3_70b", "data.seq_len=8192", "data.global_batch_size=64", "--world-size", "8",
            "--space", "cp=1", "--space", "micro_batch_size=1", "--space", "schedule=1f1b"]  # fmt: skip
    with pytest.raises(SystemExit, match=r"^ultrascale-plan: llama3_70b .* no layout fits in 74.0 GiB"):
        plan_main(argv)


def test_ultrascale_plan_names_an_override_the_config_does_not_have(capsys):
    # Before: a ConfigCompositionException traceback (the option is the precision group's).
    with pytest.raises(SystemExit) as exited:
        plan_main(["model=llama3_70b", "trainer.precision=bf16-mixed", "--world-size", "64"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("ultrascale-plan: trainer.precision=bf16-mixed: the config has no key 'trainer.precision'; "
                          "did you mean precision=bf16_mixed"), err  # fmt: skip
    assert "Traceback" not in err


def test_a_model_without_a_recipe_is_planned_in_bf16_mixed_and_says_so(capsys):
    from lightning_ultrascale.cli.plan import _gpu_precision

    base = ["model=llama3_8b", "data.seq_len=4096", "data.global_batch_size=64"]
    assert _gpu_precision(base, "h100")[0] == [*base, "precision=bf16_mixed"]
    for given in (["recipe=llama3_8b"], ["precision=fp32"], ["precision=fp8_tensorwise"]):
        assert _gpu_precision(given, "h100") == (given, None)  # what the user chose is planned
    assert _gpu_precision(base, "cpu") == (base, None)  # the CPU profile: the CPU job's fp32
    with pytest.raises(SystemExit):
        plan_main([*base, "--world-size", "8", "--top", "1", "--space", "cp=1", "--space", "schedule=1f1b"])
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert first.startswith("ultrascale-plan: planned in bf16-mixed, as the GPU recipes train"), first
    assert ", bf16-mixed, on 8 x h100" in second, second


RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))
HEADER = re.compile(r"# Planner \(ultrascale-plan, (\w+)\): peak ([\d.]+) GiB per GPU, MFU ([\d.]+)%")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_fits_its_gpu_as_its_header_says(recipe, monkeypatch):
    # GPU recipes state the planner's prediction for their layout in their header; it must be what
    # the planner predicts today, and fit. CPU recipes are priced on an H100 (they fit anywhere).
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun's variables, as on nodes of 8 GPUs
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = compose_run([f"recipe={recipe.stem}"])
    world = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
    work = workload(cfg)
    candidate = Candidate.from_plugins(plugins(cfg.parallel), world, int(cfg.data.micro_batch_size))
    header = HEADER.search(recipe.read_text())
    gpu = get_hardware(header.group(1) if header else "h100")
    costs = estimate(work, candidate, build_model(work.model, device="meta"), gpu)
    peak, mfu = max(c.peak for c in costs), min(c.mfu for c in costs)
    assert peak <= gpu.usable_bytes, (candidate.label(), peak / 2**30)
    if cfg.trainer.accelerator != "cpu":
        assert header, f"{recipe.name} has no '# Planner (ultrascale-plan, GPU): peak X GiB per GPU, MFU Y%' line"
        assert (float(header.group(2)), float(header.group(3))) == (round(peak / 2**30, 1), round(100 * mfu, 1))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # a batch no data-parallel size splits: which sizes, and the nearest batches that work
        (["--world-size", "6"], r"global_batch_size=64 is split by no number of data-parallel .*\(3, 6\).*63 or 66"),
        # sizes that divide nothing: the nearest world sizes they divide
        (["--world-size", "8", "--space", "tp=3"], r"no tp x pp x cp .* divides world_size=8 .*e\.g\. 6 or 9"),
    ],
)  # fmt: skip
def test_ultrascale_plan_says_why_there_is_no_layout_to_price(args, message):
    argv = ["model=llama3_8b", "data.seq_len=4096", "data.global_batch_size=64", *args]
    with pytest.raises(SystemExit, match=message):
        plan_main(argv)


def test_ultrascale_plan_takes_a_gpu_of_ones_own_and_gpu_as_an_override(capsys):
    from lightning_ultrascale.cli.plan import gpu_profile

    custom = gpu_profile("h100,memory_gib=24,peak_flops=500e12")
    assert (custom["memory_bytes"], custom["peak_flops"], custom["gpus_per_node"]) == (24 * 2**30, 500e12, 8)
    assert gpu_profile("name=mi300x,peak_flops=1307e12,memory_gib=192")["name"] == "mi300x"
    with pytest.raises(ConfigError, match="gpu keys speed are unknown"):
        gpu_profile("h100,speed=3")
    with pytest.raises(ConfigError, match="peak_flops='fast' is not a number"):
        gpu_profile("h100,peak_flops=fast")
    base = ["model=llama3_8b", "data.seq_len=4096", "data.global_batch_size=64", "--world-size", "8", "--top", "1"]
    for gpu, says in (["gpu=h200"], "8 x h200 (135 GiB"), (["--gpu", "h100,memory_gib=24"], "8 x h100 (18 GiB"):
        with pytest.raises(SystemExit) as exited:  # gpu=h200: as an override reads (it was refused)
            plan_main([*base, *gpu])
        assert exited.value.code == 0 and says in capsys.readouterr().out


def test_pipeline_sizes_that_split_the_blocks_are_searched():
    # Meta's and NVIDIA's 405B runs use pp9 (126 blocks): sizes that divide the blocks are searched
    # besides the powers of two.
    from lightning_ultrascale.plan.search import context_of, search_space

    def sizes(model: str, world: int) -> tuple[int, ...]:
        context = context_of(Workload(get_model_config(model), 8192, 1152), world, get_hardware("h100"))
        return search_space(context)["pp"].values

    assert sizes("llama3_405b", 576) == (1, 2, 3, 4, 6, 7, 8, 9, 14, 16, 18, 21, 32)
    assert {5, 10, 20} <= set(sizes("llama3_70b", 640))


def test_ultrascale_plan_prices_muon_and_says_so(capsys):
    base = ["model=llama3_8b", "data.seq_len=4096", "data.global_batch_size=64", "--world-size", "8", "--top", "1",
            "--space", "cp=1", "--space", "micro_batch_size=1", "--space", "zero=3", "--space", "tp=1",
            "--space", "pp=1"]  # fmt: skip
    optim_gib = {}
    for optim in ("adamw", "muon"):
        with pytest.raises(SystemExit):
            plan_main([*base, f"optim={optim}"])
        out = capsys.readouterr().out
        optim_gib[optim] = float(out.split("\n  1  ")[1].split("\n")[0].split()[-7])
    assert "bf16-mixed, Muon, on 8 x h100" in out
    # ZeRO-3 dp8 under bf16-mixed: AdamW keeps 8 bytes per parameter (m, v), Muon 4 for the blocks' matrices.
    assert 0.5 < optim_gib["muon"] / optim_gib["adamw"] < 0.6, optim_gib
