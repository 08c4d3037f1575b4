"""Regional compilation: every layout trains as it does eagerly, and a block compiles once.

The layout matrix compiles with ``aot_eager``: dynamo traces each block (DTensor redistributions,
ring attention's op, the checkpoint, FSDP's unsharded parameters) and AOT autograd partitions
forward and backward, as for inductor, but eager kernels run the graphs: seconds per layout
instead of inductor's cold C++ build (~15 s per distinct graph on this 2-core machine; every
layout of the matrix through inductor is ``benchmarks/compile.py``, its JSON checked in
``tests/e2e/test_benchmarks.py``). Inductor itself is held to one process in the layouts whose
graphs differ: one process (ZeRO-3's graph is the same), tensor + sequence parallel.
"""

import copy

import lightning as L
import pytest
import torch
from hf_models import HFModule
from llama_runs import SEQ_LEN, SGD, run_tiny_llama

from lightning_ultrascale import (
    Compile,
    ConfigError,
    ContextParallel,
    FP8Precision,
    LlamaModule,
    PipelineParallel,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
)
from lightning_ultrascale.models import build_model
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.layouts import LAYOUTS
from lightning_ultrascale.testing.parity import QUIET_TRAINER, assert_parity, record_run


@pytest.fixture(scope="module")
def references():
    return {model: run_tiny_llama(SGD, model=model) for model in ("llama_tiny", "moe_tiny")}


def _compiled(plugins, backend: str):
    return lambda: [*plugins(), Compile(backend=backend)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_blocks_train_like_one_process_in_every_layout(layout, references):
    named = LAYOUTS[layout]
    run = run_tiny_llama(SGD, _compiled(named.plugins, "aot_eager"), named.world_size, dp=named.dp, model=named.model)
    assert_parity(run, references[named.model])
    # One graph per region kind for every block of the model and every step: a hook inside a block
    # that read a value differing between blocks (ZeRO-1/2's waits did) made a graph per block.
    assert run.compiled_graphs and set(run.compiled_graphs.values()) == {1}, run.compiled_graphs


@pytest.mark.parametrize("layout", ["one-process", "zero3", "tp2-sp"])
def test_inductor_compiled_blocks_train_like_one_process(layout, references):
    # Inductor's fused kernels sum in other orders than eager's: gradients measured within 1.1e-6
    # of eager (llama_small, one process), inside the suite's 1e-5.
    named = LAYOUTS[layout]
    run = run_tiny_llama(SGD, _compiled(named.plugins, "inductor"), named.world_size, dp=named.dp, model=named.model)
    assert_parity(run, references[named.model])


def test_compiled_fp8_blocks_train_like_eager_fp8(request):
    # FP8's scales and casts inside the compiled block (tensorwise: the amax of each tensor).
    def fp8(plugins):
        precision = FP8Precision("tensorwise", "32-true")
        return run_tiny_llama(SGD, plugins, 1, model="llama_small", precision_plugin=precision)

    assert_parity(fp8(_compiled(lambda: [], "aot_eager")), fp8(lambda: []))


def test_compiled_blocks_keep_documents_apart(short_documents):
    data = {"source": short_documents, "documents": "mask", "mask_eos_loss": True, "val_fraction": 0.0}
    reference = run_tiny_llama(SGD, data_kwargs=data)
    for plugins, world_size in ((lambda: [], 1), (lambda: [ContextParallel(2, method="zigzag_ring")], 2)):
        run = run_tiny_llama(SGD, _compiled(plugins, "aot_eager"), world_size, dp=1, data_kwargs=data)
        assert_parity(run, reference)


class _Graphs(L.Callback):
    """The graphs compiled per region kind after the first step (its validation included) and at the end."""

    def __init__(self, plugin: Compile) -> None:
        self.plugin, self.seen = plugin, []

    def on_validation_end(self, trainer, pl_module):
        self.seen.append(dict(self.plugin.stats.graphs))

    def on_train_end(self, trainer, pl_module):
        self.seen.append(dict(self.plugin.stats.graphs))


def _graphs_per_step() -> tuple[list[dict[str, int]], float]:
    plugin = Compile()
    graphs = _Graphs(plugin)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=UltraScaleStrategy(plugin),
        max_steps=4,
        callbacks=[graphs],
        **{**QUIET_TRAINER, "limit_val_batches": 1, "val_check_interval": 1},
    )
    data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=2, seed=0, val_fraction=0.1)
    trainer.fit(LlamaModule("llama_tiny", optim=SGD), datamodule=data)
    return graphs.seen, plugin.stats.seconds


def test_a_block_compiles_once_for_training_and_once_for_validation_then_never_again():
    # Four blocks, one graph for all of them (parameters are inputs, not constants); validation
    # (no grad, eval mode) is a second graph; the steps after the first compile nothing.
    seen, seconds = run_pooled(_graphs_per_step, 1, timeout_s=300)[0]
    assert seen[0] == {"TransformerBlock.forward": 2}, seen
    assert all(graphs == seen[0] for graphs in seen), seen
    assert seconds > 0


def test_an_moe_block_compiles_its_dense_parts_and_leaves_the_routed_experts_eager():
    model = Compile().apply(build_model("moe_tiny", seed=0))
    dense, moe = model.layers["0"], model.layers["1"]
    assert type(dense.forward).__name__ == "_CompiledForward"
    assert type(moe.feed_forward.router.forward).__name__ == "_CompiledForward"
    assert type(moe.attention.forward).__name__ == "_CompiledForward"
    assert "forward" not in vars(moe) and "forward" not in vars(moe.feed_forward.experts)


def test_a_deep_copy_runs_its_own_weights():
    # SWA and EMA callbacks deep-copy the module: the copy's compiled forward must read the copy.
    model = Compile(backend="eager").apply(build_model("llama_tiny", seed=0))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    tokens = torch.randint(0, 320, (1, 8))
    assert not torch.equal(model(tokens), twin(tokens))
    assert twin.layers["0"].forward.forward.__self__ is twin.layers["0"]


def test_a_second_graph_in_the_same_mode_is_warned_about_at_once(caplog):
    # A new sequence length is a new graph for training: a recompilation, named at its first
    # occurrence (counting only past two graphs let a graph per block of a 4-block model pass).
    plugin = Compile(backend="eager")
    model = plugin.apply(build_model("llama_tiny", seed=0))
    with caplog.at_level("WARNING", logger="lightning_ultrascale.parallel.compile"):
        model(torch.randint(0, 320, (1, 8)))
        assert not caplog.records
        with torch.no_grad():
            model.eval()(torch.randint(0, 320, (1, 8)))  # evaluation: a graph of its own, expected
        assert not caplog.records
        model.train()(torch.randint(0, 320, (1, 16)))
    assert plugin.stats.graphs == {"TransformerBlock.forward": 3}
    assert [r.getMessage() for r in caplog.records] == [
        "TransformerBlock.forward compiled graph number 2 for training, grad on: a recompilation (a guard failed: "
        "a shape, a dtype or a Python value changed between calls, or differs between blocks); "
        "TORCH_LOGS=recompiles names the guard"
    ]


@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv", "dualpipev"])
def test_a_schedule_that_splits_backward_is_refused_before_any_process(schedule):
    strategy = UltraScaleStrategy(PipelineParallel(2, schedule=schedule), Compile())
    with pytest.raises(
        ConfigError, match=rf"Compile\(enabled=True\) cannot run under .*{schedule}.*torch issue 161904"
    ):
        strategy.validate(build_model("llama_tiny", device="meta").spec, world_size=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "tvm"}, r"Compile\(backend='tvm'\) is unknown; valid: inductor, aot_eager, eager"),
        ({"enabled": "yes"}, r"Compile\(enabled='yes'\) must be true or false"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Compile(**kwargs)


def _hf_run(family: str, plugins=None, world_size: int = 1):
    strategy = (lambda: UltraScaleStrategy(*plugins())) if plugins is not None else None
    data = lambda: UltraScaleDataModule(seq_len=32, micro_batch_size=4, seed=0)  # noqa: E731
    return record_run(lambda: HFModule(family), data, steps=3, strategy=strategy, world_size=world_size)


@pytest.mark.parametrize(("family", "world_size"), [("llama", 2), ("mixtral", 1)])
def test_compiled_hugging_face_blocks_train_like_one_process(family, world_size):
    # transformers' own decoder layers, as they are: Llama's under tp2, Mixtral's MoE blocks.
    tp = [TensorParallel] if world_size > 1 else []
    run = _hf_run(family, lambda: [*(style(2) for style in tp), Compile(backend="aot_eager")], world_size)
    assert_parity(run, _hf_run(family))
