"""Mixture of experts and expert parallelism: routers, balancing, dispatch, parity of every layout, bad input."""

import math
from dataclasses import replace

import lightning as L
import pytest
import torch
from llama_runs import (
    ADAMW,
    DEEPSEEK_V3_TINY,
    GLOBAL_BATCH,
    SEQ_LEN,
    SGD,
    SaveCheckpoint,
    assert_adamw_moe_parity,
    run_tiny_llama,
)
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ultrascale import (
    ContextParallel,
    ExpertParallel,
    LlamaModule,
    PipelineParallel,
    Recompute,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import build_model, get_model_config
from lightning_ultrascale.models.common.moe import GroupedExperts, MoE, MoEConfig, attach_aux_loss
from lightning_ultrascale.parallel.context.attention import local_positions
from lightning_ultrascale.parallel.dims import ParallelDims
from lightning_ultrascale.parallel.pipeline.schedules import SCHEDULES
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import QUIET_TRAINER, ParityRecorder, RunRecord, assert_parity, record_run

MOE_TINY = get_model_config("moe_tiny")  # DeepSeek-V3 routing: sigmoid, groups, shared expert, bias
# Mixtral routing: softmax top-2 renormalised, no shared expert, every block MoE, z-loss on.
MIXTRAL_TINY = replace(
    MOE_TINY,
    name="mixtral_tiny",
    moe=MoEConfig(n_routed_experts=8, top_k=2, moe_ffn_dim=64, aux_loss="sequence", z_loss_coeff=1e-3),
)


# ------------------------------------------------------------------------------------ routers
def _assert_same_routing(ours, weights: torch.Tensor, experts: torch.Tensor) -> None:
    """Same experts and weights per token, in any order within the token's top-k (torch.topk(sorted=False))."""
    order, hf_order = ours.experts.sort(-1).indices, experts.sort(-1).indices
    assert torch.equal(ours.experts.gather(1, order), experts.gather(1, hf_order))
    torch.testing.assert_close(ours.weights.gather(1, order), weights.gather(1, hf_order))


def test_mixtral_router_matches_transformers():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    hf = MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2))
    torch.nn.init.normal_(hf.weight)
    moe = MoE(16, MoEConfig(n_routed_experts=8, top_k=2, moe_ffn_dim=16))
    moe.router.weight.data.copy_(hf.weight)
    x = torch.randn(32, 16)
    _assert_same_routing(moe.router(x), *hf(x)[1:])


def test_deepseek_router_matches_transformers_with_groups_and_bias():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(
        hidden_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5
    )
    hf = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(hf.weight)
    hf.e_score_correction_bias.normal_(std=0.1)
    moe = MoE(16, replace(MOE_TINY.moe, routed_scaling_factor=2.5))
    moe.router.weight.data.copy_(hf.weight)
    moe.router.expert_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(64, 16)
    _assert_same_routing(moe.router(x), *hf(x)[1:])


def test_group_limit_keeps_every_choice_inside_topk_group_groups():
    moe = MoE(16, MOE_TINY.moe)  # 4 groups of 2 experts, 2 groups chosen
    torch.nn.init.normal_(moe.router.weight)
    experts = moe.router(torch.randn(256, 16)).experts
    assert (experts // 2).unique(dim=None).numel() > 2  # groups differ between tokens
    for row in experts // 2:
        assert row.unique().numel() <= 2


# ------------------------------------------------------------------------------------ experts
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_the_per_expert_loop_with_uneven_and_empty_groups(dtype):
    torch.manual_seed(0)
    grouped, loop = GroupedExperts(4, 32, 64, "grouped_mm"), GroupedExperts(4, 32, 64, "loop")
    for p in grouped.parameters():
        torch.nn.init.normal_(p, std=0.1)
    loop.load_state_dict(grouped.state_dict())
    grouped.to(dtype), loop.to(dtype)
    counts = torch.tensor([5, 0, 11, 3])
    x = torch.randn(19, 32, dtype=dtype)
    outs = []
    for experts in (grouped, loop):
        xi = x.clone().requires_grad_()
        y = experts(xi, counts)
        (y * torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y)).sum().backward()
        outs.append((y, xi.grad, experts.w1.grad, experts.w2.grad))
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, **tol)


def test_capacity_factor_drops_the_overflow_and_counts_it():
    cfg = replace(MIXTRAL_TINY.moe, capacity_factor=0.5)
    moe = MoE(16, cfg).train()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(1, 64, 16)
    moe(x)
    load, dropped, _ = moe.pop_load()
    capacity = 64 * 2 * 0.5 / 8
    assert dropped == (load - capacity).clamp(min=0).sum() > 0
    dropless = MoE(16, replace(cfg, capacity_factor=None)).train()
    dropless.load_state_dict(moe.state_dict())
    assert not torch.equal(dropless(x), moe(x))  # dropped tokens lose their routed experts' output


# ------------------------------------------------------------------------------------ balancing
def test_sequence_aux_loss_is_the_published_formula():
    cfg = replace(MOE_TINY.moe, aux_loss_coeff=0.1)
    moe = MoE(16, cfg).train()
    torch.nn.init.normal_(moe.router.weight)
    x = torch.randn(3, 10, 16)
    routing = moe.router(x.view(-1, 16))
    moe(x)
    expected = 0.0
    for seq in range(3):
        rows = slice(seq * 10, (seq + 1) * 10)
        hits = torch.zeros(10, 8).scatter_(1, routing.experts[rows], 1.0)
        f = hits.sum(0) * 8 / (2 * 10)
        p = routing.probs[rows].mean(0)
        expected += 0.1 * (f * p).sum()  # DeepSeek-V3 eq. 17-20, one sequence
    # The layer returns the sum over tokens: a sequence's loss times its length.
    torch.testing.assert_close(moe.pop_aux_loss(), expected * 10)


def test_aux_free_bias_moves_towards_the_mean_load():
    moe = MoE(16, replace(MOE_TINY.moe, bias_update_rate=0.01))
    moe.router.update_bias(torch.tensor([10.0, 2, 6, 6, 6, 6, 6, 6]))
    assert moe.router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0, 0, 0, 0, 0, 0])


def test_attached_aux_loss_gets_the_given_weight():
    x = torch.randn(4, requires_grad=True)
    aux = torch.tensor(2.0, requires_grad=True)
    (attach_aux_loss(x * 1, aux * 3, torch.tensor(0.25)) * 2).sum().backward()
    assert float(aux.grad) == 0.75 and torch.equal(x.grad, torch.full((4,), 2.0))


def test_recomputed_forward_counts_tokens_once():
    model = build_model(MOE_TINY).train()
    plain = model(torch.randint(0, 320, (2, 16)))
    plain.sum().backward()
    loads = model.expert_stats().loads
    checkpointed = build_model(MOE_TINY).train()
    from torch.utils.checkpoint import checkpoint

    block = checkpointed.layers["1"]
    block.forward = lambda *a, f=block.forward: checkpoint(f, *a, use_reentrant=False)
    checkpointed(torch.randint(0, 320, (2, 16))).sum().backward()
    again = checkpointed.expert_stats().loads
    assert torch.equal(loads.sum(-1), again.sum(-1)) and float(loads[0].sum()) == 2 * 16 * 2


# ------------------------------------------------------------------------------------ model configs
@pytest.mark.parametrize(
    ("name", "total", "active", "active_embedding"),
    [
        ("mixtral_8x7b", 46.7e9, 12.9e9, True),  # Mistral count the embedding as active
        ("deepseek_v2_lite", 15.7e9, 2.4e9, False),  # DeepSeek do not (a lookup: no FLOPs)
        ("deepseek_v3", 671e9, 37e9, False),
    ],
)
def test_published_parameter_counts_on_the_meta_device(name, total, active, active_embedding):
    cfg = get_model_config(name)
    model = build_model(name, device="meta")
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert cfg.num_params() == pytest.approx(total, rel=5e-3)
    embedding = 0 if active_embedding else cfg.vocab_size * cfg.dim
    # Published active counts are rounded to 2 digits (DeepSeek-V2-Lite's 2.45B is "2.4B").
    assert cfg.num_params(active=True) - embedding == pytest.approx(active, rel=2.5e-2)
    # Active parameters: attention, norms, embedding, output head, dense blocks, shared experts
    # and top_k of the routed experts; the routed rest is what an MoE block does not run.
    moe = cfg.moe
    idle = len(cfg.moe_blocks()) * (moe.n_routed_experts - moe.top_k) * moe.expert_params(cfg.dim)
    assert cfg.num_params() - cfg.num_params(active=True) == idle


def test_moe_tiny_is_small_and_has_dense_and_moe_blocks():
    model = build_model("moe_tiny")
    assert 1e5 < sum(p.numel() for p in model.parameters()) < 1e6
    assert list(model.moe_layers()) == ["1", "2", "3"]


# ------------------------------------------------------------------------------------ parity
def _moe_reference(model, optim=SGD):
    return run_tiny_llama(optim, model=model, steps=3)


@pytest.fixture(scope="module")
def moe_reference() -> RunRecord:
    return _moe_reference(MOE_TINY)


def _assert_bias_parity(run: RunRecord, ref: RunRecord) -> None:
    biases = [n for n in ref.buffers if n.endswith("expert_bias")]
    assert biases and any(float(ref.buffers[n].abs().max()) > 0 for n in biases)  # the bias did move
    for name in biases:
        assert run.buffer_spread.get(name, 0.0) == 0.0, f"{name} differs between ranks"
        torch.testing.assert_close(run.buffers[name], ref.buffers[name], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("plugins", "world_size"),
    [
        (lambda: [ExpertParallel(4)], 4),
        (lambda: [ExpertParallel(2), ZeRO(stage=1)], 4),
        (lambda: [ExpertParallel(2), ZeRO(stage=2)], 4),
        (lambda: [ExpertParallel(2), ZeRO(stage=3)], 4),
        (lambda: [ExpertParallel(2), TensorParallel(2)], 4),
        (lambda: [ExpertParallel(2), ContextParallel(2), Recompute("full")], 2),
    ],
    ids=["ep4", "ep2-zero1", "ep2-zero2", "ep2-zero3", "ep2xtp2", "ep2xcp2-recompute"],
)
def test_expert_parallel_matches_one_process(plugins, world_size, moe_reference):
    # ep2 over the context ranks, with the full recomputation that re-runs the dispatch and must
    # count the tokens once (the routing bias below). ep2 over the data ranks alone: the ep2 cells
    # of test_every_pipeline_schedule_trains_moe_with_parity (with pp2: 1f1b, zbv, dualpipev) and
    # test_ep2_with_adamw_and_gradient_accumulation_matches_one_process.
    run = run_tiny_llama(SGD, plugins, world_size=world_size, model=MOE_TINY, steps=3, dp=_dp(plugins, world_size))
    assert_parity(run, moe_reference, rtol=1e-5)
    _assert_bias_parity(run, moe_reference)


# Microbatches of each schedule at pp=2 (looped and V schedules hold 2 stages per rank).
MICROBATCHES = {
    "afab": 2,
    "1f1b": 2,
    "interleaved_1f1b": 4,
    "looped_bfs": 2,
    "zero_bubble": 2,
    "zbv": 4,
    "dualpipev": 4,
}


@pytest.fixture(scope="module")
def deepseek_reference() -> RunRecord:
    return _moe_reference(DEEPSEEK_V3_TINY)


def test_the_schedule_table_is_covered():
    assert MICROBATCHES.keys() == SCHEDULES.keys()


# Expert parallelism where a schedule could meet its all-to-alls: a split backward with two stages
# per rank (zbv; dualpipev, which also overlaps one micro-batch's forward with another's backward),
# and 1f1b; the others without it (each dispatch pairs the same stage of two pipelines that run one
# schedule, so the order of the dispatches is the schedule's on both).
EP_SCHEDULES = {"1f1b", "zbv", "dualpipev"}


@pytest.mark.parametrize("schedule", list(MICROBATCHES))
def test_every_pipeline_schedule_trains_moe_with_parity(schedule, deepseek_reference):
    # The split-backward schedules (zero_bubble, zbv, dualpipev) detach_() each stage's output;
    # the aux loss's attachment made it a view and every first backward failed.
    # One cell per schedule, on DeepSeek-V3-tiny: moe_tiny's MoE blocks with MLA attention (not
    # crossed with moe_tiny: the same MoE blocks, its attention under every schedule in
    # tests/multiprocess/test_pipeline.py).
    ep = 2 if schedule in EP_SCHEDULES else 1
    pipeline = lambda: [PipelineParallel(2, schedule, MICROBATCHES[schedule])]  # noqa: E731
    plugins = (lambda: [*pipeline(), ExpertParallel(2)]) if ep > 1 else pipeline
    run = run_tiny_llama(SGD, plugins, world_size=2 * ep, dp=ep, model=DEEPSEEK_V3_TINY, steps=3)
    assert_parity(run, deepseek_reference, rtol=1e-5)
    _assert_bias_parity(run, deepseek_reference)


def _dp(plugins, world_size):
    dims = UltraScaleStrategy(*plugins()).resolve_dims(world_size)
    return dims.dp


# Two experts over ep=2 on 4 ranks: one expert per rank, two ZeRO-3 ranks (edp) per expert. Dim 0
# (the expert dim, size 1) cannot be split over them; ZeRO-3 splits dim 1 instead.
FEW_EXPERTS = replace(MIXTRAL_TINY, name="mixtral_tiny_2e", moe=replace(MIXTRAL_TINY.moe, n_routed_experts=2))
# Mixtral has no dense width of its own: HF's intermediate_size is the experts' (the expert weights are unchanged).
FEW_EXPERTS_HF = replace(FEW_EXPERTS, ffn_hidden_dim=FEW_EXPERTS.moe.moe_ffn_dim)


@pytest.fixture(scope="module")
def few_experts_from_hf(tmp_path_factory) -> tuple[RunRecord, RunRecord, RunRecord]:
    """FEW_EXPERTS imported from a Hugging Face Mixtral: one process, ep2 x ZeRO-3 on 4 ranks, and a fresh init."""
    transformers = pytest.importorskip("transformers")
    from lightning_ultrascale.models.hf.convert import config_to_hf, hf_architecture

    directory = tmp_path_factory.mktemp("few_experts_hf")
    torch.manual_seed(1)
    config_class, model_class = (getattr(transformers, c) for c in hf_architecture(FEW_EXPERTS_HF))
    model_class(config_class(**config_to_hf(FEW_EXPERTS_HF))).save_pretrained(directory)

    def run(plugins, world_size):
        module = lambda: LlamaModule(FEW_EXPERTS_HF, optim=SGD, init_from=f"hf:{directory}")  # noqa: E731
        data = lambda: UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // world_size, seed=0)  # noqa: E731
        strategy = (lambda: UltraScaleStrategy(*plugins())) if plugins else None
        return record_run(module, data, steps=2, strategy=strategy, world_size=world_size)

    fresh = run_tiny_llama(SGD, model=FEW_EXPERTS_HF, steps=1)
    return run(None, 1), run(lambda: [ExpertParallel(2), ZeRO(stage=3)], 4), fresh


def test_zero3_splits_each_expert_over_its_ranks_when_they_outnumber_the_experts(few_experts_from_hf):
    from lightning_ultrascale.plan import dry_run, predict_shards

    plugins = lambda: [ExpertParallel(2), ZeRO(stage=3)]  # noqa: E731
    model = build_model(FEW_EXPERTS_HF, device="meta")
    w1 = "layers.0.feed_forward.experts.w1"
    full = tuple(model.get_parameter(w1).shape)  # (2, 64, dim)
    for rank in range(4):
        plan = predict_shards(UltraScaleStrategy(*plugins()), model, 4, rank)
        assert plan.shapes[w1] == (1, full[1] // 2, full[2]), plan.shapes[w1]  # half of one expert each
        meta = lambda: build_model(FEW_EXPERTS_HF, device="meta")  # noqa: E731
        assert dry_run(lambda: UltraScaleStrategy(*plugins()), meta, 4, rank) == plan.shapes
    # That layout trains like one process (from imported weights: the run the next test reads).
    one, split, _ = few_experts_from_hf
    assert_parity(split, one, rtol=1e-5)


def test_hf_weights_load_into_zero3_shards_inside_each_expert(few_experts_from_hf):
    # The same layout imports a Hugging Face Mixtral: each rank reads its half of its expert's rows
    # (was NotImplementedError: "expert weights split inside an expert cannot load from HF").
    one, split, fresh = few_experts_from_hf
    assert_parity(split, one, rtol=1e-5)
    assert abs(fresh.losses[0] - one.losses[0]) > 1e-3  # the import's weights, not a fresh init


def test_ep2_with_adamw_and_gradient_accumulation_matches_one_process():
    # On DeepSeek-V3-tiny: its AdamW losses at ep2, with 2 micro-batches per step (the loss
    # normaliser and the experts' gradients over accumulation). Its parameters, with SGD (AdamW's
    # reached 1.83e-4 against a 2e-4 bound: no margin): the ep2 cells of
    # test_every_pipeline_schedule_trains_moe_with_parity (pp2 x ep2, 1e-5).
    adamw = run_tiny_llama(
        ADAMW, lambda: [ExpertParallel(2)], world_size=2, model=DEEPSEEK_V3_TINY, steps=3, accumulate=2
    )
    assert_adamw_moe_parity(adamw, run_tiny_llama(ADAMW, model=DEEPSEEK_V3_TINY, steps=3))


# ------------------------------------------------------------------------------------ bad input
def test_bad_expert_layouts_fail_before_any_process_group():
    spec = build_model("moe_tiny", device="meta").spec
    with pytest.raises(ConfigError, match=r"parallel.ep=3 must divide n_experts=8 of model moe_tiny; valid: 1, 2, 4"):
        ParallelDims(dp_shard=6, ep=3).validate_model(spec)
    pool = r"parallel.ep=8 must divide the data-parallel and tensor-parallel ranks .* = 4 \(experts borrow those"
    with pytest.raises(ConfigError, match=pool):
        ParallelDims(dp_shard=2, tp=2, ep=8).validate(world_size=4)
    ParallelDims(dp_shard=2, tp=2, ep=4).validate_model(spec)  # (MoE parallel folding: ep spans the tp ranks)
    unfolded = replace(spec, moe_folds_tp=False)  # (transformers' MoE layers under model=hf)
    with pytest.raises(ConfigError, match=r"parallel.ep=4 must divide the data-parallel ranks .* = 2: model moe_tiny"):
        ParallelDims(dp_shard=2, tp=2, ep=4).validate_model(unfolded)
    dense = build_model("llama_tiny", device="meta").spec
    strategy = UltraScaleStrategy(ExpertParallel(2))
    with pytest.raises(ConfigError, match=r"ExpertParallel\(size=2\) splits MoE experts, but model llama_tiny has no"):
        strategy.validate(dense, world_size=2)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"top_k": 9}, r"model.moe.top_k=9 must be at most model.moe.n_routed_experts=8; valid: 1..8"),
        ({"n_group": 3}, r"model.moe.n_group=3 must divide model.moe.n_routed_experts=8; valid: 1, 2, 4, 8"),
        ({"topk_group": 5}, r"model.moe.topk_group=5 must be at most model.moe.n_group=4; valid: 1..4"),
        ({"capacity_factor": 0.0}, r"model.moe.capacity_factor=0.0 must be > 0 \(e.g. 1.25\), or null for dropless"),
        ({"router": "relu"}, r"model.moe.router='relu' is unknown; valid: softmax, sigmoid"),
    ],
)
def test_bad_moe_options_name_the_option_the_value_and_what_is_valid(change, message):
    with pytest.raises(ConfigError, match=message):
        replace(MOE_TINY, moe=replace(MOE_TINY.moe, **change)).validate()


# ------------------------------------------------------------------------------------ checkpoints
EP_LAYOUTS = {"one": (1, list, 1)}
EP_LAYOUTS["ep2-zero3"] = (2, lambda: [ExpertParallel(2), ZeRO(stage=3)], 2)
# A sharded optimizer's flat ranges of the 3-D expert weights are several 3-D boxes (saving failed).
EP_LAYOUTS["zero1-dp2"] = (2, lambda: [ZeRO(stage=1)], 2)
# Experts run on a placement re-computed after each step (saved after two re-placements), resumed under ep4.
EP_LAYOUTS["ep2-eplb"] = (2, lambda: [ExpertParallel(2, redundant_experts=2, rebalance_every=1)], 2)
EP_LAYOUTS["ep4"] = (4, lambda: [ExpertParallel(4)], 4)
CHAIN_STEPS = 12


def _fit_moe(layout: str, stop_at: int, ckpt_path: str | None, save_to: str | None) -> RunRecord:
    world_size, plugins, dp = EP_LAYOUTS[layout]
    L.seed_everything(0, verbose=False)
    recorder = ParityRecorder()
    callbacks = [recorder] + ([SaveCheckpoint(save_to, step=stop_at, stop=True)] if save_to else [])
    trainer = L.Trainer(  # max_steps: the whole chain's, which the learning-rate schedule spans
        accelerator="cpu", devices=world_size, strategy=UltraScaleStrategy(*plugins()), max_steps=CHAIN_STEPS,
        callbacks=callbacks, **QUIET_TRAINER,
    )  # fmt: skip
    data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // dp, seed=0)
    trainer.fit(LlamaModule("moe_tiny", optim=ADAMW), datamodule=data, ckpt_path=ckpt_path)
    return recorder.record


def test_expert_checkpoints_reshard_between_ep_layouts(tmp_path):
    # The experts are one global Shard(0) dim: DCP reshards them like any other DTensor.
    # A chain: each layout resumes from the last one's checkpoint, trains 2 AdamW steps (the second
    # one's loss reads the restored moments) and saves for the next. Each layout saves once and
    # loads once, and every link changes how the experts lie (whole, Shard(0) over ep run on a placement
    # with replicas, Shard(0) over 4 ranks, also split inside each expert, whole with flat optimizer ranges).
    chain = ["one", "ep2-eplb", "ep4", "ep2-zero3", "zero1-dp2", "one"]
    assert 2 * len(chain) == CHAIN_STEPS
    full = run_tiny_llama(ADAMW, steps=CHAIN_STEPS, model="moe_tiny")
    saved = None
    for i, layout in enumerate(chain):
        save_to = str(tmp_path / f"{i}-{layout}") if i < len(chain) - 1 else None
        run = run_pooled(_fit_moe, EP_LAYOUTS[layout][0], layout, 2 * i + 2, saved, save_to, timeout_s=300)[0]
        assert len(run.losses) == 2
        # AdamW on a MoE model: losses only (assert_adamw_moe_parity says why); a wrong expert shard
        # or moment after the resume moves them by far more than 1e-5.
        reference = RunRecord(full.losses[2 * i : 2 * i + 2], full.grads[2 * i : 2 * i + 2], full.params)
        assert_parity(run, reference, rtol=1e-5, grad_rtol=math.inf, check_params=False)
        saved = save_to


# ------------------------------------------------------------------------------------ metrics
def _fit_metrics(plugins, world_size: int) -> dict[str, float]:
    def worker() -> dict[str, float]:
        L.seed_everything(0, verbose=False)
        strategy = UltraScaleStrategy(*plugins()) if plugins else "auto"
        trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=3, **QUIET_TRAINER)
        module = LlamaModule(MOE_TINY, optim=SGD)
        trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH))
        return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("moe/", "train/aux"))}

    return run_pooled(worker, world_size)[0]


def test_balance_metrics_under_pipeline_parallelism_equal_one_process():
    # Stage 0 holds MoE block 1, stage 1 blocks 2 and 3: rank 0 logs every block's bias range and
    # the aux loss of both stages.
    one = _fit_metrics(None, 1)
    pp2 = _fit_metrics(lambda: [PipelineParallel(2, schedule="1f1b", microbatches=2)], 2)
    assert {f"moe/layer{b}/bias_range" for b in (1, 2, 3)} <= one.keys() and "train/aux_loss" in one
    assert one.keys() == pp2.keys()
    for key, value in one.items():
        assert abs(pp2[key] - value) <= 1e-5 * abs(value) + 1e-9, (key, pp2[key], value)
    assert one["moe/layer3/bias_range"] > 0 and one["train/aux_loss"] > 0


# ------------------------------------------------------------------------------------ capacity
# capacity_factor=1.0: an expert keeps each sequence's first ceil(S k / E) = 16 of 64 x 2 routed slots.
CAPPED = replace(MIXTRAL_TINY, name="mixtral_tiny_capped", moe=replace(MIXTRAL_TINY.moe, capacity_factor=1.0))


def _kept_slots(method: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``within_capacity`` of 3 sequences of 64 tokens as this rank holds them, and their positions."""
    moe = MoE(16, CAPPED.moe)
    generator = torch.Generator().manual_seed(0)
    for p in moe.parameters():
        p.data.normal_(0, 1.0, generator=generator)
    x = torch.randn(3, 64, 16, generator=generator)
    positions = torch.arange(64)
    if method is not None:
        cp = ContextParallel(2, method)
        moe.sequence_split = cp.sequence_split(torch.distributed.group.WORLD, torch.distributed.get_rank())
        positions = local_positions("ring" if method == "all_to_all" else method, 64, 2, moe.sequence_split.rank)
    experts = moe.router(x[:, positions].reshape(-1, 16)).experts
    return moe.within_capacity(experts, 3).view(3, -1, CAPPED.moe.top_k), positions


@pytest.mark.parametrize("method", ["ring", "zigzag_ring", "all_to_all"])
def test_capacity_keeps_the_same_tokens_when_context_parallelism_splits_the_sequence(method):
    kept, _ = _kept_slots(None)
    assert 0 < int((~kept).sum()) < kept.numel() // 2  # some slots are dropped, most are kept
    for rank_kept, positions in run_pooled(_kept_slots, 2, method):
        assert torch.equal(rank_kept, kept[:, positions])


class _Drops(L.Callback):
    """Tokens dropped over each optimizer step's global batch."""

    def __init__(self) -> None:
        self.dropped: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if not trainer.fit_loop._should_accumulate():
            self.dropped.append(float(pl_module.expert_stats.dropped))


def _fit_capped(plugins, world_size: int, dp: int) -> tuple[RunRecord, list[float]]:
    L.seed_everything(0, verbose=False)
    recorder, drops = ParityRecorder(), _Drops()
    strategy = UltraScaleStrategy(*plugins()) if plugins else "auto"
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=3, callbacks=[recorder, drops],
        **QUIET_TRAINER,
    )  # fmt: skip
    data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // dp, seed=0)
    trainer.fit(LlamaModule(CAPPED, optim=SGD), datamodule=data)
    return recorder.record, drops.dropped


CAPACITY_LAYOUTS = {
    "dp2": (lambda: [ZeRO(stage=1)], 2),
    "pp2": (lambda: [PipelineParallel(2, "1f1b", microbatches=2)], 1),
    "tp2": (lambda: [TensorParallel(2)], 1),
    "cp2-ring": (lambda: [ContextParallel(2, "ring")], 1),
    # cp2 zig-zag (the default method) with the experts' dispatch on top: no cell of its own.
    "ep2xcp2": (lambda: [ExpertParallel(2), ContextParallel(2)], 1),
    # Mixtral's routing (softmax top-2, z-loss, sequence aux loss) with ep2 x ZeRO-3, as one process.
    "ep2-zero3": (lambda: [ExpertParallel(2), ZeRO(stage=3)], 2),
}


@pytest.fixture(scope="module")
def capped_reference() -> tuple[RunRecord, list[float]]:
    return run_pooled(_fit_capped, 1, None, 1, 1)[0]


@pytest.mark.parametrize("layout", list(CAPACITY_LAYOUTS))
def test_capacity_drops_the_same_tokens_in_every_layout(layout, capped_reference):
    # Before: capacity came from a rank's local tokens: half-sequence chunks under CP, a
    # micro-batch's sequences otherwise (ep2 x cp2 dropped 14.18% against 13.21% in one process).
    ref, ref_drops = capped_reference
    plugins, dp = CAPACITY_LAYOUTS[layout]
    run, drops = run_pooled(_fit_capped, 2, plugins, 2, dp)[0]
    assert len(ref_drops) == 3 and all(d > 0 for d in ref_drops)
    assert drops == ref_drops  # counts, exactly
    assert_parity(run, ref, rtol=1e-5)  # and which tokens: every gradient


# ------------------------------------------------------------------------------------ mixed precision
class _GroupedMMDtypes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._grouped_mm.default:
            self.dtypes |= {args[0].dtype, args[1].dtype}
        return func(*args, **(kwargs or {}))


def test_under_bf16_autocast_experts_run_in_bf16_and_the_router_in_fp32():
    # Lightning's bf16-mixed keeps fp32 weights: _grouped_mm is no autocast op, so it ran in fp32
    # (on CUDA off its bf16 grouped fast path), while autocast ran the "fp32" router in bf16.
    moe = MoE(16, MIXTRAL_TINY.moe).train()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 32, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16), _GroupedMMDtypes() as seen:
        logits = moe.router(x.reshape(-1, 16)).logits
        moe(x).float().sum().backward()
    assert seen.dtypes == {torch.bfloat16}
    assert logits.dtype == torch.float32
    assert torch.equal(logits, torch.nn.functional.linear(x.reshape(-1, 16), moe.router.weight))
