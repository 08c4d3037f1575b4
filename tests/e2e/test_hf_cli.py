"""``model=hf model.path=DIR`` on the command line: any HF directory's architecture and weights, in any
layout; its first loss is transformers' own cross-entropy on the same batch."""

import csv
import math
import os

import pytest
import torch
from hf_models import hf_config
from hydra import compose, initialize_config_dir
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_ultrascale.cli import plan as plan_cli
from lightning_ultrascale.cli.train import CONFIG_DIR, build, hydra_argv
from lightning_ultrascale.cli.train import main as train_main
from lightning_ultrascale.data import UltraScaleDataModule
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models.contract import ContractError
from lightning_ultrascale.testing.commands import run_command

DATA = ["data.seq_len=64", "data.micro_batch_size=2", "data.global_batch_size=4"]


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    """Tiny random Mixtral, Qwen2 and Qwen3-MoE written by save_pretrained (HF's own init, its own files)."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    for family in ("mixtral", "qwen2", "qwen3_moe"):
        AutoModelForCausalLM.from_config(hf_config(family)).save_pretrained(root / family)
    return root


def _transformers_first_loss(directory):
    """transformers' cross-entropy of the model in ``directory`` on the run's first global batch (one process)."""
    data = UltraScaleDataModule(source="pydoc", seq_len=64, micro_batch_size=4, val_fraction=0.05, seed=0)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():  # (router loss excluded: output_router_logits is off); labels are shifted already
        logits = model(input_ids=batch["input_ids"]).logits
        loss = model.loss_function(logits, None, model.config.vocab_size, shift_labels=batch["labels"])
    return float(loss)


@pytest.mark.parametrize(("family", "layout"), [("mixtral", "parallel.ep=2"), ("qwen2", "parallel.tp=2")])
def test_an_hf_directory_trains_from_the_command_line_from_transformers_loss(tmp_path, directories, family, layout):
    run_dir = tmp_path / "run"
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    steps = ["trainer.max_steps=1", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0"]
    cmd = ["ultrascale-train", "model=hf", f"model.path={directories / family}", layout, *DATA, *steps]
    out = run_command(train_main, cmd, env, world_size=2, cwd=tmp_path)  # (ranks forked: testing.commands)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    first = next(float(r["train/loss"]) for r in rows if r.get("train/loss"))
    expected = _transformers_first_loss(directories / family)
    assert abs(first - expected) / expected <= 1e-5, (first, expected)
    if family == "mixtral":  # exported back by transformers, in Mixtral's released per-expert files
        _exports_what_it_trained(run_dir / "checkpoints" / "last.ckpt", tmp_path)


def test_parallel_auto_plans_and_trains_a_saved_qwen3_moe_directory_on_2_cpu_ranks(tmp_path, directories):
    # Qwen3-MoE is trained as transformers defines it (adapted, not converted): the planner prices it from
    # the adapter's spec (its experts' own widths, top-k, qk-norm) and the run trains the layout it chose.
    from lightning_ultrascale.cli.plan import compose_run
    from lightning_ultrascale.cli.train import workload
    from lightning_ultrascale.plan import search

    run_dir = tmp_path / "run"
    env = {**os.environ, "ULTRASCALE_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1"}
    overrides = ["model=hf", f"model.path={directories / 'qwen3_moe'}", "parallel=auto", *DATA]
    steps = ["trainer.max_steps=2", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0"]
    out = run_command(train_main, ["ultrascale-train", *overrides, *steps], env, world_size=2, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    best = search(workload(compose_run(overrides)), 2, "cpu").best.candidate
    assert f"parallel=auto on 2 x cpu: {best.label()}" in out.stderr + out.stdout, (out.stdout + out.stderr)[-3000:]
    losses = [
        float(r["train/loss"]) for r in csv.DictReader((run_dir / "csv" / "metrics.csv").open()) if r.get("train/loss")
    ]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses


def _exports_what_it_trained(checkpoint, tmp_path):
    from safetensors import safe_open
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lightning_ultrascale.cli.export import main as export

    export([str(checkpoint), str(tmp_path / "exported")])
    with safe_open(str(tmp_path / "exported" / "model.safetensors"), "pt") as files:
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in files.keys()
    dcp_to_torch_save(checkpoint, tmp_path / "trained.pt")
    trained = torch.load(tmp_path / "trained.pt", weights_only=False)["state_dict"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    for name, value in loaded.named_parameters():
        assert torch.equal(value, trained[f"model.{name}"]), name


def _build(*overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return build(compose("train", overrides=hydra_argv(list(overrides))))


def test_hf_settings_are_checked_before_any_process_group(tmp_path, monkeypatch, directories):
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"model=hf needs model.path=DIR"):
        _build("model=hf")
    with pytest.raises(ConfigError, match=r"model.n_layers=2 does not apply to model=hf.*valid: model.name, model.pa"):
        _build("model=hf", f"model.path={directories / 'qwen2'}", "model.n_layers=2")
    with pytest.raises(ConfigError, match=r"another architecture than model=llama_tiny.*model=hf model.path="):
        _build(f"model.init_from=hf:{directories / 'mixtral'}")
    gpt2 = tmp_path / "gpt2"
    AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2).save_pretrained(gpt2)
    with pytest.raises(ContractError, match=r"model_type='gpt2' is not among .*llama, mistral, qwen2"):
        _build("model=hf", f"model.path={gpt2}")
    with pytest.raises(ConfigError, match=r"splits MoE experts, but model qwen2 has none"):
        _build("model=hf", f"model.path={directories / 'qwen2'}", "parallel.ep=2", *DATA)


def test_the_planner_prices_an_hf_directory_no_converter_reads(tmp_path, capsys):
    # Qwen3 (head_dim apart from hidden / heads) trains as transformers defines it and converts to
    # nothing of ours: the planner prices that model, from the spec the adapter gives it.
    AutoModelForCausalLM.from_config(hf_config("qwen3")).save_pretrained(tmp_path / "qwen3")
    overrides = ["model=hf", f"model.path={tmp_path / 'qwen3'}", *DATA]
    result = plan_cli.plan(overrides, world_size=2, gpu="h100", top=1)
    best = result.best.busiest
    assert best.view is not None and best.view.spec.name == "qwen3" and best.view.widths.head_dim == 16
    assert best.step_time > 0 and "qwen3" in capsys.readouterr().out
