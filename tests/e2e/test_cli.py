"""The Hydra entry point: composition, recipes, bad input before any process group, a real run."""

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from cli_configs import compose_train as _compose
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_ultrascale import LlamaModule
from lightning_ultrascale.cli.plan import check
from lightning_ultrascale.cli.train import (
    CONFIG_DIR,
    RECIPES_DIR,
    _model_config,
    build,
    hydra_argv,
    plugins,
)
from lightning_ultrascale.cli.train import main as train_main
from lightning_ultrascale.core.strategy import UltraScaleStrategy
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.parallel.data import DataParallel
from lightning_ultrascale.parallel.dims import DataShape
from lightning_ultrascale.parallel.plugin import APPLY_ORDER
from lightning_ultrascale.testing.commands import Completed, run_command
from lightning_ultrascale.testing.spawn import free_port

TRAIN = [sys.executable, "-m", "lightning_ultrascale.cli.train"]


def test_compose_applies_command_line_overrides():
    cfg = _compose("parallel.dp=2", "model=llama_tiny", "trainer.max_steps=50")
    assert cfg.parallel.zero.size == 2 and cfg.model.name == "llama_tiny" and cfg.trainer.max_steps == 50
    assert cfg.data.source == "pydoc" and cfg.precision.precision == "32-true"


def test_build_derives_gradient_accumulation_from_the_global_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path))
    cfg = _compose("data.global_batch_size=32", "data.micro_batch_size=4", "trainer.devices=2")
    trainer, module, datamodule = build(cfg)
    assert trainer.accumulate_grad_batches == 4  # 32 / (4 x dp=2)
    assert module.config.name == "llama_tiny" and datamodule.micro_batch_size == 4
    assert not dist.is_initialized()


def test_precision_fp8_builds_the_fp8_plugin(tmp_path, monkeypatch):
    from lightning_ultrascale import FP8Precision

    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path))
    trainer, _, _ = build(_compose("precision=fp8_tensorwise", "model=llama_small"))
    plugin = trainer.precision_plugin
    assert isinstance(plugin, FP8Precision) and (plugin.recipe, plugin.precision) == ("tensorwise", "bf16-mixed")
    assert trainer.strategy.precision_plugin is plugin and not dist.is_initialized()


def test_kernels_group_builds_the_module_with_that_kernel_set(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path))
    _, module, _ = build(_compose("kernels=triton"))
    assert module.kernels.name == "triton" and module.kernels.linear_cross_entropy is not None
    _, module, _ = build(_compose("kernels.fused_cross_entropy=true"))
    assert module.kernels.name == "reference" and module.kernels.linear_cross_entropy is not None
    assert not dist.is_initialized()
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET")  # conftest runs Triton in its interpreter; a user's CPU does not
        with pytest.raises(ConfigError, match=r"kernels=triton runs Triton kernels, which need a CUDA GPU.*=compile"):
            build(_compose("kernels=triton"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.name=llama_huge"], r"model=llama_huge is unknown; valid: llama_tiny, llama_small, llama3_1b"),
        (["data=tokens", "data.source=/nonexistent/corpus.bin"], r"data.source=/nonexistent/corpus.bin"),
        (["data.global_batch_size=6", "data.micro_batch_size=2"], r"data.global_batch_size=6 .* = 4; valid: 4, 8"),
        (["parallel.dp=3"], r"dp_replicate=3 .* multiply to 3, but the job has 2 ranks"),
        (["data.seq_len=4096"], r"data.seq_len=4096 exceeds model.max_seq_len=256"),
        (["optim.name=lion"], r"optim.name='lion' is unknown; valid: adamw, muon, sgd"),
        (["precision=fp8_rowwise", "precision.fp8=fp4"], r"precision.fp8='fp4' is unknown; valid: tensorwise, rowwise"),
        (["precision=fp8_rowwise", "precision.precision=32-true"], r"precision.precision='32-true' cannot carry FP8"),
        (["precision=fp8_blockwise", "precision.emulate=false"], r"precision.emulate=False with the blockwise recipe"),
    ],
)
def test_bad_input_fails_before_any_process_group(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=message):
        build(_compose(*overrides))
    assert not dist.is_initialized()


def test_strategy_rejects_a_layout_when_the_trainer_is_built():
    with pytest.raises(ConfigError, match=r"multiply to 3, but the job has 2 ranks"):
        L.Trainer(strategy=UltraScaleStrategy(DataParallel(3)), accelerator="cpu", devices=2)
    with pytest.raises(ConfigError, match=r"one plugin per technique; got several for: data"):
        UltraScaleStrategy(DataParallel(), DataParallel())
    assert not dist.is_initialized()


def test_unknown_recipe_names_the_valid_ones():
    valid = (
        "deepseek_v2_lite, llama3_405b, llama3_70b, llama3_8b, llama3_8b_fp8, llama_tiny_cpu, "
        "mistral_vocab_cpu, mixtral_8x7b, moe_tiny_cpu"
    )
    with pytest.raises(ConfigError, match=rf"recipe='llama9' is unknown; valid: {valid}"):
        hydra_argv(["recipe=llama9"])


def test_recipe_composes_through_the_real_entry_point(tmp_path):
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(tmp_path)}
    out = _train("recipe=llama3_8b", "--cfg", "job", env=env, world_size=1)
    assert out.returncode == 0, out.stderr
    assert "name: llama3_8b" in out.stdout and "precision: bf16-mixed" in out.stdout
    assert "global_batch_size: 512" in out.stdout


def test_a_config_error_exits_with_one_readable_line(tmp_path):
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(tmp_path)}
    out = _train("parallel.dp=3", env=env, world_size=1)  # (the job's 2 ranks are trainer.devices=2's)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "ultrascale-train: parallel dims" in out.stderr and "Traceback" not in out.stderr


def _train_overrides(steps: int = 4) -> list[str]:
    return [
        f"trainer.max_steps={steps}",
        "trainer.log_every_n_steps=1",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        "data.seq_len=64",
        "data.micro_batch_size=2",
        "data.global_batch_size=8",
        "trainer.enable_progress_bar=false",
    ]


def _train(*overrides: str, env: dict[str, str], cwd: Path | None = None, world_size: int = 2) -> Completed:
    """``ultrascale-train OVERRIDES`` with its ranks forked from this process (no fresh imports: seconds, not
    tens of seconds); the tests of Lightning's launcher, torchrun, srun and sweeps start real processes."""
    return run_command(train_main, ["ultrascale-train", *overrides], env, world_size=world_size, cwd=cwd)


def test_two_process_training_run_shares_one_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    overrides = [*_train_overrides(steps=6), "checkpoint_every_n_steps=3", "callbacks.metrics.window=2"]
    out = subprocess.run([*TRAIN, *overrides], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert any(r.get("train/tokens_per_s") for r in rows)
    assert (run_dir / "checkpoints" / "last.ckpt").is_dir()
    assert [p.name for p in run_dir.rglob(".hydra")] == [".hydra"]  # rank 0 only
    assert not (tmp_path / "outputs").exists() and not (Path.cwd() / "outputs" / "run").exists()


def test_moe_recipe_trains_with_expert_parallelism_and_logs_the_balance(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    overrides = ["recipe=moe_tiny_cpu", *_train_overrides(steps=4), "model.moe.aux_loss=switch"]
    out = _train(*overrides, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ExpertParallel(ep=2)" in out.stderr + out.stdout
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    imbalance = [float(r["moe/max_over_mean"]) for r in rows if r.get("moe/max_over_mean")]
    assert len(imbalance) == 4 and all(x >= 1.0 for x in imbalance)
    assert any(r.get("train/aux_loss") for r in rows) and any(r.get("moe/bias_range") for r in rows)


def test_moe_options_on_a_dense_model_are_refused_before_any_process_group(tmp_path):
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(tmp_path)}
    out = _train("parallel.ep=2", env=env, world_size=1)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "parallel.ep=2 splits MoE experts, but model llama_tiny has none" in out.stderr


def test_torchrun_launch_shares_one_run_dir_without_a_rendezvous_id(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ULTRASCALE_RUN_DIR"}
    env["OMP_NUM_THREADS"] = "1"
    port = str(free_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port]
    cmd = [*torchrun, "-m", "lightning_ultrascale.cli.train", "cluster=torchrun", *_train_overrides()]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dirs = list((tmp_path / "outputs").iterdir())
    assert len(run_dirs) == 1 and run_dirs[0].name.startswith("torchrun-"), run_dirs
    assert (run_dirs[0] / "csv" / "metrics.csv").is_file() and (run_dirs[0] / "checkpoints" / "last.ckpt").is_dir()
    assert [p.name for p in run_dirs[0].rglob(".hydra")] == [".hydra"]


def test_slurm_launch_names_the_run_dir_after_the_job(tmp_path):
    """Two processes started as ``srun`` would start them: SLURM's variables, no launcher of ours or Lightning's."""
    base = {k: v for k, v in os.environ.items() if k != "ULTRASCALE_RUN_DIR" and not k.startswith("SLURM_")}
    base.update(
        OMP_NUM_THREADS="1",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="ultrascale",
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_JOB_NUM_NODES="1",
        SLURM_NODEID="0",
        SLURM_NODELIST="127.0.0.1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    # (Forked, as testing.commands does, with each task's own SLURM_PROCID: what srun would set.)
    tasks = lambda r: {"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}  # noqa: E731
    out = run_command(
        train_main, ["ultrascale-train", "cluster=slurm", *_train_overrides()], base, world_size=2, cwd=tmp_path,
        rank_env=tasks,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "outputs" / "slurm-4242"
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["slurm-4242"]
    assert (run_dir / "csv" / "metrics.csv").is_file()
    assert [p.name for p in run_dir.rglob(".hydra")] == [".hydra"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["parallel=zero3"], "ZeRO(stage=3, dp_replicate=1, dp_shard=None)"),
        (
            ["parallel=hsdp", "trainer.devices=4", "data.micro_batch_size=4"],
            "ZeRO(stage=3, dp_replicate=2, dp_shard=None)",
        ),
        (["parallel=zero2", "parallel.recompute=selective", "parallel.recompute_every=2"], "Recompute"),
        (["parallel=pp"], "PipelineParallel(schedule=1f1b, microbatches=2, virtual_stages=1, pp=2)"),
        (["parallel.cp=2"], "ContextParallel(method=zigzag_ring, kernel=flash, cp=2)"),
    ],
)
def test_parallel_group_builds_the_plugins(tmp_path, monkeypatch, overrides, expected):
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path))
    trainer, _, _ = build(_compose(*overrides))
    assert expected in trainer.strategy.describe()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.zero_stage=4"], r"parallel.zero_stage=4 is not a ZeRO stage; valid: 0, 1, 2, 3"),
        (["parallel.recompute=most"], r"parallel.recompute='most' is unknown; valid: none, full, selective"),
        (["parallel=zero2", "parallel.recompute=selective", "parallel.recompute_every=0"], r"recompute_every=0"),
        (["parallel=zero2", "parallel.bucket_mb=0"], r"parallel.bucket_mb=0 must be > 0"),
        (["parallel=pp", "parallel.pp_schedule=gpipe2"], r"parallel.pp_schedule='gpipe2' is unknown; valid: afab"),
        (["parallel=pp", "parallel.pp_microbatches=3"], r"micro_batch_size=8 .* by parallel.pp_microbatches=3"),
        (
            ["parallel=pp", "parallel.pp=4", "parallel.pp_schedule=interleaved_1f1b", "trainer.devices=4"],
            r"= 8 stages, but model llama_tiny has n_layers=4",
        ),
        (["parallel=pp", "parallel.pp_split_points=[layers.7]"], r"layers.7 are not split points; valid: layers.1"),
        (["parallel.cp=2", "parallel.cp_method=striped"], r"parallel.cp_method='striped' is unknown; valid: ring"),
        (["parallel.cp=2", "data.seq_len=250"], r"data.seq_len=250 must be divisible by 4 for parallel.cp=2"),
        (
            ["parallel.cp=4", "parallel.cp_method=all_to_all", "parallel.tp=2", "trainer.devices=8"],
            r"n_heads / tp = 4 / 2 = 2; valid cp: 1, 2",
        ),
    ],
)
def test_bad_parallel_settings_fail_before_any_process_group(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=message):
        build(_compose(*overrides))
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["parallel.tp=4", "trainer.devices=4"],
            r"parallel.tp=4 must divide n_kv_heads=2 of model llama_tiny; valid: 1, 2",
        ),
        (["parallel.tp=2", "data.seq_len=65"], r"data.seq_len=65 must be divisible by parallel.tp=2"),
        (["parallel.tp=4"], r"world size 2 is not divisible by tp=4"),
    ],
)
def test_bad_tensor_parallel_layouts_fail_before_any_process_group(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=message):
        build(_compose(*overrides))
    assert not dist.is_initialized()


def test_a_sweep_writes_one_complete_run_directory_per_job(tmp_path):
    """``-m`` over two layouts: two separate runs, ranks that never re-launch the sweep."""
    run_dir = tmp_path / "sweep"
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    cmd = [*TRAIN, "-m", "parallel=zero1,zero2", *_train_overrides(steps=2)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = sorted(p.name for p in run_dir.iterdir() if p.is_dir())
    assert jobs == ["0", "1"], jobs
    for job, stage in (("0", 1), ("1", 2)):
        job_dir = run_dir / job
        rows = list(csv.DictReader((job_dir / "csv" / "metrics.csv").open()))
        assert [r["train/loss"] for r in rows if r.get("train/loss")], f"job {job} logged no loss"
        assert [p.name for p in (job_dir / "checkpoints").iterdir()] == ["last.ckpt"]  # no last-v1.ckpt
        assert [p.name for p in job_dir.rglob(".hydra")] == [".hydra"]
        assert (job_dir / "train_ddp_process_1.log").is_file()  # the job's second rank wrote here too
        assert f"stage: {stage}" in (job_dir / ".hydra" / "config.yaml").read_text()
    assert (run_dir / "multirun.yaml").is_file()
    # No rank ran the sweep again (it would have made a second sweep tree or a third job).
    assert not list(tmp_path.rglob("multirun")) and not (tmp_path / "outputs").exists()


def test_logger_tensorboard_writes_event_files(tmp_path):
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(tmp_path / "run"), "OMP_NUM_THREADS": "1"}
    out = _train(
        "logger=tensorboard", "trainer.devices=1", *_train_overrides(steps=2), env=env, cwd=tmp_path, world_size=1
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def test_a_logger_whose_package_is_missing_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path))
    from lightning_utilities.core.imports import RequirementCache

    # As on a machine without wandb, wherever this runs.
    missing = RequirementCache("wandb-is-not-installed-here")
    monkeypatch.setattr(sys.modules["lightning.pytorch.loggers.wandb"], "_WANDB_AVAILABLE", missing)
    with pytest.raises(ConfigError, match=r"logger.wandb .* needs a package that is not installed.*pip install wandb"):
        build(_compose("logger=wandb"))
    assert not dist.is_initialized()


def _losses(run_dir: Path) -> dict[int, str]:
    rows = csv.DictReader((run_dir / "csv" / "metrics.csv").open())
    return {int(r["step"]): r["train/loss"] for r in rows if r.get("train/loss")}


def test_the_readme_resume_path_continues_exactly(tmp_path):
    """Train to 3 steps, then ``ckpt_path=.../last.ckpt trainer.max_steps=6``: the end-of-training checkpoint.

    ZeRO-3, so the checkpoint is sharded: one file per rank. (Resuming it in another layout is
    test_checkpoint_layouts.py's job, without the CLI's subprocesses.)
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [*_train_overrides(steps=6), "data.global_batch_size=16", "trainer.val_check_interval=100"]

    def train(name: str, *overrides: str) -> Path:
        run_dir = tmp_path / name
        out = _train(*base, *overrides, env={**env, "ULTRASCALE_RUN_DIR": str(run_dir)})
        assert out.returncode == 0, out.stderr[-3000:]
        return run_dir

    uninterrupted = _losses(train("six", "parallel=zero3"))
    first = train("three", "parallel=zero3", "trainer.max_steps=3")
    last = first / "checkpoints" / "last.ckpt"
    assert len(list(last.glob("*.distcp"))) == 2  # one shard file per rank
    resumed = _losses(train("resumed", "parallel=zero3", f"ckpt_path={last}"))
    assert len(resumed) == 3 and len(uninterrupted) == 6
    # Same layout: the very same losses (CSV text), step for step, numbered after the first run's.
    assert list(resumed.values()) == list(uninterrupted.values())[3:], (resumed, uninterrupted)
    assert min(resumed) > max(_losses(first)), (resumed, _losses(first))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.pp=-1"], r"parallel.pp=-1 must be a positive integer"),
        (["parallel.pp=0"], r"parallel.pp=0 must be a positive integer"),
        (["parallel.tp=0"], r"parallel.tp=0 must be a positive integer"),
        (["parallel.cp=-1"], r"parallel.cp=-1 must be a positive integer"),
        (["parallel.dp=0"], r"parallel.dp=0 must be a positive integer or None \(inferred\)"),
        (["parallel.pp_schedule=bogus"], r"parallel.pp_schedule='bogus' is unknown; valid: afab, 1f1b"),
        (["parallel.pp_microbatches=0"], r"parallel.pp_microbatches=0 must be a positive integer"),
        (["parallel.pp_virtual_stages=0"], r"parallel.pp_virtual_stages=0 must be a positive integer"),
        (["parallel.bucket_mb=-1"], r"parallel.bucket_mb=-1 must be > 0"),
        (["parallel.cp_method=spiral"], r"parallel.cp_method='spiral' is unknown; valid: ring, zigzag_ring"),
        (["data.micro_batch_size=0"], r"data.micro_batch_size=0 must be > 0"),
        (["data.global_batch_size=0"], r"data.global_batch_size=0 must be a positive multiple of .*valid: 16, 32"),
        (["ckpt_path=/nonexistent/last.ckpt"], r"ckpt_path=/nonexistent/last.ckpt does not exist; a checkpoint is"),
    ],
)
def test_every_option_is_checked_whether_or_not_its_plugin_is_on(tmp_path, monkeypatch, overrides, message):
    """Plugins of size 1 are built too, so their settings are checked (pp=0 used to train as plain DP)."""
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=message):
        build(_compose(*overrides))
    assert not dist.is_initialized()


def test_a_directory_that_is_no_checkpoint_says_what_it_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path / "run"))
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "notes.txt").write_text("not a checkpoint")
    message = rf"ckpt_path={garbage} is a directory but not a checkpoint .* holds: notes.txt"
    with pytest.raises(ConfigError, match=message):
        build(_compose(f"ckpt_path={garbage}"))
    assert not dist.is_initialized()


def test_token_ids_beyond_the_vocabulary_are_refused_before_any_process_group(tmp_path, monkeypatch):
    import numpy as np

    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path / "run"))
    tokens = tmp_path / "tokens.bin"
    np.arange(400 * 64, dtype=np.uint16).__mod__(400).tofile(tokens)  # ids 0..399; llama_tiny has 320
    overrides = ["data=tokens", f"data.source={tokens}", "data.seq_len=64", "data.micro_batch_size=2"]
    # A .bin without an index does not say its vocabulary: its largest id is what it knows.
    message = r"data.source=.*tokens.bin' holds token id 399, but model llama_tiny has vocab_size=320; valid ids"
    with pytest.raises(ConfigError, match=message):
        build(_compose(*overrides, "data.global_batch_size=4"))
    assert not dist.is_initialized()
    # The max is remembered beside the file for the next run (every rank reads it).
    assert (tmp_path / "tokens.bin.maxid.json").is_file()


def test_data_blend_builds_a_weighted_blend_from_the_command_line(tmp_path, monkeypatch):
    from lightning_ultrascale.data.prepare import main as tokenize_main

    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path / "run"))
    for name in ("web", "code"):
        (tmp_path / f"{name}.txt").write_text(f"{name} text " * 400, encoding="utf-8")
        tokenize_main([str(tmp_path / f"{name}.txt"), str(tmp_path / f"{name}.bin"), "--no-progress"])
    web, code = tmp_path / "web.bin", tmp_path / "code.bin"
    sources = f"data.sources=[{{path: {web}, weight: 0.7}}, {{path: {code}, weight: 0.3, name: py}}]"
    shape = ["data.seq_len=32", "data.micro_batch_size=2", "data.global_batch_size=4", "data.val_fraction=0.1"]
    _, _, datamodule = build(_compose("data=blend", sources, *shape))
    assert [(s.name, s.weight) for s in datamodule.sources] == [("web", 0.7), ("py", 0.3)]
    assert datamodule.dtype == "uint16" and not dist.is_initialized()
    with pytest.raises(ConfigError, match=r"data\.sources\[1\]\.weight=0\.0 must be > 0"):
        build(_compose("data=blend", sources.replace("0.3", "0"), *shape))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model=nonexistent", r"model=nonexistent is unknown; valid: deepseek_v2_lite, .*llama_tiny"),
        ("data=web", r"data=web is unknown; valid: blend, pydoc, tokens"),
        ("parallel=zero4", r"parallel=zero4 is unknown; valid: auto, dp, hsdp, pp, zero1, zero2, zero3"),
        ("precision=fp8", r"precision=fp8 is unknown; valid: bf16_mixed, fp32"),
        ("logger=[csv,wandbx]", r"logger=wandbx is unknown; did you mean logger=wandb\? valid: csv, mlflow"),
        ("precision=bf16-mixed", r"precision=bf16-mixed is unknown; did you mean precision=bf16_mixed\? valid: bf16"),
    ],
)
def test_an_unknown_group_option_lists_the_valid_ones(override, message):
    with pytest.raises(ConfigError, match=message):
        hydra_argv([override])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # the precision is a config group's: not Hydra's "use +trainer.precision", which would fight it
        ("trainer.precision=bf16-mixed", r"trainer.precision=bf16-mixed: the config has no key 'trainer.precision'; "
         r"did you mean precision=bf16_mixed \(the precision group sets precision; valid: bf16_mixed, fp32"),
        ("data.seqlen=128", r"data.seqlen=128: the config has no key 'data.seqlen'; did you mean data.seq_len=128$"),
        ("trainer.max_step=5", r"did you mean trainer.max_steps=5 \(to pass a Lightning Trainer argument the config "
         r"does not list: \+trainer.max_step=5\)"),
        ("data.foo=2", r"data.foo=2: the config has no key 'data.foo'; data has: _target_, source, seq_len"),
        ("foo=1", r"foo=1: the config has no key 'foo'; its top-level keys are: model, data, parallel"),
    ],
)  # fmt: skip
def test_an_override_the_config_does_not_have_names_its_near_matches(tmp_path, override, message):
    # Before: Hydra's ConfigCompositionException, "Key 'precision' is not in struct" and a stack-trace hint.
    out = _train(override, env={**os.environ, "ULTRASCALE_RUN_DIR": str(tmp_path)}, world_size=1)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "HYDRA_FULL_ERROR" not in out.stderr, out.stderr
    (line,) = [line for line in out.stderr.splitlines() if line.startswith("ultrascale-train: ")]
    assert re.search(message, line), line


def test_checkpoint_keep_leaves_the_newest_k_and_last(tmp_path):
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(tmp_path / "run"), "OMP_NUM_THREADS": "1"}
    out = _train(*_train_overrides(steps=4), "checkpoint.every_n_steps=1", "checkpoint.keep=2", env=env, cwd=tmp_path)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "last.ckpt", "step=3.ckpt", "step=4.ckpt"
    ]  # fmt: skip


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
def test_every_recipe_composes_and_its_layout_fits_its_cluster(recipe, monkeypatch):
    # GPU recipes cannot run here; their layout, batch and model are checked as a run would check
    # them before any process group (the world size is the recipe's devices x nodes; torchrun's
    # variables as on one node of 8 GPUs, where a recipe does not set its number of nodes).
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base="1.3"):
        cfg = compose(recipe, overrides=[f"hydra.searchpath=[file://{CONFIG_DIR}]"])
    config = _model_config(cfg.model)
    strategy = UltraScaleStrategy(*plugins(cfg.parallel))
    shape = DataShape(cfg.data.seq_len, cfg.data.micro_batch_size, cfg.data.global_batch_size)
    world = int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
    module = LlamaModule(config, kernels=cfg.kernels.name, fused_cross_entropy=cfg.kernels.fused_cross_entropy)
    strategy.validate(module.model_spec, shape, world_size=world)
    assert cfg.data.seq_len <= config.max_seq_len and not dist.is_initialized()
    if OmegaConf.is_missing(cfg.data, "source"):  # trains on a token file: it names the model's tokenizer
        assert cfg.data.tokenizer, f"recipe={recipe} trains on data.source=... but names no data.tokenizer"
    # The layout at the recipe's world size, as the planner predicts it: the first and last rank of
    # every stage (past 64 ranks the first, a middle and the last rank: a 405B stage takes ~0.7 s).
    ranks = "stages" if world <= 64 else f"0,{world // 2},{world - 1}"
    assert check([f"recipe={recipe}"], world_size=world, ranks=ranks)
    if cfg.precision.get("fp8"):  # every block linear suits the recipe; only the head stays bf16
        from lightning_ultrascale.fp8 import plan_fp8
        from lightning_ultrascale.models import build_model

        plan = plan_fp8(build_model(config, device="meta"), cfg.precision.fp8, tp=strategy.parallel_dims.tp)
        assert list(plan.skipped) == ["output"] and len(plan.converted) == 7 * config.n_layers


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.moe.top_k=2"], "model.moe.top_k is set, but model=llama_tiny has no mixture of experts; valid: a"),
        (["model=moe_tiny", "model.moe.topk=2"], "model.moe.topk is unknown; valid: n_routed_experts, top_k"),
        (["model=moe_tiny", "model.moe.top_k=9"], "model.moe.top_k=9 must be at most model.moe.n_routed_experts=8"),
        (["model=moe_tiny", "model.mla.kv_lora_rank=8"], "model.mla.kv_lora_rank is set, but model=moe_tiny has no"),
        (["model=mixtral_8x7b", "model.rope_scaling.factor=8"], "model=mixtral_8x7b has no rope scaling; valid: a"),
        (["model.foo=1"], "model.foo=1 is unknown; valid: name, init_from, dim, n_layers, n_heads, n_kv_heads, vocab"),
        (["model.n_heads=3"], "model.n_heads=3 must divide model.dim=64 into an even head_dim; valid: 1, 2, 4, 8,"),
        (["model.n_layers=0"], "model.n_layers=0 must be a positive integer"),
        (["model.n_layers=2", "data.seq_len=512"], "data.seq_len=512 exceeds model.max_seq_len=256 of llama_tiny(n_"),
    ],
)
def test_model_options_are_checked_against_the_preset(tmp_path, monkeypatch, overrides, message):
    # In process, through the entry point's argv rewriting (test_a_config_error_exits_with_one_readable_line
    # covers its exit).
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=re.escape(message)):
        build(_compose(*overrides))
    assert not dist.is_initialized()


def test_model_keys_change_the_named_preset(tmp_path, monkeypatch):
    from dataclasses import asdict

    from lightning_ultrascale.models import get_model_config

    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path))
    _, module, _ = build(_compose("model=llama_tiny", "model.vocab_size=32000", "model.n_layers=2"))
    config, preset = module.config, get_model_config("llama_tiny")
    assert (config.vocab_size, config.n_layers) == (32000, 2)
    changed = {k for k, v in asdict(config).items() if v != asdict(preset)[k]}
    assert changed == {"vocab_size", "n_layers", "name"}
    # The name a checkpoint records and the logs print says what differs from the preset.
    assert config.name == module.hparams["model"] == "llama_tiny(n_layers=2, vocab_size=32000)"
    assert module.model_spec.n_layers == 2 and module.model_spec.vocab_size == 32000
    _, module, _ = build(_compose("model=moe_tiny", "model.moe.top_k=4", "model.rope_theta=10000.0"))
    assert module.config.name == "moe_tiny(rope_theta=10000.0, moe.top_k=4)" and module.config.moe.top_k == 4
    assert not dist.is_initialized()


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml") if p.stem != "hf"))
def test_every_model_node_is_its_preset(name):  # (model=hf: its directory's, tests/e2e/test_hf_cli.py)
    from lightning_ultrascale.models import get_model_config

    assert _model_config(_compose(f"model={name}").model) == get_model_config(name)


def test_init_from_an_hf_directory_of_other_sizes_is_refused(tmp_path, monkeypatch):
    from lightning_ultrascale.models import get_model_config
    from lightning_ultrascale.models.hf.convert import config_to_hf

    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path / "run"))
    hf = tmp_path / "tiny"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", **config_to_hf(get_model_config("llama_tiny"))}))
    # The directory's architecture must be the changed model's, as it must be the preset's: refused
    # while the run is built, before any process group.
    message = r"init_from=hf:.*tiny is another architecture than .*: n_layers=4 \(model llama_tiny\(n_layers=2\): 2\)"
    with pytest.raises(ConfigError, match=message):
        build(_compose(f"model.init_from=hf:{hf}", "model.n_layers=2"))
    assert not dist.is_initialized()


def test_a_model_of_other_sizes_trains_on_the_bundled_corpus(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    overrides = ["model.vocab_size=512", "model.n_layers=2", *_train_overrides(steps=3)]  # byte ids < 512
    out = _train(*overrides, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(_losses(run_dir)) == 3
    meta = torch.load(run_dir / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=False)
    config = meta["hyper_parameters"]["model_config"]
    assert (config["vocab_size"], config["n_layers"]) == (512, 2)
    assert config["name"] == "llama_tiny(n_layers=2, vocab_size=512)"


# ------------------------------------------------------------------------ a user's own DataModule
#: The default data node with its target swapped for a class of tests/user_datamodule.py, and the
#: keys that class does not take dropped.
NOT_TAKEN = ["~data.source", "~data.val_fraction", "~data.num_workers", "~data.documents", "~data.mask_eos_loss"]
USER_DATA = ["data._target_=user_datamodule.CountingTokens", *NOT_TAKEN]
UNSHAPED_DATA = ["data._target_=user_datamodule.UnshapedTokens", *NOT_TAKEN, "~data.seed"]


def test_a_users_datamodule_trains_through_the_cli(tmp_path):
    run_dir = tmp_path / "run"
    path = os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    overrides = [*USER_DATA, *_train_overrides(steps=4)]
    out = _train(*overrides, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "gradient accumulation 2" in out.stderr + out.stdout  # 8 / (2 x dp=2), from the DataModule's shape
    losses = list(map(float, _losses(run_dir).values()))
    assert len(losses) == 4 and losses[-1] < losses[0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data._target_=no_such_pkg.DataModule"], r"data._target_=no_such_pkg.DataModule cannot be imported; valid: "),
        (
            ["data._target_=user_datamodule.CountingTokens"],
            r"data.source='pydoc' is not an argument of user_datamodule.CountingTokens; valid: seq_len, "
            r"micro_batch_size, vocab_size, seed \(drop it with ~data.source\)",
        ),
        ([*USER_DATA, "~data.seq_len"], r"data.seq_len is not set, and user_datamodule.CountingTokens needs it"),
        # The checks a DataModule's declared shape gets, named by its own keys:
        ([*USER_DATA, "parallel.cp=2", "data.seq_len=250"], r"data.seq_len=250 must be divisible by 4 for parallel.cp"),
        ([*USER_DATA, "data.seq_len=4096"], r"data.seq_len=4096 exceeds model.max_seq_len=256 of llama_tiny"),
        ([*USER_DATA, "data.global_batch_size=6", "data.micro_batch_size=2"], r"data.global_batch_size=6 .* valid: 4"),
        ([*USER_DATA, "+data.vocab_size=400"], r"holds token id 399, but model llama_tiny has vocab_size=320"),
        (
            UNSHAPED_DATA,
            r"data.global_batch_size=16 needs the micro batch size, but UnshapedTokens declares no integer micro_batch",
        ),
    ],
)
def test_a_users_datamodule_is_checked_before_any_process_group(tmp_path, monkeypatch, overrides, message):
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match=message) as err:
        build(_compose(*overrides))
    assert "\n" not in str(err.value) and not dist.is_initialized()


def test_a_datamodule_that_declares_no_shape_is_built_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path))
    cfg = _compose(*UNSHAPED_DATA, "data.global_batch_size=null")
    trainer, _, datamodule = build(cfg)
    assert type(datamodule).__name__ == "UnshapedTokens" and trainer.accumulate_grad_batches == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["data: UnshapedTokens declares no integer seq_len and micro_batch_size: its batches are not "
                        "checked against the layout before training"]  # fmt: skip
    assert not dist.is_initialized()


def test_a_data_group_file_in_a_users_config_dir_is_a_valid_choice(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "counting.yaml").write_text(
        "_target_: user_datamodule.CountingTokens\nseq_len: 64\nmicro_batch_size: 2\nglobal_batch_size: 8\n"
    )
    assert hydra_argv(["--config-dir", str(tmp_path), "data=counting"])[0] == f"--config-dir={tmp_path}"
    unknown = r"data=countin is unknown; did you mean data=counting\? valid: blend, counting, pydoc, tokens \(in "
    with pytest.raises(ConfigError, match=unknown):
        hydra_argv([f"--config-dir={tmp_path}", "data=countin"])
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(tmp_path / "run")}
    out = _train(f"--config-dir={tmp_path}", "data=counting", "--cfg", "job", env=env, world_size=1)
    assert out.returncode == 0, out.stderr
    assert "_target_: user_datamodule.CountingTokens" in out.stdout and "source" not in out.stdout


def test_a_plugin_node_in_a_users_config_dir_has_short_keys(tmp_path):
    (tmp_path / "parallel" / "mine").mkdir(parents=True)
    (tmp_path / "parallel" / "mine" / "default.yaml").write_text("_target_: my_pkg.Mine\nsize: 1\n")
    argv = [f"--config-dir={tmp_path}", "+parallel/mine=default", "parallel.mine=2", "parallel.mine_every=3"]
    assert hydra_argv(argv)[2:] == ["parallel.mine.size=2", "parallel.mine.every=3"]


# ------------------------------------------------------------------------ bad input before any process group
def test_masked_documents_on_a_token_file_without_document_starts_are_refused(tmp_path, monkeypatch):
    from lightning_ultrascale.data.index import documents_path
    from lightning_ultrascale.data.prepare import tokenize_corpus
    from lightning_ultrascale.data.tokenizer import load_tokenizer

    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path / "run"))
    (tmp_path / "c.txt").write_text("a document of its own " * 2000)
    tokenize_corpus([tmp_path / "c.txt"], tmp_path / "c.bin", load_tokenizer("byte"))
    documents_path(tmp_path / "c.bin").unlink()  # a file from before the index carried document starts
    cfg = _compose("data=tokens", f"data.source={tmp_path / 'c.bin'}", "data.documents=mask", "data.seq_len=64")
    with pytest.raises(ConfigError, match=r"data\.documents=mask .*ultrascale-tokenize.*data\.documents=concat"):
        build(cfg)
    assert not dist.is_initialized()


def test_a_checkpoint_copy_without_its_meta_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path / "run"))
    partial = tmp_path / "last.ckpt"
    partial.mkdir()
    (partial / ".metadata").write_bytes(b"")  # DCP's index, but no meta.pt (was: IsADirectoryError after the PG)
    with pytest.raises(ConfigError, match=rf"ckpt_path={partial} has DCP's .metadata but no meta.pt .* copy the whole"):
        build(_compose(f"ckpt_path={partial}"))
    assert not dist.is_initialized()


def test_a_checkpoint_copy_missing_a_shard_file_or_truncated_is_refused(tmp_path, monkeypatch):
    # Was: FileNotFoundError .../__1_0.distcp on every rank, after the process group.
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path / "run"))
    saved = tmp_path / "last.ckpt"
    dcp.save({"w": torch.zeros(1000)}, checkpoint_id=saved)
    (saved / "meta.pt").write_bytes(b"")
    [shard] = sorted(saved.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ConfigError, match=rf"ckpt_path={saved} is incomplete: truncated {shard.name} \(of the 1 shard"):
        build(_compose(f"ckpt_path={saved}"))
    shard.unlink()
    with pytest.raises(ConfigError, match=rf"ckpt_path={saved} is incomplete: missing {shard.name} "):
        build(_compose(f"ckpt_path={saved}"))
    assert not dist.is_initialized()


def test_a_file_that_is_not_a_checkpoint_is_refused_without_a_traceback(tmp_path, monkeypatch):
    # Was: torch.load's "PytorchStreamReader failed reading zip archive" (a truncated .ckpt, a token file).
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path / "run"))
    single = tmp_path / "model.ckpt"
    torch.save({"state_dict": {}}, single)
    single.write_bytes(single.read_bytes()[:50])
    with pytest.raises(ConfigError, match=rf"ckpt_path={single} is a file but not a checkpoint .*truncated"):
        build(_compose(f"ckpt_path={single}"))
    assert not dist.is_initialized()


def test_a_split_backward_schedule_with_op_level_recomputation_is_refused(tmp_path, monkeypatch):
    # Was: "Trying to backward an extra time ... selective activation checkpoint" at the first step
    # (zbv, zero_bubble, dualpipev; the planner's README table even recommended zbv + selective_op).
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path / "run"))
    for schedule in ("zbv", "zero_bubble", "dualpipev"):
        cfg = _compose("parallel=pp", f"parallel.pp_schedule={schedule}", "parallel.recompute=selective_op")
        refused = r"parallel\.recompute='selective_op' cannot run under .*valid: parallel\.recompute='full'"
        with pytest.raises(ConfigError, match=refused):
            build(cfg)
    build(_compose("parallel=pp", "parallel.pp_schedule=zbv", "parallel.recompute=full"))
    build(_compose("parallel=pp", "parallel.pp_schedule=1f1b", "parallel.recompute=selective_op"))
    assert not dist.is_initialized()


def test_a_checkpoint_of_another_model_names_what_differs(tmp_path, monkeypatch):
    from dataclasses import asdict

    from lightning_ultrascale.models import get_model_config

    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path / "run"))
    saved = tmp_path / "last.ckpt"
    dcp.save({"w": torch.zeros(4)}, checkpoint_id=saved)  # (one process, no process group)
    torch.save({"hyper_parameters": {"model_config": asdict(get_model_config("llama_tiny"))}}, saved / "meta.pt")
    build(_compose(f"ckpt_path={saved}"))  # the same model: accepted
    # Was: DCP's "Size mismatch ... tok_embeddings.weight.exp_avg" after the process group.
    message = r"was saved by model llama_tiny, and this run builds llama_small: dim=64 \(model llama_small: 256\)"
    with pytest.raises(ConfigError, match=message):
        build(_compose("model=llama_small", f"ckpt_path={saved}"))
    assert not dist.is_initialized()


def test_an_hf_directory_of_an_unsupported_model_type_names_the_supported_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path / "run"))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4}))
    # Was: AttributeError: 'types.SimpleNamespace' object has no attribute 'hidden_size'.
    valid = "'llama', 'qwen2', 'mixtral', 'qwen3', 'qwen3_moe', 'deepseek_v3'"
    message = rf"model.init_from=hf:.*gpt2 holds a model_type='gpt2' model; valid: {valid}"
    with pytest.raises(ConfigError, match=message):
        build(_compose(f"model.init_from=hf:{gpt2}"))
    assert not dist.is_initialized()


def test_a_token_file_shorter_than_a_global_batch_is_refused_before_any_process_group(tmp_path, monkeypatch):
    import numpy as np

    from lightning_ultrascale import LlamaModule, UltraScaleDataModule
    from lightning_ultrascale.testing.parity import QUIET_TRAINER

    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path / "run"))
    tokens = tmp_path / "tokens.bin"
    np.arange(100, dtype=np.uint16).tofile(tokens)  # fewer than one sequence of 64 + 1 per rank of 2
    overrides = ["data=tokens", f"data.source={tokens}", "data.seq_len=64", "data.micro_batch_size=1"]
    message = r"data.source=.*tokens.bin has 100 tokens, 1 training sequences: .* x dp=2 needs 2 sequences"
    with pytest.raises(ConfigError, match=message):
        build(_compose(*overrides, "data.global_batch_size=2", "data.val_fraction=0"))
    # And from Python: trainer.fit checks it before it sets up any process group. (Lightning's
    # launcher leaves LOCAL_RANK and MASTER_PORT in this process's environment, which would make
    # later launches here wait for ranks started "externally": restore it.)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=UltraScaleStrategy(), max_steps=1, **QUIET_TRAINER)
    data = UltraScaleDataModule(str(tokens), seq_len=128, micro_batch_size=1, val_fraction=0)
    environ = dict(os.environ)
    try:
        with pytest.raises(ConfigError, match=r"has 100 tokens, 0 training sequences"):
            trainer.fit(LlamaModule("llama_tiny"), datamodule=data)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    assert not dist.is_initialized()


def test_the_mixtral_recipe_layout_trains_on_cpu(tmp_path):
    # The recipe's plugins (ZeRO-3, zig-zag CP, EP over neighbouring ranks) at dp2 x cp2 x ep2 on moe_tiny, with
    # a validation and the final checkpoint. (Its earlier layout's failures, MoE under ZBV and ZeRO-1's 3-D expert
    # state, are held by tests/multiprocess/test_expert.py.)
    run_dir = tmp_path / "run"
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    overrides = [
        "recipe=mixtral_8x7b", "model=moe_tiny", "data=pydoc", "trainer=cpu", "cluster=local", "precision=fp32",
        "trainer.devices=4", "trainer.num_nodes=1", *_train_overrides(steps=3), "data.micro_batch_size=4",
        "optim.warmup_steps=1",
    ]  # fmt: skip
    out = _train(*overrides, env=env, cwd=tmp_path, world_size=4)
    assert out.returncode == 0, out.stderr[-3000:]
    layout = out.stderr + out.stdout
    assert "ContextParallel(method=zigzag_ring" in layout and "ExpertParallel(ep=2)" in layout
    assert "ZeRO(stage=3" in layout
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    assert len([r for r in rows if r.get("train/loss")]) == 3 and any(r.get("val/loss") for r in rows)
    assert (run_dir / "checkpoints" / "last.ckpt" / "meta.pt").is_file()


# ------------------------------------------------------------------------ parallel=auto
def test_parallel_auto_trains_the_planner_s_best_layout_through_the_cli(tmp_path):
    # The planner searches the job on its 2 CPU ranks (the built-in cpu profile), logs the choice
    # and why the runner-up lost, and the run trains with it (benchmarks/auto_layout.py times the
    # top 3: the chosen one is the fastest measured).
    from lightning_ultrascale.plan import search

    run_dir = tmp_path / "run"
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    overrides = ["parallel=auto", *_train_overrides(steps=2)]
    out = _train(*overrides, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    from lightning_ultrascale.cli.plan import compose_run
    from lightning_ultrascale.cli.train import workload

    best = search(workload(compose_run(overrides)), 2, "cpu").best.candidate
    logged = out.stderr + out.stdout
    assert f"parallel=auto on 2 x cpu: {best.label()}" in logged and "the runner-up, " in logged
    assert (run_dir / "checkpoints" / "last.ckpt").is_dir()


def test_parallel_auto_builds_the_search_s_plugins_and_batch(tmp_path, monkeypatch):
    from lightning_ultrascale.cli.train import workload
    from lightning_ultrascale.plan import search

    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path / "run"))
    cfg = _compose("parallel=auto", "parallel.auto.space={tp: [2]}")
    best = search(workload(cfg), 2, "cpu", space={"tp": [2]}).best.candidate
    trainer, _, data = build(cfg)
    assert repr(list(trainer.strategy.applied_plugins())) == repr(
        sorted(best.plugins, key=lambda p: APPLY_ORDER.index(p.applies_at))
    )
    assert data.micro_batch_size == best.batch_per_rank and best.tp == 2
    # Compiled blocks are not a layout choice: they stay as set.
    trainer, _, _ = build(_compose("parallel=auto", "parallel.auto.space={tp: [2]}", "parallel.compile=true"))
    assert "Compile" in [type(p).__name__ for p in trainer.strategy.applied_plugins()]
    with pytest.raises(ConfigError, match=r"parallel=auto chooses every plugin, but parallel\.tp is set too"):
        build(_compose("parallel=auto", "+parallel/tp=default"))
    with pytest.raises(ConfigError, match=r"trainer\.devices='auto': parallel=auto plans for a known number"):
        build(_compose("parallel=auto", "trainer.devices=auto"))
    assert not dist.is_initialized()
