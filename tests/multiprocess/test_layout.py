"""The seams between plugins: a plugin defined here, in the test, plugs into the library unedited.

``ReduceNormsOverTensorRanks`` stands in for expert parallelism: it declares, through the Layout,
a parameter group whose gradients average over other ranks than the default ``dp x cp`` (experts
average over their own data ranks). Norm weights are replicated over tp without sequence
parallelism, so averaging them over ``dp x tp`` is exact, and every ZeRO stage must then give
them an engine of their own over that 4-rank (or, under a pipeline, 2-rank) group.
"""

import contextlib
from typing import ClassVar

import lightning as L
import pytest
import torch.distributed as dist
from llama_runs import ADAMW, GLOBAL_BATCH, SEQ_LEN, SGD, SaveCheckpoint, run_tiny_llama
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel

from lightning_ultrascale import (
    ConfigError,
    ContextParallel,
    LlamaModule,
    PipelineParallel,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.parallel import tensor
from lightning_ultrascale.parallel.dims import DATA_DIMS
from lightning_ultrascale.parallel.layout import Layout
from lightning_ultrascale.parallel.plugin import ParallelPlugin
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import QUIET_TRAINER, ParityRecorder, assert_parity, relative_error


class ReduceNormsOverTensorRanks(ParallelPlugin):
    """Averages the norm weights' gradients over ``dp x cp x tp`` (a stand-in for an expert group)."""

    applies_at = "expert"

    def mesh_sizes(self):
        return {}

    def apply(self, model: nn.Module, layout: Layout) -> nn.Module:
        norms = {n for n, _ in model.named_parameters() if n.endswith("norm.weight")}
        layout.declare_gradient_group("norms", (*DATA_DIMS, "tp"), norms)
        return model


class _Tagged(ColwiseParallel):
    """A column-wise style that records the modules it shards."""

    applied: ClassVar[list[str]] = []

    def _apply(self, module, device_mesh):
        _Tagged.applied.append(type(module).__name__)
        return super()._apply(module, device_mesh)


class MarkFirstQueryLinear(ParallelPlugin):
    """Stands in for FP8: says one linear is of another kind; tensor parallelism picks its style."""

    applies_at = "fp8"

    def mesh_sizes(self):
        return {}

    def apply(self, model, layout):
        layout.linear_styles["layers.0.attention.wq"] = "tagged"
        return model


class _Facts(L.Callback):
    """Which ranks each engine averages over, and over how many ranks its optimizer shards and FSDP shards lie."""

    def on_train_end(self, trainer, pl_module):
        syncs = trainer.strategy.layout.grad_syncs
        norm = next(m.weight for n, m in pl_module.model.named_modules() if n.endswith("attention_norm"))
        self.facts = {
            "engines": {s.group.name: s.mesh.size() for s in syncs},
            "shard_ranks": {s.group.name: {t.device_mesh.size() for t in s.held()[len(s.params) :]} for s in syncs},
            "norm_param_ranks": norm.device_mesh.size() if isinstance(norm, DTensor) else 1,
            "tagged": list(_Tagged.applied),
        }


def _fit(plugins, world_size: int, dp: int, clip: float | None = None):
    """Three SGD steps of llama_tiny through Lightning on forked workers: (RunRecord, facts) of rank 0."""

    def worker():
        L.seed_everything(0, verbose=False)
        recorder, facts = ParityRecorder(), _Facts()
        trainer = L.Trainer(
            accelerator="cpu", devices=world_size, strategy=UltraScaleStrategy(*plugins()), max_steps=3,
            callbacks=[recorder, facts], gradient_clip_val=clip, **QUIET_TRAINER,
        )  # fmt: skip
        data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // dp, seed=0)
        trainer.fit(LlamaModule("llama_tiny", optim=SGD), datamodule=data)
        return recorder.record, facts.facts

    return run_pooled(worker, world_size, timeout_s=300)[0]


@pytest.fixture(scope="module")
def reference_sgd():
    return run_tiny_llama(SGD, steps=3)


CLIP = 0.05


@pytest.fixture(scope="module")
def reference_sgd_clipped():
    return run_tiny_llama(SGD, steps=3, gradient_clip_val=CLIP)


# Not the whole product. ZeRO-2 only under the pipeline, where the norms' group is sharded over its
# own 2 ranks; two sharded engines side by side at pp1 (dense over 2 ranks, norms over 4) are the
# (1, 1) cell's: ZeRO-1's bucketed engine, to which ZeRO-2 adds gradient shards. ZeRO-0 only at pp1:
# the pipeline reduces every engine of the Layout alike after its last micro-step (the (2, 2) and
# (3, 2) cells), and holds back ZeRO-0's own reductions in test_pipeline's zero0 composition.
@pytest.mark.parametrize(
    ("stage", "pp", "clip"),
    [(0, 1, None), (1, 1, CLIP), (3, 1, None), (2, 2, CLIP), (3, 2, None)],
)
def test_a_plugin_defined_in_a_test_reduces_its_parameters_over_its_own_ranks(request, stage, pp, clip):
    def plugins():
        tp_without_sp = TensorParallel(2, sequence_parallel=False)
        pipeline = [PipelineParallel(2, "1f1b", 2)] if pp > 1 else []
        return [ReduceNormsOverTensorRanks(), tp_without_sp, ZeRO(stage, bucket_mb=0.1), *pipeline]

    dp, tp = 2 // pp, 2
    record, facts = _fit(plugins, 4, dp, clip)
    # Exact, and with clipping the norm counts each shard of either group once.
    assert_parity(record, request.getfixturevalue("reference_sgd_clipped" if clip else "reference_sgd"), rtol=1e-5)
    # One engine per group: the norms over dp x tp ranks, everything else over the dp ranks.
    assert facts["engines"] == {"norms": dp * tp, "dense": dp}
    if stage in (1, 2):  # the sharded optimizer steps the norms' shards over their own ranks
        assert facts["shard_ranks"] == {"norms": {dp * tp}, "dense": {dp} if dp > 1 else set()}
    if stage == 3:  # FSDP2 shards the norms over their own ranks
        assert facts["norm_param_ranks"] == dp * tp


# ------------------------------------------------------------------------------------ linear styles
@contextlib.contextmanager
def _tagged_style():
    def tagged(style):
        assert type(style) is ColwiseParallel  # what llama_tp_plan gives wq
        return _Tagged()

    tensor.LINEAR_STYLES["tagged"] = tagged
    try:
        yield
    finally:
        del tensor.LINEAR_STYLES["tagged"]


def test_tensor_parallelism_gives_a_marked_linear_the_style_of_its_kind(reference_sgd):
    # Registered in this process before the workers are forked from it.
    with _tagged_style():
        record, facts = _fit(lambda: [MarkFirstQueryLinear(), TensorParallel(2)], 2, dp=1)
    assert facts["tagged"] == ["Linear"]  # layer 0's wq, and nothing else
    assert_parity(record, reference_sgd, rtol=1e-5)


def test_an_unknown_linear_kind_is_refused_with_the_known_ones():
    plan = {"wq": ColwiseParallel()}
    with pytest.raises(ConfigError, match=r"'float8' linear, .* known kinds: fp8_tensorwise, fp8 \(register"):
        tensor._styled(plan, "layers.0.", {"layers.0.wq": "float8"}, set())
    assert tensor._styled(plan, "layers.0.", {}, {"layers.0.wq"}) == {}  # a module this rank does not hold


# ------------------------------------------------------------------------------------ one validation pass
def test_a_python_api_run_with_a_bad_sequence_length_fails_before_any_process_group(tmp_path, monkeypatch):
    # Rank 0 of a 2-process job whose processes a launcher (torchrun) started: trainer.fit goes
    # straight to the strategy's setup, which must refuse the batch shape before the process group.
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path))
    for var, value in {"TORCHELASTIC_RUN_ID": "t", "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0",
                       "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29999"}.items():  # fmt: skip
        monkeypatch.setenv(var, value)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=UltraScaleStrategy(ContextParallel(2)), **QUIET_TRAINER)
    with pytest.raises(ConfigError) as python_api:
        trainer.fit(LlamaModule("llama_tiny"), datamodule=UltraScaleDataModule(seq_len=250, micro_batch_size=8))
    assert not dist.is_initialized()
    for var in ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var)

    from cli_configs import compose_train as _compose

    from lightning_ultrascale.cli.train import build

    with pytest.raises(ConfigError) as cli:
        build(_compose("parallel.cp=2", "data.seq_len=250"))
    assert not dist.is_initialized()
    # The same check and sentence; each names the settings the way its user wrote them.
    assert str(python_api.value) == (
        "UltraScaleDataModule(seq_len=250) must be divisible by 4 for ContextParallel(size=2) with "
        "ContextParallel(method='zigzag_ring') (2 x cp = 4 zig-zag chunks); valid nearby: 248, 252"
    )
    assert str(cli.value) == (
        "data.seq_len=250 must be divisible by 4 for parallel.cp=2 with parallel.cp_method='zigzag_ring' "
        "(2 x cp = 4 zig-zag chunks); valid nearby: 248, 252"
    )


def _resume_with_norm_group(path: str) -> float:
    def fit(callbacks=(), ckpt_path=None):
        L.seed_everything(0, verbose=False)
        plugins = [ReduceNormsOverTensorRanks(), TensorParallel(2, sequence_parallel=False), ZeRO(1, bucket_mb=0.1)]
        trainer = L.Trainer(
            accelerator="cpu", devices=4, strategy=UltraScaleStrategy(*plugins), max_steps=4,
            callbacks=list(callbacks), **QUIET_TRAINER,
        )  # fmt: skip
        module = LlamaModule("llama_tiny", optim=ADAMW)
        trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=64, micro_batch_size=4), ckpt_path=ckpt_path)
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in module.named_parameters()}

    uninterrupted = fit([SaveCheckpoint(path, step=2)])  # and 2 AdamW steps from its moments after
    resumed = fit(ckpt_path=path)
    return max(relative_error(resumed[n], uninterrupted[n]) for n in uninterrupted)


def test_two_sharded_optimizer_engines_resume_exactly(tmp_path):
    # ZeRO-1 shards one AdamW over two groups of ranks; each engine saves and restores its own part.
    errors = run_pooled(_resume_with_norm_group, 4, str(tmp_path / "ckpt"), timeout_s=300)
    assert max(errors) == 0.0, f"resumed parameters differ by up to {max(errors):.2e}"
