"""lm-eval tasks inside the training layout: the metrics of every layout equal one process's.

Every run forks afresh (``run_workers``, not the warm pool): lm-eval reads its data through pyarrow, whose
allocator starts a background thread that a process must not carry into later forks.
"""

import lightning as L
import pytest
from eval_tasks import TASKS, write_tasks
from llama_runs import GLOBAL_BATCH, SEQ_LEN

from lightning_ultrascale import (
    ContextParallel,
    DataParallel,
    ExpertParallel,
    LlamaModule,
    PipelineParallel,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.testing import run_workers
from lightning_ultrascale.testing.parity import QUIET_TRAINER
from lightning_ultrascale.training.evaluation import LMEvaluation

#: name -> (plugins, world size, data-parallel size, model)
LAYOUTS = {
    "dp2": (lambda: [DataParallel()], 2, 2, "llama_tiny"),
    "zero1": (lambda: [ZeRO(1)], 2, 2, "llama_tiny"),
    "zero3": (lambda: [ZeRO(3)], 2, 2, "llama_tiny"),
    "tp2": (lambda: [TensorParallel(2, loss_parallel=True)], 2, 1, "llama_tiny"),
    "ep2": (lambda: [ExpertParallel(2)], 2, 2, "moe_tiny"),
    # A V-shaped schedule (its eval hands no gradients between a rank's two stages), and the zig-zag split.
    "pp2_zbv": (lambda: [PipelineParallel(2, "zbv")], 2, 1, "llama_tiny"),
    "cp2": (lambda: [ContextParallel(2)], 2, 1, "llama_tiny"),
}
# (Measured once and left out for the suite's time: pp2 1F1B and cp2 all-to-all, equal within 1.2e-7.)
#: Layouts that also evaluate after step 1: training goes on after an evaluation as if none ran (the step-2
#: metrics still equal one process's; a pipeline's evaluation runs a schedule of its own).
EVERY_STEP = {"pp2_zbv", "cp2"}


def _fit_and_evaluate(
    plugins, world_size: int, dp: int, model: str, include_path: str, root: str, every: int = 0
) -> dict:
    L.seed_everything(0, verbose=False)
    evaluation = LMEvaluation(list(TASKS), every_n_steps=every, include_path=include_path, batch_size=4)
    strategy = UltraScaleStrategy(*plugins()) if plugins is not None else "auto"
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, callbacks=[evaluation],
        default_root_dir=root, **QUIET_TRAINER,
    )  # fmt: skip
    data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH // dp, seed=0)
    trainer.fit(LlamaModule(model), datamodule=data)
    return evaluation.results


@pytest.fixture(scope="module")
def include_path(tmp_path_factory) -> str:
    return write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def references(include_path, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("runs"))
    return {
        m: run_workers(_fit_and_evaluate, 1, None, 1, 1, m, include_path, root)[0] for m in ("llama_tiny", "moe_tiny")
    }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lm_eval_metrics_in_every_layout_equal_one_process(references, include_path, layout, tmp_path):
    plugins, world_size, dp, model = LAYOUTS[layout]
    every = 1 if layout in EVERY_STEP else 0
    args = (plugins, world_size, dp, model, include_path, str(tmp_path), every)
    ranks = run_workers(_fit_and_evaluate, world_size, *args, timeout_s=300)
    reference = references[model][2]
    for rank, results in enumerate(ranks):  # every rank holds (and logged) the same metrics
        assert set(results) == ({1, 2} if every else {2}), results
        got = results[2]
        assert set(got) == set(TASKS) == set(reference)
        for task, metrics in reference.items():
            for name, value in metrics.items():
                assert abs(got[task][name] - value) <= 1e-4 * abs(value), (layout, rank, task, name, got[task], value)


def _task_managers(include_path: str) -> tuple[list[str], bool]:
    from lightning_ultrascale.training.evaluation import task_manager

    own = task_manager(list(TASKS), include_path).all_tasks
    return own, "hellaswag" in task_manager(["tiny_choice", "hellaswag"], include_path).all_tasks


def test_local_tasks_skip_indexing_lm_evals_own_and_a_hub_task_still_finds_them(include_path):
    # (in a fresh fork: lm-eval's task index imports pyarrow, see the module docstring)
    [(own, with_defaults)] = run_workers(_task_managers, 1, include_path)
    assert sorted(own) == sorted(TASKS) and with_defaults
