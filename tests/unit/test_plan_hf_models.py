"""The planner prices a Hugging Face model as transformers defines it (adapted, not converted to our
decoder) from the spec the adapter gives it: Qwen3's head_dim apart from hidden / heads, Qwen3-MoE's
and Mixtral's experts."""

import pytest
import torch
from hf_models import FAMILIES, hf_config
from transformers import AutoModelForCausalLM

from lightning_ultrascale.models.hf.adapter import adapt
from lightning_ultrascale.plan import GPUS, Candidate, Workload, estimate


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral", "qwen3_moe"])
def test_a_hugging_face_model_is_priced_from_its_adapted_spec(family):
    with torch.device("meta"):
        model = adapt(AutoModelForCausalLM.from_config(hf_config(family)))
    moe = bool(model.spec.moe_blocks)
    layout = Candidate.layout(dp=2, zero=1, ep=2 if moe else 1, micro_batch_size=2)
    workload = Workload(model, seq_len=64, global_batch_size=4, precision="32-true")
    [cost] = estimate(workload, layout, model, GPUS["h100"])
    assert cost.peak > 0 and cost.step_time > 0 and cost.mfu > 0
    assert cost.view is not None
    widths = cost.view.widths
    assert (widths.h, widths.f, widths.head_dim) == (32, 64, FAMILIES[family].get("head_dim", 8))
    if moe:
        spec, expected = model.spec, FAMILIES[family]
        assert (spec.top_k, spec.expert_ffn_dim) == (2, expected.get("moe_intermediate_size", 64))
        assert cost.comm["ep:all_to_all"] > 0
