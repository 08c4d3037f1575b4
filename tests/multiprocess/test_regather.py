"""TensorParallel(regather=True): sequence shards kept for backward, gathered again there, bit for bit."""

import re

import pytest
import torch
from llama_runs import DEEPSEEK_V3_TINY, MOE_TINY, SGD, run_tiny_llama
from torch import nn

from lightning_ultrascale import Compile, PipelineParallel, Recompute, TensorParallel
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import build_model
from lightning_ultrascale.parallel.regather import regathered
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import assert_parity
from lightning_ultrascale.testing.storages import LiveStorages
from lightning_ultrascale.utils.comm import CommTracer

TOKENS = 2 * 64  # the batch below: 2 sequences of 64


def _forward_backward(model_name: object, regather: bool, recompute: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = build_model(model_name, device="meta")
    top, blocks = model.spec.tp_plan(True)
    parallelize_module(model, mesh, top)
    for name, block in model.layers.items():
        plan = {module: regathered(style) for module, style in blocks[name].items()} if regather else blocks[name]
        parallelize_module(block, mesh, plan)
    for block in model.layers.values():  # (as TensorParallel does: each rank's own head counts)
        for count in ("n_heads", "n_kv_heads"):
            if isinstance(getattr(block.attention, count, None), int):
                setattr(block.attention, count, getattr(block.attention, count) // 2)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    if recompute != "none":
        Recompute(recompute).apply(model)
    tokens = torch.randint(0, 320, (2, 64), generator=torch.Generator().manual_seed(0))
    with LiveStorages() as live:
        logits = model(tokens)
    alive = live.alive()
    with CommTracer(mesh) as tracer:
        logits.full_tensor().float().logsumexp(-1).mean().backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    return {"alive": alive, "gathers": tracer.summary()["tp"]["all_gather"]["calls"], "grads": grads}


@pytest.mark.parametrize(
    ("model", "recompute", "regathered_per_block"),
    [
        ("llama_tiny", "none", [2, 2, 2, 2]),  # attention's input and the SwiGLU's
        (MOE_TINY, "none", [2, 1, 1, 1]),  # a folded MoE runs its sequence shard: attention's only
        (DEEPSEEK_V3_TINY, "none", [2, 1, 1, 1]),  # MLA: its gathered input local (use_local_output)
        ("llama_tiny", "full", [0, 0, 0, 0]),  # the checkpoint owns what is saved: nothing changes
    ],
    ids=["llama", "moe-folded", "mla", "under-full-recompute"],
)
def test_regather_keeps_the_shards_and_gathers_once_again_per_sub_layer(model, recompute, regathered_per_block):
    plain, regather = (run_pooled(_forward_backward, 2, model, r, recompute)[0] for r in (False, True))
    for name, grad in plain["grads"].items():
        assert torch.equal(regather["grads"][name], grad), name  # the same bytes gathered again: bit for bit
    n = sum(regathered_per_block)
    assert regather["gathers"] - plain["gathers"] == n
    cfg = build_model(model, device="meta").spec
    gathered, shard = TOKENS * cfg.dim * 4, TOKENS * cfg.dim * 4 // 2  # fp32 [b, s, h], and its tp share
    assert plain["alive"][gathered] - regather["alive"][gathered] == n
    assert regather["alive"][shard] - plain["alive"][shard] == n  # the norms' outputs, kept instead


class _TwoProjections(nn.Module):
    """A sub-layer called by keyword, as transformers' attention is (hidden_states=...)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.a(hidden_states) * self.b(hidden_states)


def _keyword_sub_layer(regather: bool) -> tuple[int, dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, parallelize_module

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    layer = _TwoProjections()
    prepare = PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
    )
    plan = {"": regathered(prepare) if regather else prepare, "a": ColwiseParallel(), "b": ColwiseParallel()}
    for name, style in plan.items():
        parallelize_module(layer.get_submodule(name), mesh, style)
    x = (
        torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))
        .chunk(2, dim=1)[mesh.get_local_rank()]
        .contiguous()
    )
    out = layer(hidden_states=x.requires_grad_())
    with CommTracer(mesh) as tracer:
        out.sum().backward()
    gathers = tracer.summary()["tp"].get("all_gather", {}).get("calls", 0)
    return gathers, {"a": layer.a.weight.grad.full_tensor(), "x": x.grad}


def test_a_sub_layer_called_by_keyword_is_regathered_once_for_both_projections():
    (plain_gathers, plain), (gathers, grads) = (run_pooled(_keyword_sub_layer, 2, r)[0] for r in (False, True))
    assert gathers == plain_gathers + 1
    assert all(torch.equal(grads[k], plain[k]) for k in plain)


@pytest.fixture(scope="module")
def reference_sgd():
    return run_tiny_llama(SGD)


# The strategy's path (TensorParallel.apply) and a schedule that splits backward in two (input, then weight
# gradients: the shards are gathered again for the first, the copy lives until the second).
@pytest.mark.parametrize(
    ("plugins", "world_size"),
    [
        (lambda: [TensorParallel(2, regather=True), Recompute("selective", every=2)], 2),
        (lambda: [PipelineParallel(2, schedule="zero_bubble"), TensorParallel(2, regather=True)], 4),
    ],
    ids=["tp2-half-recomputed", "pp2-zero_bubble-x-tp2"],
)
def test_regather_through_the_strategy_matches_one_process(reference_sgd, plugins, world_size):
    assert_parity(run_tiny_llama(SGD, plugins, world_size, dp=1), reference_sgd, rtol=1e-5)


def test_regather_needs_sequence_parallelism_and_eager_blocks():
    with pytest.raises(ConfigError, match=re.escape("TensorParallel(regather=True) keeps sequence-parallel shards")):
        TensorParallel(2, sequence_parallel=False, regather=True)
    tp = TensorParallel(2, regather=True)
    with pytest.raises(ConfigError, match=r"regather=True\) cannot run under Compile\(.*torch.compile cannot trace"):
        tp.validate_with([tp, Compile()])
    TensorParallel(2, regather=True).validate_with([Compile(enabled=False)])
