"""The model contract (lightning_ultrascale/models/contract.py): a user's own model trains under every
layout with parity, and what used to fail silently or misleadingly now fails by name."""

import pytest
import torch
from own_model import CONFIG, OwnModule, Transformer

from lightning_ultrascale import (
    ContextParallel,
    PipelineParallel,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.models.contract import ContractError, check_batch, check_model, check_module
from lightning_ultrascale.testing import WorkerError
from lightning_ultrascale.testing.parity import assert_parity, record_run

SEQ_LEN, GLOBAL_BATCH, STEPS = 32, 4, 3


def _run(plugins=None, world_size=1, dp=1, read_positions=True, blocks_in_a_list=False):
    strategy = (lambda: UltraScaleStrategy(*plugins())) if plugins is not None else None
    return record_run(
        lambda: OwnModule(read_positions, blocks_in_a_list=blocks_in_a_list),
        lambda: UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // dp, seed=0),
        steps=STEPS,
        strategy=strategy,
        world_size=world_size,
    )


@pytest.fixture(scope="module")
def reference():
    return _run()


LAYOUTS = {
    "zero3": (lambda: [ZeRO(3)], 2),
    "tp2": (lambda: [TensorParallel(2)], 1),
    "pp2-1f1b": (lambda: [PipelineParallel(2, "1f1b", microbatches=2)], 1),
    "pp2-zbv": (lambda: [PipelineParallel(2, "zbv", microbatches=2)], 1),
    "cp2": (lambda: [ContextParallel(2)], 1),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_users_own_model_trains_like_one_process(layout, reference):
    # Written in the shape of Lightning's tensor-parallel example: hard-coded head counts (TP sets
    # the rank's own), no flops_per_token (MFU n/a), self.log(sync_dist=True) of a loss that loss
    # parallelism leaves a DTensor; SGD: 1e-5 on losses, gradients and parameters.
    plugins, dp = LAYOUTS[layout]
    assert_parity(_run(plugins, 2, dp), reference, rtol=1e-5)


@pytest.mark.parametrize("layout", ["pp2-1f1b", "zero3"])
def test_blocks_held_in_a_module_list_train_like_one_process(layout, reference):
    # The strategy holds them as Blocks (same names): a pipeline stage drops the others' by number.
    plugins, dp = LAYOUTS[layout]
    assert_parity(_run(plugins, 2, dp, blocks_in_a_list=True), reference, rtol=1e-5)


# ----------------------------------------------------------------------------- silent cases
def test_a_model_that_ignores_the_positions_context_parallelism_hands_it_is_refused():
    # It would train on positions counted from 0 on every rank: a different model, silently.
    with pytest.raises(WorkerError, match="never read them"):
        _run(lambda: [ContextParallel(2)], 2, read_positions=False)


class _GlobalStreamModule(OwnModule):
    """Lightning's example's initialisation: one global random stream, drawn on each rank's shards."""

    def configure_model(self) -> None:
        super().configure_model()

        def init_weights(seed: int) -> None:
            torch.manual_seed(seed)
            for p in self.model.parameters():
                torch.nn.init.normal_(p.to_local() if hasattr(p, "to_local") else p, std=0.02)

        self.model.init_weights = init_weights


def test_an_initialisation_that_depends_on_the_sharding_is_refused():
    # Each layout would start from other weights (the example's step-0 loss 6.041 vs 5.987), silently.
    with pytest.raises(WorkerError, match="depends on the rank or the sharding"):
        record_run(
            _GlobalStreamModule,
            lambda: UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // 2, seed=0),
            steps=1, strategy=lambda: UltraScaleStrategy(ZeRO(3)), world_size=2,
        )  # fmt: skip


@pytest.mark.parametrize("technique", ["ContextParallel(size=2)", "PipelineParallel(size=2)"])
def test_a_batch_that_cannot_be_split_by_name_is_refused(technique):
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ContractError, match=r"needs each batch as a dict.*got a Tensor"):
        check_batch(tokens, technique)
    with pytest.raises(ContractError, match=r"unknown: loss_mask"):
        check_batch({"input_ids": tokens, "labels": tokens, "loss_mask": tokens}, technique)
    with pytest.raises(ContractError, match=r"missing: labels"):
        check_batch({"input_ids": tokens}, technique)


def test_context_parallelism_refuses_a_tensor_batch_instead_of_training_on_it_unsplit():
    with pytest.raises(ContractError, match=r"ContextParallel.*dict"):
        ContextParallel(2).shard_batch(torch.zeros(2, 8, dtype=torch.long))


def test_a_pipeline_names_the_batch_format_instead_of_an_index_error():
    from lightning_ultrascale.parallel.pipeline.step import PipelineStep

    with pytest.raises(ContractError, match=r"PipelineParallel.*dict of \[batch, seq\] tensors"):
        PipelineStep(PipelineParallel(2)).run(OwnModule(), torch.zeros(2, 8, dtype=torch.long), train=True)


# ----------------------------------------------------------------------------- named causes
class _NoStage(Transformer):
    forward_stage = None  # not callable: no pipeline hook


def test_every_missing_hook_is_named_with_how_to_add_it():
    with torch.device("meta"):
        model = _NoStage(CONFIG)
    del model.layers["0"].attention.attention_fn
    with pytest.raises(ContractError) as err:
        check_model(model, object(), [PipelineParallel(2), ContextParallel(2)])
    message = str(err.value)
    for hook in ("forward_stage", "loss_fn(logits, labels) on the LightningModule", "attention_fn"):
        assert hook in message, hook
    assert "Example: lightning_ultrascale.models.llama.Llama.forward_stage" in message
    check_model(model, object(), [PipelineParallel(1), ContextParallel(1)])  # size 1: nothing split, nothing needed


def test_a_model_without_flops_per_token_passes_the_contract():
    # (the strategy used to say "needs init_weights(seed)" of a model that had it, for lack of this)
    with torch.device("meta"):
        model = Transformer(CONFIG)
    assert not hasattr(model, "flops_per_token")
    check_model(model, OwnModule(), [PipelineParallel(2), ContextParallel(2), TensorParallel(2), ZeRO(3)])


def test_the_strategy_checks_a_built_model_before_its_process_group():
    class NoLoss(OwnModule):
        loss_fn = None

    module = NoLoss()
    module.configure_model()
    strategy = UltraScaleStrategy(PipelineParallel(2))
    strategy._lightning_module = module
    with pytest.raises(ContractError, match="loss_fn"):
        check_module(module, strategy.applied_plugins())
    assert not torch.distributed.is_initialized()
