"""A model family is one folder: ``models/<family>/`` holds its presets, and ``models.MODEL_CONFIGS``
is every family's, gathered."""

import types

import pytest

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import FAMILIES, MODEL_CONFIGS, _gather, get_model_config


def test_every_preset_comes_from_exactly_one_family():
    owners = {name: [f.__name__ for f in FAMILIES if name in f.CONFIGS] for name in MODEL_CONFIGS}
    assert {name: len(found) for name, found in owners.items()} == dict.fromkeys(MODEL_CONFIGS, 1)
    assert owners["mixtral_8x7b"] == ["lightning_ultrascale.models.mixtral"]
    assert owners["deepseek_v3"] == ["lightning_ultrascale.models.deepseek"]


def test_a_new_family_folder_adds_its_presets_and_may_not_take_another_s_name():
    toy = types.ModuleType("toy_family")
    toy.CONFIGS = {"toy_1b": get_model_config("llama3_1b")}
    assert list(_gather((*FAMILIES, toy))) == [*MODEL_CONFIGS, "toy_1b"]
    toy.CONFIGS = {"llama3_8b": get_model_config("llama3_1b")}
    with pytest.raises(ConfigError, match="model preset 'llama3_8b' is in two families; toy_family must rename"):
        _gather((*FAMILIES, toy))
