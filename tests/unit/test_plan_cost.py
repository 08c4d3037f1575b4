"""The planner's cost model: formulas against the measured runs of ``benchmarks/plan.py`` and against the library."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import build_model, get_model_config
from lightning_ultrascale.plan.cost import Candidate, Workload, estimate
from lightning_ultrascale.plan.hardware import GPUS, H100_MATMUL_EFFICIENCY, get_hardware
from lightning_ultrascale.utils.comm import wire_bytes
from lightning_ultrascale.utils.memory import playbook_model_state_bytes

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results" / "plan.json"


def _results() -> dict:
    return json.loads(RESULTS.read_text())


def test_committed_measurements_cover_every_dim():
    layouts = _results()["layouts"]
    labels = " ".join(row["layout"] for row in layouts)
    assert len(layouts) >= 12 and not _results()["quick"]
    for part in ("zero0", "zero1", "zero2", "zero3", "tp2", "(no sp)", "(regather)", "1f1b", "afab", "interleaved_1f1b",
                 "zigzag_ring", "all_to_all", "ep2", "ac:full", "ac:selective/2", "ac:selective_op",
                 "acc2"):  # fmt: skip
        assert part in labels, part
    assert {row["model"] for row in layouts} == {"llama_tiny", "moe_tiny"}


def test_committed_predictions_are_what_the_cost_model_predicts_today():
    # The measurements are committed; the predictions beside them must be this code's (a change of
    # a formula without re-running benchmarks/plan.py fails here).
    bench = load_benchmark("plan")
    layouts = [(model, c, 1) for model, c in bench.LAYOUTS] + bench.ACCUMULATED
    assert [row["layout"] for row in _results()["layouts"]] == [
        c.label() + (f" acc{acc}" if acc > 1 else "") for _, c, acc in layouts
    ]
    for (model, c, acc), row in zip(layouts, _results()["layouts"]):
        workload = Workload(get_model_config(model), bench.SEQ_LEN, c.batch_per_rank * c.dp * acc, precision="32-true")
        meta = build_model(model, device="meta")
        costs = estimate(workload, c, meta, GPUS["cpu"], ranks=list(range(c.world_size)))
        assert [cost.peak for cost in costs] == [rank["predicted_peak"] for rank in row["ranks"]], row["layout"]


def test_communication_prediction_equals_traced_bytes_within_1_percent():
    for row in _results()["layouts"]:
        for rank in row["ranks"]:
            for dim, error in rank["comm_errors"].items():
                assert abs(error) <= 0.01, (row["layout"], rank["rank"], dim, error)


def test_collective_calls_are_the_traced_ones():
    # Each call pays a collective's latency (Hardware.collective_latency): the planner counts the calls every
    # technique makes per step, held against the traced runs of every layout (the once-a-step calls it leaves
    # out, a bucket of the replicated norms' gradients over tp or the router's statistics, are one or two).
    bench = load_benchmark("plan")
    for row in _results()["layouts"]:
        assert bench.calls_off(row["ranks"]) <= bench.CALLS_EXTRA, row["layout"]
        assert all(rank["predicted_calls_by_dim"] for rank in row["ranks"]) or row["world_size"] == 1


def test_memory_prediction_within_5_percent_of_measured_peak_on_12_layouts():
    # At least 12 layouts within the 5% on every rank. The others over-predict (README's
    # known gaps: the last pipeline stage counts every microbatch's gradients and outputs at once,
    # ZeRO-3 x TP, not yet explained): the safe side, held to 15%. No rank of any layout may be
    # under-predicted by more than 5%: a planner that says "fits" must not be the one that OOMs.
    within = 0
    for row in _results()["layouts"]:
        errors = [rank["memory_error"] for rank in row["ranks"]]
        assert min(errors) >= -0.05 and max(errors) <= 0.15, (row["layout"], errors)
        within += max(abs(e) for e in errors) <= 0.05
    assert within >= 20


def test_model_state_is_the_measured_one():
    # model_state_bytes after the step (ZeRO 0-3, PP, EP shards): the planner's count is exact up to
    # AdamW's step counters (4 bytes per tensor; ZeRO-1/2 keep one per bucket). Under TP the
    # measured gradients hold 40 KB more than the parameters (the vocabulary-parallel head's, not
    # yet explained): the total is held to 3% there.
    for row in _results()["layouts"]:
        for rank in row["ranks"]:
            measured, predicted = rank["measured_model_state"], rank["predicted_model_state"]
            if "tp" in row["layout"]:
                total = sum(predicted.values()) / sum(measured.values()) - 1
                assert abs(total) <= 0.03, (row["layout"], rank["rank"], total)
                continue
            for part, value in measured.items():
                assert abs(predicted[part] - value) <= 256, (row["layout"], rank["rank"], part, predicted, measured)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_follows_the_playbook_zero_formulas(stage):
    cfg = get_model_config("llama_tiny")
    workload = Workload(cfg, seq_len=64, global_batch_size=8, precision="32-true")
    [cost] = estimate(workload, Candidate.layout(dp=4, zero=stage, micro_batch_size=2), build_model(cfg, device="meta"))
    formula = playbook_model_state_bytes(cfg.num_params(), stage, dp=4, k_optimizer=8, mixed_precision=False)
    assert abs(cost.model_state["params"] - formula.params) <= 64 * 4  # torch.chunk rounding per tensor
    assert abs(cost.model_state["grads"] - formula.grads) <= 64 * 4
    assert abs(cost.model_state["optimizer"] - formula.optimizer_states) <= 64 * 8


def test_time_model_prefers_tp_inside_a_node():
    cfg = get_model_config("llama3_8b")
    workload = Workload(cfg, seq_len=4096, global_batch_size=64)
    meta, h100 = build_model(cfg, device="meta"), get_hardware("h100")
    layout = Candidate.layout(dp=2, zero=1, tp=8, micro_batch_size=1)
    inside = estimate(workload, layout, meta, h100)[0]
    across = estimate(workload, layout, meta, replace(h100, gpus_per_node=4))[0]  # tp spans two nodes
    strided = estimate(workload, layout, meta, replace(h100, gpus_per_node=1))[0]  # one tp rank a node
    assert 0 < strided.mfu < across.mfu < inside.mfu < 1
    # across two nodes of four, the rings leave each node on 4 NICs (a quarter of the bytes each); one rank a node,
    # every byte on the rank's own NIC
    assert inside.time_parts["tp"] * 1.8 < across.time_parts["tp"] < strided.time_parts["tp"] / 3


def test_invalid_layout_is_refused_by_the_plugins_own_validation():
    cfg = get_model_config("llama_tiny")
    workload = Workload(cfg, seq_len=64, global_batch_size=8, precision="32-true")
    with pytest.raises(ConfigError, match="n_heads=4"):
        estimate(workload, Candidate.layout(tp=8, micro_batch_size=8), build_model(cfg, device="meta"))


def test_bad_planner_input_names_the_option():
    with pytest.raises(ConfigError, match="gpu=b300 is not a built-in profile; valid: h100, h200, a100"):
        get_hardware("b300")
    with pytest.raises(ConfigError, match="gpu keys bandwidth are unknown"):
        get_hardware({"name": "x", "peak_flops": 1e15, "memory_bytes": 2**36, "bandwidth": 1})
    with pytest.raises(ConfigError, match="precision='fp16-mixed' is not planned; valid: 32-true, bf16-mixed"):
        Workload(get_model_config("llama_tiny"), seq_len=64, global_batch_size=8, precision="fp16-mixed")


def test_data_parallel_traffic_is_timed_on_its_group():
    # Group names join mesh dims that hold "_" themselves (dp_shard, dp_replicate_dp_shard): each
    # must resolve to its dims, or its traffic is timed on a group of one (0 s).
    cfg = get_model_config("llama3_8b")
    workload = Workload(cfg, seq_len=4096, global_batch_size=64)
    meta, h100 = build_model(cfg, device="meta"), get_hardware("h100")
    zero3 = estimate(workload, Candidate.layout(dp=8, zero=3, micro_batch_size=1), meta, h100)[0]
    hsdp = estimate(workload, Candidate.layout(dp=16, zero=3, replicate=2, micro_batch_size=1), meta, h100)[0]
    link = h100.intra_node_bandwidth * h100.link_efficiency
    gather = wire_bytes("all_gather", zero3.comm["dp_shard:all_gather"], 8) / link
    assert zero3.time_parts["dp_shard"] > gather > 0.01
    # HSDP: 8-way shards inside a node, 2 replicas across nodes (the slower link)
    across = wire_bytes("all_reduce", hsdp.comm["dp_replicate:all_reduce"], 2)
    assert hsdp.time_parts["dp_replicate"] > across / (h100.inter_node_bandwidth * h100.network_efficiency) > 0.01


# NVIDIA's published NeMo performance layouts on H100s (seq 8192, micro-batch 1, Megatron's
# distributed optimizer = ZeRO-1 over dp x cp; the performance recipes set grad_reduce_in_fp32 =
# False: bf16 gradients). Priced with fp32 weights, as before mixed precision kept bf16 ones, they
# needed 95.8 GiB (8B), 108.2 GiB (70B) and 135.0 GiB (405B).
NVIDIA_LAYOUTS = {
    "llama3_8b": (128, dict(dp=4, cp=2, zero=1)),
    "llama3_70b": (128, dict(dp=2, tp=4, pp=4, cp=2, virtual_stages=5, schedule="interleaved_1f1b", zero=1,
                             microbatches=64)),
    "llama3_405b": (252, dict(dp=4, tp=8, pp=9, cp=2, virtual_stages=7, schedule="interleaved_1f1b", zero=1,
                              microbatches=63)),
}  # fmt: skip


def _nvidia_peak(model: str, reduce_dtype: str = "bf16", as_run: bool = False) -> tuple[float, dict[str, int], int]:
    """``as_run``: as NeMo runs the layout: sequence shards regathered under TP, Transformer Engine's fused kernels."""
    batch, layout = NVIDIA_LAYOUTS[model]
    regather = as_run and layout.get("tp", 1) > 1
    candidate = Candidate.layout(**layout, regather=regather, reduce_dtype=reduce_dtype)
    workload = Workload(
        get_model_config(model), 8192, batch, precision="bf16-mixed", reduce_dtype=reduce_dtype, fused_kernels=as_run
    )
    costs = estimate(workload, candidate, build_model(model, device="meta"), get_hardware("h100"))
    worst = max(costs, key=lambda c: c.peak)
    return worst.peak / 2**30, worst.model_state, sum(p.numel() for p in build_model(model, device="meta").parameters())


def test_nvidia_8b_layout_fits_an_h100_under_mixed_precision():
    peak, state, psi = _nvidia_peak("llama3_8b")
    assert peak < get_hardware("h100").usable_bytes / 2**30  # 74 GiB; 69.6 predicted
    # bf16 weights and gradients whole, the fp32 master and Adam's moments over the 8 dp x cp ranks.
    assert state["params"] == state["grads"] == 2 * psi
    assert abs(state["optimizer"] / (12 * psi / 8) - 1) < 1e-3
    # Megatron's own default for bf16 (fp32 main gradients, our default too) needs 4 bytes of gradient.
    assert _nvidia_peak("llama3_8b", "fp32")[1]["grads"] == 4 * psi


@pytest.mark.parametrize(("model", "predicted", "as_run"), [("llama3_70b", 70.8, 54.3), ("llama3_405b", 109.4, 66.7)])
def test_nvidia_70b_and_405b_layouts_are_priced_as_the_readme_says(model, predicted, as_run):
    # Our defaults: the 70B fits (74 GiB usable) since our pipeline stages free each microbatch's buffers, outputs
    # and sent gradients once done with them (75.5 GiB while torch's stages kept every microbatch's until the step
    # ended; 96.1 while the last stage counted every microbatch's logits); the 405B does not. As NeMo runs them
    # (TensorParallel(regather=True): the sequence shards kept for backward, as Megatron-Core keeps them; and fused
    # norm/SwiGLU kernels, kernels=triton here) both fit.
    usable = get_hardware("h100").usable_bytes / 2**30
    assert round(_nvidia_peak(model)[0], 1) == predicted
    assert round(_nvidia_peak(model, as_run=True)[0], 1) == as_run < usable
    if model == "llama3_70b":
        assert _nvidia_peak(model)[0] < usable


def test_regather_prices_the_shards_kept_and_the_all_gathers_again():
    # Per block and token: the attention's and the SwiGLU's inputs kept as their tp share instead of whole, and one
    # more all-gather of each in backward (benchmarks/plan.py traces it on llama_tiny and moe_tiny).
    spec = build_model("llama3_8b", device="meta").spec
    workload = Workload(get_model_config("llama3_8b"), 4096, 1, precision="bf16-mixed")
    meta = build_model("llama3_8b", device="meta")
    plain, regather = (
        estimate(workload, Candidate.layout(tp=4, regather=r), meta, get_hardware("h100"), ranks=[0])[0]
        for r in (False, True)
    )
    tokens, h, layers = 4096, spec.dim, spec.n_layers
    assert plain.memory["activations"] - regather.memory["activations"] == pytest.approx(
        2 * layers * tokens * h * 2 * 3 / 4, abs=64
    )
    assert regather.comm["tp:all_gather"] - plain.comm["tp:all_gather"] == 2 * layers * tokens * h * 2
    assert regather.comm["tp:reduce_scatter"] == plain.comm["tp:reduce_scatter"]
    assert regather.step_time > plain.step_time  # (on the critical path here: no overlap of TP traffic)
    assert "tp4(regather)" in Candidate.layout(tp=4, regather=True).label()


def test_published_runs_are_priced_as_committed():
    # benchmarks/published_runs.py: the planner against runs others measured on GPUs. The committed
    # predictions must be today's (a formula change without a re-run fails here); the published
    # figures each name their source.
    root = Path(__file__).parents[2] / "benchmarks"
    bench = load_benchmark("published_runs")
    data = json.loads((root / "published" / "runs.json").read_text())
    committed = json.loads((root / "results" / "published_runs.json").read_text())
    assert len(data["runs"]) >= 7 and all(run["source"].startswith("https://") for run in data["runs"])
    for run, row in zip(data["runs"], committed["runs"], strict=True):
        predicted = bench.predict(run, bench.gpus(data))
        assert row["name"] == run["name"]
        assert predicted["tokens_per_s_per_gpu"] == pytest.approx(row["predicted"]["tokens_per_s_per_gpu"], rel=1e-9)
        assert predicted["peak_memory_gib"] == pytest.approx(row["predicted"]["peak_memory_gib"], rel=1e-9)
    # The judged runs (datasheet constants and the one fitted efficiency), within the targets; the
    # fit reproduced; published peaks within 15%.
    judged = [abs(r["throughput_ratio"] - 1) for r in committed["runs"] if r["role"] == "judged"]
    assert len(judged) >= 4 and sorted(judged)[len(judged) // 2] <= 0.10 and max(judged) <= 0.15
    assert committed["summary"]["max_abs_memory_error"] <= 0.15
    [fit] = [run for run in data["runs"] if run.get("role", "").startswith("fit")]
    assert round(bench.fit_matmul_efficiency(fit, bench.gpus(data)), 2) == H100_MATMUL_EFFICIENCY
    # Every run that trained on an 80 GB card fits, NVIDIA's 70B included (70.8 GiB of 74 usable), but the
    # runs whose stack keeps fewer activations than this library (each says why): those do not fit as this
    # library would run them, and the day they do, their exemption must go.
    too_big = [r["name"] for r in committed["runs"] if not r["predicted"]["fits"]]
    assert too_big == [r["name"] for r in committed["runs"] if r["memory_not_comparable"]]


def test_fp32_runs_are_timed_at_the_tf32_peak_not_the_bf16_one():
    # fp32 matmuls run as TF32 on CUDA (the strategy's tf32=True): half the bf16 tensor-core peak.
    model, candidate = build_model("llama3_1b", device="meta"), Candidate.layout(dp=8, zero=1)
    h100 = get_hardware("h100")

    def compute(precision: str) -> tuple[float, float]:
        workload = Workload(get_model_config("llama3_1b"), 4096, 64, precision=precision)
        [cost] = estimate(workload, candidate, model, h100, ranks=[0])
        return cost.time_parts["compute"], cost.mfu

    (fp32, fp32_mfu), (bf16, bf16_mfu) = compute("32-true"), compute("bf16-mixed")
    assert fp32 / bf16 == pytest.approx(989 / 494.5)
    assert fp32_mfu == pytest.approx(bf16_mfu, rel=0.05)  # each against its own peak (compute-bound here)


def test_mla_s_latents_are_priced_as_its_block_keeps_them():
    # What multi-head latent attention keeps for backward beside q, k, v and o, counted on the storages a one-block
    # model's forward leaves alive (LiveStorages) against the planner's activations, to the byte: a query latent
    # (its norm's input, x * rstd, output and rstd), a wider key latent (wkv_a's output, its norm's x * rstd and
    # output), a wider rotary part (the latent's rope rows and the cos/sin tables). Wider nope parts: the planner
    # prices a third tensor per head (the values' storage, which wkv_b writes beside the keys' nope part: flash
    # attention saves the values as a view of it) where the CPU's math attention copies the values (two).
    import torch

    from lightning_ultrascale.models.common.mla import MLAConfig
    from lightning_ultrascale.testing.storages import LiveStorages

    base, tokens = replace(get_model_config("llama_tiny"), n_layers=1), 2 * 64

    def kept(cfg) -> int:
        model = build_model(cfg, seed=0)
        with LiveStorages() as live:
            logits = model(torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)))
        return live.alive_bytes(*model.parameters(), *model.buffers(), logits)

    def priced(cfg) -> int:
        workload, layout = Workload(cfg, 64, 2, precision="32-true"), Candidate.layout(micro_batch_size=2)
        return estimate(workload, layout, build_model(cfg, device="meta"), GPUS["cpu"])[0].memory["activations"]

    def mla(**change):
        widths = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16) | change
        return replace(base, mla=MLAConfig(**widths), name="mla_tiny")

    reference = mla()
    for change in (dict(q_lora_rank=48), dict(kv_lora_rank=64), dict(qk_rope_head_dim=16)):
        assert kept(mla(**change)) - kept(reference) == priced(mla(**change)) - priced(reference), change
    wider = mla(qk_nope_head_dim=32)
    per_head = tokens * base.n_heads * 16 * 4  # one more fp32 tensor of 16 more per head
    assert priced(wider) - priced(reference) == 3 * per_head and kept(wider) - kept(reference) == 2 * per_head
