"""Activation recomputation: same numbers, fewer saved activations, matmuls kept by op-level SAC."""

import copy
import re
from collections import Counter

import lightning as L
import pytest
import torch
from llama_runs import SEQ_LEN, SGD, run_tiny_llama
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ultrascale import LlamaModule, UltraScaleDataModule, UltraScaleStrategy
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import build_model
from lightning_ultrascale.parallel.data import ZeRO
from lightning_ultrascale.parallel.dims import ParallelDims
from lightning_ultrascale.parallel.plugin import apply_all
from lightning_ultrascale.parallel.recompute import Recompute
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import QUIET_TRAINER, assert_parity
from lightning_ultrascale.testing.storages import LiveStorages

CONFIGS = {
    "none": Recompute("none"),
    "full": Recompute("full"),
    "selective_every_2": Recompute("selective", every=2),
    "selective_op": Recompute("selective_op"),
}
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default  # what SDPA runs on CPU in fp32


def _model(config: str, device: str = "cpu") -> torch.nn.Module:
    return apply_all([CONFIGS[config]], build_model("llama_tiny", device=device), None)  # type: ignore[arg-type]


def _tokens() -> torch.Tensor:
    return torch.randint(0, 320, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops that run while it is active."""

    # Compiled backward graphs call higher-order ops (run_with_rng_state): count them too.
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def _activation_bytes(model: torch.nn.Module) -> int:
    """Bytes of the storages the forward leaves alive for backward (not weights, not the logits).

    Not counted with saved-tensor hooks: op-level SAC keeps the matmul outputs in its own cache,
    which bypasses them (hooks report the same bytes for "selective_op" as for "full"). Counting
    what is still alive after the forward sees autograd's saved tensors, checkpoint inputs and
    the SAC cache alike.
    """
    with LiveStorages() as live:
        logits = model(_tokens())
    return live.alive_bytes(*model.parameters(), *model.buffers(), logits)


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(_tokens())
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), _tokens().roll(-1, 1).flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("config", ["full", "selective_every_2", "selective_op"])
def test_recompute_gives_bitwise_the_loss_and_gradients_of_no_recompute(config):
    # Recomputation replays the same ops on the same inputs: on the CPU that is bit for bit.
    ref_loss, ref_grads = _loss_and_grads(_model("none"))
    loss, grads = _loss_and_grads(_model(config))
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name


def test_recompute_cuts_the_activations_saved_for_backward():
    saved = {config: _activation_bytes(_model(config)) for config in CONFIGS}
    table = ", ".join(f"{c}={b}" for c, b in saved.items())
    # llama_tiny, batch 2 x 64 tokens, fp32: measured none=3003904, full=239104 (block inputs
    # only), selective every 2=1621504, selective_op=1689088 bytes (whole storages: a kept view counts its base).
    assert saved["full"] < saved["selective_every_2"] < saved["none"], table
    assert saved["selective_op"] < saved["none"], table
    # Full recomputation keeps a hidden state per block instead of ~20 tensors per block.
    assert saved["full"] < saved["none"] / 10, table


def _backward_op_counts(config: str) -> Counter:
    model = _model(config)
    loss = model(_tokens()).sum()
    with _OpCounter() as counter:
        loss.backward()
    return counter.counts


def test_selective_op_recomputes_no_matmul_and_no_attention():
    none, full, op = (_backward_op_counts(c) for c in ("none", "full", "selective_op"))
    matmuls = {name: sum(c[f] for f in MATMULS) for name, c in (("none", none), ("full", full), ("op", op))}
    # Full recomputation runs the forward matmuls again in backward: 6 of each block's 7 linears,
    # as the recompute stops early once it has what backward needs, and w2's output is not.
    assert matmuls["full"] == matmuls["none"] + 4 * 6, matmuls
    assert matmuls["op"] == matmuls["none"], matmuls
    assert (none[SDPA], full[SDPA], op[SDPA]) == (0, 4, 0)
    # ... while the cheap ops are recomputed: the SiLU of every block's MLP runs again.
    silu = torch.ops.aten.silu.default
    assert (none[silu], op[silu]) == (0, 4)


@pytest.mark.parametrize("config", ["full", "selective_op"])
def test_recomputed_blocks_compile_into_one_graph_each(config):
    # torch.compile applies after recomputation (the strategy's APPLY_ORDER). aot_eager runs dynamo and the
    # autograd partitioner, where checkpointing takes effect under compile, without inductor's
    # slow code generation; fullgraph=True fails instead of silently falling back to eager.
    torch._dynamo.reset()
    model = _model(config)
    for block in model.layers.values():
        block.compile(backend="aot_eager", fullgraph=True)
    ref_loss, ref_grads = _loss_and_grads(_model("none"))
    loss, grads = _loss_and_grads(model)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=0, msg=name)
    # The partitioner keeps each mode's choice: full recomputes 6 matmuls a block, op-level none.
    loss = model(_tokens()).sum()
    with _OpCounter() as counter:
        loss.backward()
    none = _backward_op_counts("none")
    recomputed = sum(counter.counts[f] - none[f] for f in MATMULS)
    assert recomputed == {"full": 4 * 6, "selective_op": 0}[config]
    torch._dynamo.reset()


@pytest.mark.parametrize("config", list(CONFIGS))
def test_parameter_names_are_unchanged(config):
    plain = build_model("llama_tiny", device="meta")
    model = _model(config, device="meta")  # as the strategy applies it: before materialising
    assert list(dict(model.named_parameters())) == list(dict(plain.named_parameters()))
    assert list(model.state_dict()) == list(plain.state_dict())


def test_selective_recomputes_every_kth_block_by_global_index():
    plugin = Recompute("selective", every=2)
    model = plugin.apply(build_model("llama_tiny", device="meta"))
    wrapped = [name for name, block in model.layers.items() if "forward" in vars(block)]
    assert wrapped == ["1", "3"]
    # A pipeline stage holding layers 2 and 3 recomputes layer 3, as the single process does.
    stage = build_model("llama_tiny", device="meta")
    del stage.layers["0"], stage.layers["1"]
    assert [n for n, b in plugin.apply(stage).layers.items() if "forward" in vars(b)] == ["3"]


def test_a_deep_copy_recomputes_its_own_blocks():
    model = _model("full")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2)
    # The copy's forward must read the copy's (doubled) weights, not the original's.
    assert not torch.equal(twin(_tokens()), model(_tokens()))
    _, grads = _loss_and_grads(twin)
    assert all(g is not None for g in grads.values())
    assert all(p.grad is None for p in model.parameters())


def _strategy_built_model() -> tuple[list[bool], list[bool], dict[str, torch.Tensor]]:
    plugins = (Recompute("selective", every=2), ZeRO(stage=3))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=UltraScaleStrategy(*plugins), max_steps=0, **QUIET_TRAINER
    )
    module = LlamaModule("llama_tiny")
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=16, micro_batch_size=1))
    blocks = list(module.model.layers.values())
    return (
        ["forward" in vars(block) for block in blocks],
        [isinstance(block, FSDPModule) for block in blocks],
        {n: p.full_tensor() for n, p in module.model.named_parameters()},
    )


def test_the_strategy_recomputes_blocks_that_fsdp_then_shards_under_unchanged_names():
    recomputed, sharded, weights = run_pooled(_strategy_built_model, 2)[0]
    assert recomputed == [False, True, False, True]
    assert all(sharded)
    # Same names and, seeded by name, the same initial weights as a plain single-process build.
    reference = dict(build_model("llama_tiny", seed=0).named_parameters())
    assert list(weights) == list(reference)
    for name, value in weights.items():
        assert torch.equal(value, reference[name]), name


@pytest.fixture(scope="module")
def reference_sgd():
    return run_tiny_llama(SGD, steps=3)


# DataParallel is added by default; ZeRO-3 (FSDP2) wraps the blocks after recomputation did.
STRATEGY_LAYOUTS = {
    "full+dp": lambda: [Recompute("full")],
    "full+zero3": lambda: [Recompute("full"), ZeRO(stage=3)],
    "selective_op+zero3": lambda: [Recompute("selective_op"), ZeRO(stage=3)],
}


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("layout", list(STRATEGY_LAYOUTS))
def test_recompute_through_the_strategy_matches_one_process(reference_sgd, layout, accumulate):
    run = run_tiny_llama(SGD, STRATEGY_LAYOUTS[layout], world_size=2, accumulate=accumulate, steps=3)
    assert_parity(run, reference_sgd, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "partial"}, "Recompute(mode='partial') is unknown; valid: none, full, selective, selective_op"),
        ({"mode": "selective", "every": 0}, "Recompute(every=0) must be an integer >= 1"),
        ({"mode": "selective", "every": "2"}, "Recompute(every='2') must be an integer >= 1"),
        ({"mode": "full", "every": 2}, "Recompute(every=2) only applies to Recompute(mode='selective')"),
    ],
)
def test_bad_options_raise_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Recompute(**kwargs)


def test_every_beyond_the_layer_count_raises_before_any_process_group():
    spec = build_model("llama_tiny", device="meta").spec
    with pytest.raises(ConfigError, match=r"Recompute\(every=5\) exceeds n_layers=4 .*valid: 1 \.\. 4"):
        Recompute("selective", every=5).validate(ParallelDims(), spec, None)
    Recompute("selective", every=4).validate(ParallelDims(), spec, None)
