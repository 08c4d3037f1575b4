"""FP8 in the planner: derived from the recipes' GEMMs and quantisation and the GPU's measured FP8/bf16 ratios."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import build_model, get_model_config
from lightning_ultrascale.plan import Candidate, Workload, estimate, get_hardware
from lightning_ultrascale.plan.fp8 import efficiency_table
from lightning_ultrascale.plan.hardware import HOPPER_FP8

ROOT = Path(__file__).resolve().parents[2]
#: torchtitan's published FP8 run: Llama 3.1 70B on 256 H100, FSDP 32 x TP 8, local batch 16 of 8,192 tokens,
#: full recomputation, torch.compile (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md there): 597.3
#: tokens/s/GPU in bf16, 809.8 with float8 tensorwise, 1.36x.
TORCHTITAN_70B = Candidate.layout(dp=32, zero=3, tp=8, micro_batch_size=16, recompute="full", reduce_dtype="fp32")


def _tokens_per_s(model: str, layout: Candidate, gpu: str, **workload) -> float:
    config = get_model_config(model)
    w = Workload(config, workload.pop("seq_len", 8192), workload.pop("batch", 512), fused_kernels=True, **workload)
    return min(c.tokens_per_s for c in estimate(w, layout, build_model(model, device="meta"), get_hardware(gpu)))


def test_fp8_tensorwise_prices_llama3_70b_on_h100_within_the_published_range():
    bf16 = _tokens_per_s("llama3_70b", TORCHTITAN_70B, "h100")
    speedups = {r: _tokens_per_s("llama3_70b", TORCHTITAN_70B, "h100", fp8=r) / bf16 for r in
                ("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise")}  # fmt: skip
    # Before: FP8 was priced as bf16, exactly 1.000. Published 1.36x (torchtitan also all-gathers the
    # sequence-parallel activations in FP8, which this library does not: priced without it).
    assert 1.2 <= speedups["tensorwise"] <= 1.5, speedups
    # rowwise quantises each operand twice (its scales run along one axis); gw_hp keeps a third of the GEMMs
    # in bf16; blockwise's GEMM is the slowest FP8 kernel measured (1.38x bf16 at 8192^3)
    assert speedups["tensorwise"] > speedups["rowwise"] > speedups["rowwise_with_gw_hp"] > 1.0, speedups
    assert speedups["blockwise"] < speedups["rowwise_with_gw_hp"], speedups


def test_without_fp8_tensor_cores_the_recipes_emulate_and_only_cost():
    layout = Candidate.layout(dp=8, zero=3, micro_batch_size=1)
    bf16 = _tokens_per_s("llama3_8b", layout, "a100", batch=64)
    assert _tokens_per_s("llama3_8b", layout, "a100", batch=64, fp8="tensorwise") < bf16


def test_zero3_all_gathers_the_converted_weights_in_fp8():
    layout = Candidate.layout(dp=8, zero=3, micro_batch_size=1)
    model, w = build_model("llama3_8b", device="meta"), Workload(get_model_config("llama3_8b"), 8192, 64)
    gathered = {}
    for fp8, all_gather in ((None, True), ("tensorwise", True), ("tensorwise", False), ("rowwise", True)):
        [cost] = estimate(replace(w, fp8=fp8, fp8_all_gather=all_gather), layout, model)
        gathered[fp8, all_gather] = cost.comm["dp_shard:all_gather"]
    converted = 6_979_321_856  # the block linears (all but embedding, head and norms), gathered whole
    # 1 byte less per converted weight, gathered twice (forward, backward) in each of the 8 micro-steps
    assert gathered[None, True] - gathered["tensorwise", True] == 2 * 8 * converted
    assert gathered["tensorwise", False] == gathered["rowwise", True] == gathered[None, True]  # only tensorwise


def test_the_hopper_fp8_table_is_the_gpu_check_s_measurement():
    report = json.loads((ROOT / "benchmarks" / "results" / "gpu_check.json").read_text())
    assert "H100" in report["device"] or "H200" in report["device"], report["device"]
    assert efficiency_table(report) == dict(HOPPER_FP8)


def test_an_fp8_recipe_the_library_does_not_have_is_refused_by_name():
    config = get_model_config("llama_tiny")
    with pytest.raises(ConfigError, match="fp8='e4m3' is not a recipe; valid: tensorwise, rowwise"):
        Workload(config, 64, 4, fp8="e4m3")
    with pytest.raises(ConfigError, match="fp8='rowwise' trains on precision='32-true': valid: bf16-mixed"):
        Workload(config, 64, 4, precision="32-true", fp8="rowwise")
