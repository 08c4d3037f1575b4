"""The model contract's protocols (lightning_ultrascale.models.spec): ``declares`` finds every member the
way a model holds it (attribute, method, registered submodule), the same on every Python."""

import pytest
import torch
from torch import nn

from lightning_ultrascale.models import (
    AuxLossModel,
    PipelineLoss,
    RoutedExperts,
    SequenceStatistics,
    StagedModel,
    SwappableAttention,
    build_model,
    declares,
    spec_of,
)


class _Experts(nn.Module):
    """An MoE module whose members are registered submodules (what Python 3.12's isinstance misses)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Linear(2, 2)
        self.dispatcher = nn.Identity()


class _LossAsModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.loss_fn = nn.CrossEntropyLoss()  # a callable submodule is a loss_fn too


def test_registered_submodules_and_callable_modules_count_as_declared_members():
    assert declares(_Experts(), RoutedExperts)
    assert declares(_LossAsModule(), PipelineLoss)


def test_a_missing_member_or_a_method_set_to_none_is_not_declared():
    assert not declares(nn.Linear(2, 2), RoutedExperts)
    loss = _LossAsModule()
    loss.loss_fn = None  # (Module.__setattr__ drops the submodule: the attribute is None now)
    assert not declares(loss, PipelineLoss)
    staged = build_model("llama_tiny", device="meta")
    staged.forward_stage = None
    assert not declares(staged, StagedModel)


def test_our_models_declare_every_protocol_their_layouts_use():
    dense, moe = build_model("llama_tiny", device="meta"), build_model("moe_tiny", device="meta")
    assert declares(dense, StagedModel) and declares(moe, AuxLossModel)
    assert all(declares(block.attention, SwappableAttention) for block in dense.layers.values())
    spec = spec_of(moe)
    blocks = [moe.layers[str(i)].feed_forward for i in spec.moe_blocks]
    assert blocks and all(declares(b, RoutedExperts) and declares(b, SequenceStatistics) for b in blocks)


@pytest.mark.parametrize("obj", [nn.Linear(2, 2), object(), torch.zeros(1)])
def test_spec_of_is_none_for_anything_that_declares_no_model_spec(obj):
    assert spec_of(obj) is None
