"""Hugging Face causal LMs trained as they are (models/hf_adapter.py): no spec, plan or hook written by
the user; every layout matches one process, and the trained model saves as a Hugging Face model."""

import contextlib

import lightning as L
import pytest
import torch
from hf_models import HFModule, hf_config
from transformers import AutoModelForCausalLM

from lightning_ultrascale import (
    ContextParallel,
    ExpertParallel,
    FP8Precision,
    PipelineParallel,
    Recompute,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.models.contract import ContractError
from lightning_ultrascale.models.hf.adapter import adapt
from lightning_ultrascale.models.hf.weights import save_pretrained
from lightning_ultrascale.testing import WorkerError, run_pooled
from lightning_ultrascale.testing.parity import QUIET_TRAINER, ParityRecorder, assert_parity, record_run, relative_error

SEQ_LEN, GLOBAL_BATCH, STEPS = 32, 4, 3


def _data(dp=1, accumulate=1):
    return UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // dp // accumulate, seed=0)


def _run(family, plugins=None, world_size=1, dp=1, accumulate=1, precision=None):
    trainer_kwargs = {"plugins": [precision]} if precision is not None else {}
    strategy = (lambda: UltraScaleStrategy(*plugins())) if plugins is not None else None
    return record_run(
        lambda: HFModule(family),
        lambda: _data(dp, accumulate),
        steps=STEPS,
        strategy=strategy,
        world_size=world_size,
        accumulate_grad_batches=accumulate,
        **trainer_kwargs,
    )


_REFERENCES = {}


def _reference(family):
    if family not in _REFERENCES:
        _REFERENCES[family] = _run(family)
    return _REFERENCES[family]


LAYOUTS = {
    "zero3": (lambda: [ZeRO(3)], 2),
    "tp2": (lambda: [TensorParallel(2)], 1),
    "tp2-sp": (lambda: [TensorParallel(2, sequence_parallel=True)], 1),
    "pp2-1f1b": (lambda: [PipelineParallel(2, "1f1b", microbatches=2)], 1),
    "pp2-zbv": (lambda: [PipelineParallel(2, "zbv", microbatches=2)], 1),
    "cp2": (lambda: [ContextParallel(2)], 1),
}
# Tensor parallelism's plan is derived per family (qwen2's biases split with their columns, the
# experts); sequence parallelism adds the same norms and sequence splits to it: llama and mixtral
# (its experts and router too) under both, qwen2 under tp2-sp. The other layouts take a
# family's blocks as they are; each runs the MoE family and one dense one. Dropped from the product:
# qwen2-tp2, qwen2-zero3, llama-pp2-1f1b, qwen2-pp2-zbv, qwen2-cp2 (tied under ZeRO-3 and the
# schedules: test_tied_weights).
CASES = [(f, layout) for f in ("llama", "mixtral") for layout in ("tp2", "tp2-sp")] + [
    ("qwen2", "tp2-sp"),
    ("llama", "zero3"),
    ("mixtral", "zero3"),
    ("qwen2", "pp2-1f1b"),
    ("mixtral", "pp2-1f1b"),
    ("llama", "pp2-zbv"),
    ("mixtral", "pp2-zbv"),
    ("llama", "cp2"),
    ("mixtral", "cp2"),
    ("mixtral", "ep2"),
    ("mixtral", "recompute"),
    ("qwen3_moe", "ep2"),
    ("qwen3_moe", "pp2-1f1b"),
    ("qwen3", "tp2-sp"),
    ("qwen3", "cp2"),
    ("mistral", "pp2-zbv"),
]


MORE_LAYOUTS = {"ep2": (lambda: [ExpertParallel(2)], 2), "recompute": (lambda: [Recompute("full"), ZeRO(2)], 2)}


@pytest.mark.parametrize(("family", "layout"), CASES, ids=[f"{f}-{layout}" for f, layout in CASES])
def test_a_hugging_face_model_trains_like_one_process(family, layout):
    # SGD: 1e-5 on losses, gradients and parameters (FACTS: AdamW amplifies reduction-order noise).
    plugins, dp = LAYOUTS[layout] if layout in LAYOUTS else MORE_LAYOUTS[layout]
    assert_parity(_run(family, plugins, 2, dp), _reference(family), rtol=1e-5)


def test_fp8_trains_a_hugging_face_model_like_one_process_with_the_same_quantisation():
    # ZeRO-3 on 2 ranks of 4 sequences each against one process accumulating 2 micro-batches of 4:
    # the same tensorwise scales per micro-batch (as tests/multiprocess/test_fp8_training.py).
    fp8 = FP8Precision("tensorwise", "32-true")
    reference = _run("llama", accumulate=2, precision=fp8)
    run = _run("llama", lambda: [ZeRO(3)], 2, dp=2, precision=fp8)
    assert_parity(run, reference, rtol=1e-5)


def _train_and_save(family, plugins, dp, directory):
    L.seed_everything(0, verbose=False)
    recorder, module = ParityRecorder(), HFModule(family)
    strategy = UltraScaleStrategy(*plugins())
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, callbacks=[recorder], **QUIET_TRAINER
    )
    trainer.fit(module, datamodule=_data(dp))
    save_pretrained(module.model, directory)
    return recorder.record


@pytest.mark.parametrize(("family", "layout"), [("qwen2", "pp2-zbv"), ("mixtral", "ep2"), ("llama", "tp2-sp")])
def test_a_trained_model_saves_as_hugging_face_and_loads_back(tmp_path, family, layout):
    plugins, dp = LAYOUTS[layout] if layout in LAYOUTS else MORE_LAYOUTS[layout]
    record = run_pooled(_train_and_save, 2, family, plugins, dp, tmp_path / "hf", timeout_s=300)[0]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    params = {f"model.{n}": p for n, p in loaded.named_parameters()}
    assert params.keys() == record.params.keys()  # (a tied head: under the embedding's name in both)
    for name, value in params.items():
        assert torch.equal(value, record.params[name]), name
    assert type(loaded).__name__ == type(adapt(AutoModelForCausalLM.from_config(hf_config(family)))).__name__


# ----------------------------------------------------------------------------- refused, by name
def _adapted(family="llama", **overrides):
    with torch.device("meta"):
        return adapt(AutoModelForCausalLM.from_config(hf_config(family, **overrides)))


def test_a_family_not_tested_here_is_refused_by_name():
    from transformers import AutoConfig

    with torch.device("meta"):
        gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2))
    with pytest.raises(ContractError, match=r"model_type='gpt2' is not among .*: llama, mistral, qwen2, qwen3, mix"):
        adapt(gpt2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"attention_dropout": 0.1}, r"config.attention_dropout=0.1 is not supported.*set config.attention_dropout"),
        ({"output_router_logits": True}, r"config.output_router_logits=True is not supported"),
    ],
)
def test_settings_that_would_train_differently_are_refused(overrides, message):
    family = "mixtral" if "output_router_logits" in overrides else "llama"
    with pytest.raises(ContractError, match=message):
        _adapted(family, **overrides)


def test_labels_shifted_twice_padding_masks_and_short_sliding_windows_are_refused():
    model = _adapted()
    model.to_empty(device="cpu")
    model.init_weights(0)
    tokens = torch.randint(0, 300, (2, 16))
    shifted = torch.cat((tokens[:, 1:], torch.full((2, 1), -100)), dim=1)  # what UltraScaleDataModule gives
    with pytest.raises(ContractError, match=r"labels already shifted.*shift_labels=batch\['labels'\]"):
        model(input_ids=tokens, labels=shifted)
    assert model(input_ids=tokens, labels=tokens).loss is not None  # HF's own convention: unshifted
    with pytest.raises(ContractError, match=r"attention_mask with padding"):
        model(input_ids=tokens, attention_mask=torch.ones_like(tokens).index_fill_(1, torch.tensor([0]), 0))
    model(input_ids=tokens, attention_mask=torch.ones_like(tokens))  # all ones: nothing to mask
    with pytest.raises(ContractError, match=r"document masking \(document_ids, data.documents=mask\) is not supported"):
        model(input_ids=tokens, document_ids=torch.zeros_like(tokens))
    windowed = _adapted("mistral", sliding_window=8)
    windowed.to_empty(device="cpu")
    windowed.init_weights(0)
    with pytest.raises(ContractError, match=r"sliding_window=8 is shorter than the sequence \(16\)"):
        windowed(input_ids=tokens)


def test_tensor_parallelism_refuses_an_embedding_padding_index():
    model = _adapted(pad_token_id=0)
    with pytest.raises(ContractError, match=r"config.pad_token_id=0 .*padding_idx.*set config.pad_token_id=None"):
        model.spec.tp_plan(False)


def test_the_initial_weights_follow_hf_distributions_drawn_per_parameter_name():
    a, b = _adapted("mixtral"), _adapted("mixtral")
    for model, seed in ((a, 0), (b, 0)):
        model.to_empty(device="cpu")
        model.init_weights(seed)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    std = a.config.initializer_range
    assert abs(float(a.model.layers[0].mlp.experts.gate_up_proj.std()) - std) < 0.1 * std
    assert torch.equal(a.model.layers[0].input_layernorm.weight, torch.ones(32))
    other = _adapted("mixtral", num_hidden_layers=2)  # fewer blocks: the same names get the same values
    other.to_empty(device="cpu")
    other.init_weights(0)
    assert torch.equal(other.model.layers[1].self_attn.q_proj.weight, a.model.layers[1].self_attn.q_proj.weight)


# ----------------------------------------------------------------------------- Lightning Fabric
def _fabric_loop(plugins, steps=STEPS):
    """An HF model in a Fabric loop of one's own: built on meta, set up, trained with SGD; losses and parameters."""
    from lightning_ultrascale.core.fabric import FabricStrategy

    fabric = L.Fabric(strategy=FabricStrategy(*plugins()), accelerator="cpu", devices=2)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = AutoModelForCausalLM.from_config(hf_config("qwen2"))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return _train(model, optimizer, fabric.backward, steps, fabric.strategy.loss_context)


def _train(model, optimizer, backward, steps, loss_context=contextlib.nullcontext):
    data = _data()
    data.setup("fit")
    losses, batches = [], iter(data.train_dataloader())
    for _ in range(steps):
        batch = next(batches)
        logits = model(input_ids=batch["input_ids"]).logits
        with loss_context():  # (tp: vocabulary-sharded logits, the loss under loss_parallel)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    whole = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }
    return losses, whole


def test_a_hugging_face_model_trains_in_a_fabric_loop_like_one_process():
    reference = adapt(AutoModelForCausalLM.from_config(hf_config("qwen2")))
    reference.init_weights(0)
    losses, params = _train(reference, torch.optim.SGD(reference.parameters(), lr=0.1), torch.Tensor.backward, STEPS)
    run_losses, run_params = run_pooled(_fabric_loop, 2, lambda: [TensorParallel(2)], timeout_s=300)[0]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(run_losses, losses)), (run_losses, losses)
    run_params = {n.removeprefix("_forward_module."): p for n, p in run_params.items()}  # (Fabric's wrapper)
    assert run_params.keys() == params.keys()
    for name, value in params.items():
        assert relative_error(run_params[name], value) <= 1e-5, name


def test_a_model_loaded_whole_with_from_pretrained_keeps_its_weights_in_any_layout(tmp_path):
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(hf_config("mixtral")).save_pretrained(tmp_path / "hf")
    run = record_run(
        lambda: HFModule("mixtral", directory=str(tmp_path / "hf")),
        lambda: _data(dp=2),
        steps=1,
        strategy=lambda: UltraScaleStrategy(ExpertParallel(2), ZeRO(3)),
        world_size=2,
    )
    loaded = {f"model.{n}": p for n, p in AutoModelForCausalLM.from_pretrained(tmp_path / "hf").named_parameters()}
    assert run.initial.keys() == loaded.keys()
    assert all(torch.equal(run.initial[n], p) for n, p in loaded.items())


def test_transformers_own_loss_trains_under_context_parallelism_given_the_shifted_labels():
    # labels= alone: HF shifts inside each rank's chunk (wrong pairs at every chunk's edge): refused.
    hf_loss = lambda: HFModule("llama", loss="hf")  # noqa: E731
    run = record_run(hf_loss, lambda: _data(), steps=STEPS, strategy=lambda: UltraScaleStrategy(ContextParallel(2)),
                     world_size=2)  # fmt: skip
    assert_parity(run, _reference("llama"), rtol=1e-5)
    with pytest.raises(WorkerError, match=r"labels= under context parallelism: HF shifts labels within each rank"):
        record_run(lambda: HFModule("llama", loss="hf_labels"), lambda: _data(), steps=1,
                   strategy=lambda: UltraScaleStrategy(ContextParallel(2)), world_size=2)  # fmt: skip
