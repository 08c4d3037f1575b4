"""``profiler=torch``: a Chrome trace of chosen steps on chosen ranks naming our collectives; bad options fail early."""

import json
import os

import pytest
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from lightning_ultrascale.cli.train import CONFIG_DIR, build, hydra_argv
from lightning_ultrascale.cli.train import main as train_main
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.testing.commands import run_command
from lightning_ultrascale.training.profiling import TraceProfiler


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("train", overrides=hydra_argv(list(overrides)))


def test_profiler_torch_writes_rank_0_s_trace_of_the_active_steps_naming_the_gradient_all_reduce(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    overrides = [
        "profiler=torch",  # wait 1, warmup 1, active 2: steps 3-4, rank 0
        "trainer.max_steps=4",
        "trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=false",
        "+trainer.enable_checkpointing=false",
        "~callbacks.checkpoint",
        "data.seq_len=64",
        "data.micro_batch_size=2",
        "data.global_batch_size=4",
    ]
    out = run_command(train_main, ["ultrascale-train", *overrides], env, world_size=2, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "profiler").iterdir()) == ["rank0-steps3-4.json"]
    assert "no CUDA memory snapshot on rank 0" in out.stderr + out.stdout
    events = json.loads((run_dir / "profiler" / "rank0-steps3-4.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "ultrascale/grad_sync" in names and "ultrascale/grad_sync_wait" in names
    assert {"c10d::allreduce_", "gloo:all_reduce"} & names, sorted(n for n in names if n and "reduce" in n)
    steps = sorted(n for n in names if n and n.startswith("ProfilerStep#"))
    assert len(steps) == 2, steps  # the two active optimizer steps


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["profiler=torch", "profiler.active=0"], r"profiler.active=0 must be a positive integer"),
        (["profiler=torch", "profiler.wait=-1"], r"profiler.wait=-1 must be an integer >= 0"),
        (["profiler=torch", "profiler.ranks=[2]"], r"profiler.ranks=\[2\] names ranks beyond the job's 2; valid: 0..1"),
        (["profiler=torch", "profiler.ranks=[]"], r"profiler.ranks=\[\] must list global ranks"),
        (["profiler=torch", "+profiler.every=3"], r"profiler.every=3 is not an argument of .*; valid: dirpath"),
        (["callbacks.stragglers.slow_ratio=0.9"], r"callbacks.stragglers.slow_ratio=0.9 must be a number > 1"),
    ],
)
def test_bad_profiler_and_straggler_options_fail_before_any_process_group(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=message):
        build(_compose(*overrides))
    assert not dist.is_initialized()


def test_an_unknown_profiler_names_the_valid_ones():
    with pytest.raises(ConfigError, match=r"profiler=nsys is unknown; valid: none, torch"):
        hydra_argv(["profiler=nsys"])


def test_the_default_is_no_profiler(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path))
    trainer, _, _ = build(_compose())
    assert not [c for c in trainer.callbacks if isinstance(c, TraceProfiler)]
    trainer, _, _ = build(_compose("profiler=torch"))
    [profiler] = [c for c in trainer.callbacks if isinstance(c, TraceProfiler)]
    assert profiler.dirpath == f"{tmp_path}/profiler" and profiler.ranks == [0]
