"""Tied weights (lightning_ultrascale/parallel/tied.py): a Parameter that several modules hold stays one
parameter in every layout, or equal by construction where pipeline stages on different ranks each
hold a copy, or the layout is refused by name. Before, materialising the meta model untied it in
every layout but ZeRO-3 (a nanoGPT-style model 1.7e-2 off from the first loss), and a tied Hugging
Face directory left the last pipeline stage's head at its random initialisation."""

import contextlib
import dataclasses

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from hf_models import HFModule, hf_config
from own_model import CONFIG, OwnModule, Transformer, tp_plan
from test_fabric import _loader
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel
from transformers import AutoModelForCausalLM

from lightning_ultrascale import (
    ContextParallel,
    ExpertParallel,
    PipelineParallel,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.core.fabric import FabricStrategy
from lightning_ultrascale.parallel.tied import find_tied
from lightning_ultrascale.testing import WorkerError, run_pooled
from lightning_ultrascale.testing.parity import RunRecord, assert_parity, record_run
from lightning_ultrascale.training.hf_module import HFCausalLMModule

SEQ_LEN, GLOBAL_BATCH, STEPS = 32, 4, 3


class TiedWithMethod(Transformer):
    """A tied model that also re-ties itself on request (as HF models do): tying must need nothing more."""

    def __init__(self, cfg, read_positions=True, tied=True):
        super().__init__(cfg, read_positions, tied=True)

    def tie_weights(self) -> None:
        self.output.weight = self.tok_embeddings.weight


class OwnTied(OwnModule):
    def __init__(self, with_method: bool = False) -> None:
        super().__init__(tied=True)
        if with_method:
            self.model_class = TiedWithMethod


def _data(dp=1):
    return UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // dp, seed=0)


def _run(make_module, plugins=None, world_size=1, dp=1):
    strategy = (lambda: UltraScaleStrategy(*plugins())) if plugins is not None else None
    return record_run(make_module, lambda: _data(dp), steps=STEPS, strategy=strategy, world_size=world_size)


def _pipeline(schedule):
    return lambda: [PipelineParallel(2, schedule, microbatches=4)]


LAYOUTS = {
    "zero0": (lambda: [ZeRO(0)], 2, 2),
    "zero1": (lambda: [ZeRO(1)], 2, 2),
    "zero2": (lambda: [ZeRO(2)], 2, 2),
    "zero3": (lambda: [ZeRO(3)], 2, 2),
    "tp2": (lambda: [TensorParallel(2)], 2, 1),
    "tp2-sp": (lambda: [TensorParallel(2, sequence_parallel=True)], 2, 1),
    "cp2": (lambda: [ContextParallel(2)], 2, 1),
    # Each placement of the embedding and the head, with and without a split backward: on two ranks
    # (1f1b, afab alike; zero_bubble), two ranks with two stages each (interleaved_1f1b, looped_bfs
    # alike), one rank (zbv, dualpipev alike). The tie is synced after the schedule's step.
    **{f"pp2-{s}": (_pipeline(s), 2, 1) for s in ("1f1b", "interleaved_1f1b", "zero_bubble", "zbv")},
    "pp2-1f1b-zero1": (lambda: [PipelineParallel(2, "1f1b", microbatches=2), ZeRO(1)], 4, 2),
    "pp2-zbv-zero3": (lambda: [PipelineParallel(2, "zbv", microbatches=2), ZeRO(3)], 4, 2),
}
_REFERENCES: dict = {}


def _reference(key, make_module):
    if key not in _REFERENCES:
        _REFERENCES[key] = _run(make_module)
    return _REFERENCES[key]


def test_a_tie_is_found_by_identity_whatever_the_names():
    model = Transformer({"vocab_size": 32, "dim": 8, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 8})
    assert find_tied(model) == ()
    model.output.weight = model.tok_embeddings.weight
    assert find_tied(model) == (("tok_embeddings.weight", "output.weight"),)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_users_tied_model_trains_like_one_process(layout):
    # A nanoGPT-style tie (one Parameter, no method, nothing declared): SGD, 1e-5 on losses,
    # gradients and parameters. The harness folds a pipeline stage's copy into the original after
    # checking they are equal bit for bit.
    plugins, world_size, dp = LAYOUTS[layout]
    assert_parity(_run(OwnTied, plugins, world_size, dp), _reference("own", OwnTied), rtol=1e-5)


# (cp2, like zero0, leaves every parameter whole and in place: no cell of its own.)
@pytest.mark.parametrize("layout", ["zero0", "tp2", "pp2-1f1b"])
def test_a_model_that_reties_itself_needs_nothing_more(layout):
    plugins, world_size, dp = LAYOUTS[layout]
    make = lambda: OwnTied(with_method=True)  # noqa: E731
    assert_parity(_run(make, plugins, world_size, dp), _reference("own", OwnTied), rtol=1e-5)


def _embedding_split_by_columns(sequence_parallel):
    top, blocks = tp_plan(sequence_parallel)
    # The embedding split over its columns, the head over its rows: no one tensor is both.
    return top | {"tok_embeddings": ColwiseParallel(output_layouts=Replicate())}, blocks


class SplitDifferently(OwnTied):
    def configure_model(self):
        super().configure_model()
        self.model.spec = dataclasses.replace(self.model.spec, tp_plan=_embedding_split_by_columns)


def test_a_tensor_parallel_plan_that_splits_tied_weights_differently_is_refused_by_name():
    message = r"tok_embeddings.weight and output.weight are one tied Parameter.*TensorParallel\(tp=2\)'s plan"
    with pytest.raises(WorkerError, match=message):
        _run(SplitDifferently, lambda: [TensorParallel(2)], 2)


# ----------------------------------------------------------------------------- Hugging Face models
TIED = {"tie_word_embeddings": True}


# Each family once and each layout once, not their product: the tie is found by identity and
# handled alike whatever the family (families under layouts, untied: test_hf_models).
@pytest.mark.parametrize(("family", "layout"), [("llama", "pp2-1f1b"), ("qwen3", "tp2"), ("mistral", "zero3")])
def test_a_tied_hugging_face_model_trains_like_one_process(family, layout):
    # Initialised (HF's distributions drawn per name): the head's copy on the last stage equal to
    # the first stage's embedding. (Qwen2 ties by default: test_hf_models.)
    plugins, world_size, dp = LAYOUTS[layout]
    make = lambda: HFModule(family, **TIED)  # noqa: E731
    assert_parity(_run(make, plugins, world_size, dp), _reference(f"hf-{family}", make), rtol=1e-5)


@pytest.fixture(scope="module")
def tied_directories(tmp_path_factory):
    """Tied HF directories as save_pretrained writes them: no lm_head.weight in the files."""
    root = tmp_path_factory.mktemp("tied")
    torch.manual_seed(0)
    for family in ("llama", "qwen2", "qwen3", "mistral"):
        AutoModelForCausalLM.from_config(hf_config(family, **TIED)).save_pretrained(root / family)
    return root


# Each family once, the two placements in turn (the head on another rank, on the same rank): the
# missing head is filled by the tie whatever the family's names.
@pytest.mark.parametrize(
    ("family", "layout"), [("llama", "pp2-1f1b"), ("qwen2", "pp2-zbv"), ("qwen3", "pp2-1f1b"), ("mistral", "pp2-zbv")]
)
def test_a_tied_hugging_face_directory_trains_like_one_process_on_every_stage(tied_directories, family, layout):
    # Qwen3 loaded this way started 5.7413 under pp2 1F1B against 5.7137 in one process.
    from safetensors import safe_open

    path = tied_directories / family
    with safe_open(str(next(path.glob("*.safetensors"))), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # the case: the head is the embedding, stored once
    plugins, world_size, dp = LAYOUTS[layout]
    make = lambda: HFCausalLMModule(path)  # noqa: E731
    run = _run(make, plugins, world_size, dp)
    # Qwen2's k_proj biases: their gradient is a sum over positions of RoPE-rotated queries that
    # nearly cancels, so reduction order (4 microbatches vs one batch) moves their tiny update
    # (|b| ~ 2e-3 after 3 steps) by up to 6.9e-5 relative (measured); 5x that for any CPU.
    assert_parity(run, _reference(f"dir-{family}", make), rtol=1e-5, param_rtol=3.5e-4 if family == "qwen2" else None)


def test_a_tied_mixture_of_experts_trains_like_one_process_under_expert_parallelism():
    make = lambda: HFModule("qwen3_moe", **TIED)  # noqa: E731
    run = _run(make, lambda: [ExpertParallel(2)], 2, 2)
    assert_parity(run, _reference("hf-qwen3_moe", make), rtol=1e-5)


# ----------------------------------------------------------------------------- Fabric
def _fabric_loop(plugins=None) -> RunRecord:
    """The tied model in a Fabric loop (2 processes, built on the meta device), or plain torch on one."""
    if plugins is None:
        torch.manual_seed(0)
        model, loss_context, loader = Transformer(CONFIG, tied=True), contextlib.nullcontext, _loader(GLOBAL_BATCH)
        model.init_weights(0)
        reduce = float
    else:
        fabric = L.Fabric(strategy=FabricStrategy(*plugins()), accelerator="cpu", devices=2)
        fabric.launch()
        with fabric.init_module(empty_init=True):
            model = Transformer(CONFIG, tied=True)
        model = fabric.setup_module(model)
        dp = fabric.strategy.distributed_sampler_kwargs
        loader = fabric.setup_dataloaders(_loader(GLOBAL_BATCH // dp["num_replicas"], **dp))
        loss_context = fabric.strategy.loss_context
        reduce = lambda loss: float(fabric.all_reduce(loss.detach(), reduce_op="mean"))  # noqa: E731
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if plugins is not None:
        optimizer = fabric.setup_optimizers(optimizer)
    record = RunRecord()
    for _, batch in zip(range(STEPS), loader):
        logits = model(batch["input_ids"], batch.get("position_ids"))
        with loss_context():  # (tp: vocabulary-sharded logits, the loss under loss_parallel)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        (fabric.backward(loss) if plugins is not None else loss.backward())
        optimizer.step()
        optimizer.zero_grad()
        record.losses.append(reduce((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()))
    inner = model.module if plugins is not None else model
    record.params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                     for n, p in inner.named_parameters()}  # fmt: skip
    return record


@pytest.mark.parametrize("layout", ["zero0", "tp2", "cp2"])
def test_a_tied_model_in_a_fabric_loop_trains_like_one_process(layout):
    plugins = LAYOUTS[layout][0]
    assert_parity(run_pooled(_fabric_loop, 2, plugins)[0], _fabric_loop(), rtol=1e-5)
