"""Periodic Hugging Face snapshots from any layout: the same files ``ultrascale-export`` writes from a checkpoint
of the same step, rotated, complete or absent."""

import json
import logging
import math

import lightning as L
import pytest
import torch
from llama_runs import MIXTRAL_TINY, SGD
from safetensors import safe_open

from lightning_ultrascale import (
    DataParallel,
    ExpertParallel,
    LlamaModule,
    PipelineParallel,
    TensorParallel,
    UltraScaleDataModule,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.cli.export import export
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import QUIET_TRAINER
from lightning_ultrascale.training.snapshots import HFSnapshots, Piece, SnapshotPlan, _write_snapshot

#: name -> (plugins, world size, data-parallel size, model)
LAYOUTS = {
    "one": (None, 1, 1, "llama_tiny"),
    "dp2": (lambda: [DataParallel()], 2, 2, "llama_tiny"),
    "zero3": (lambda: [ZeRO(3)], 2, 2, "llama_tiny"),
    "tp2": (lambda: [TensorParallel(2, loss_parallel=True)], 2, 1, "llama_tiny"),
    "pp2": (lambda: [PipelineParallel(2)], 2, 1, "llama_tiny"),
    "ep2": (lambda: [ExpertParallel(2)], 2, 2, MIXTRAL_TINY),
    "zero3_tp2": (lambda: [ZeRO(3), TensorParallel(2)], 4, 2, "llama_tiny"),
}


def _fit_snapshot_and_export(plugins, world_size: int, dp: int, model, root: str) -> tuple[list, int, int]:
    L.seed_everything(0, verbose=False)
    snapshots = HFSnapshots(every_n_steps=1, keep=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=UltraScaleStrategy(*(plugins() if plugins else [])),
        max_steps=3, callbacks=[snapshots], default_root_dir=root, **QUIET_TRAINER,
    )  # fmt: skip
    data = UltraScaleDataModule(seq_len=64, micro_batch_size=8 // dp, seed=0)
    trainer.fit(LlamaModule(model, optim=SGD), datamodule=data)
    trainer.save_checkpoint(f"{root}/last.ckpt")
    export(f"{root}/last.ckpt", f"{root}/exported")
    plan = snapshots._plan
    assert plan is not None
    return snapshots.stalls, sum(math.prod(p.shape) for p in plan.mine), sum(map(math.prod, plan.shapes.values()))


def _tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out |= {name: f.get_tensor(name) for name in f.keys()}
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_snapshot_holds_what_the_export_of_the_same_step_holds(layout, tmp_path):
    plugins, world_size, dp, model = LAYOUTS[layout]
    ranks = run_pooled(_fit_snapshot_and_export, world_size, plugins, world_size, dp, model, str(tmp_path))
    hf = tmp_path / "hf"
    # Rotated: the newest two of steps 1, 2, 3; nothing partial left; every rank logged the same stalls.
    assert sorted(p.name for p in hf.iterdir()) == [".tokenizer", "step_2", "step_3"]
    stalls = [r[0] for r in ranks]
    assert [s for s, _ in stalls[0]] == [1, 2, 3] and all(r == stalls[0] for r in stalls)
    # Every element copied by exactly one rank; replicas spread the copy (no rank copies more than 60%).
    copied, total = [r[1] for r in ranks], ranks[0][2]
    assert sum(copied) == total and (world_size == 1 or max(copied) <= 0.6 * total), (copied, total)
    snapshot, exported = _tensors(hf / "step_3"), _tensors(tmp_path / "exported")
    assert set(snapshot) == set(exported)
    for name, tensor in exported.items():
        assert torch.equal(snapshot[name], tensor), name
    index = json.loads((hf / "step_3" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(exported)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert json.loads((hf / "step_3" / name).read_text()) == json.loads((tmp_path / "exported" / name).read_text())


def test_a_failed_rank_leaves_no_snapshot_and_its_peers_give_up_at_once(tmp_path, caplog):
    # Rank 1 of two failed (its marker is there): rank 0's writer stops waiting for it, nothing is published.
    (tmp_path / ".step_5.partial").mkdir()
    (tmp_path / ".step_5.partial" / ".failed_1").write_text("OSError('No space left on device')")
    piece = Piece("norm.weight", (0,), (4,))
    plan = SnapshotPlan(0, 2, [piece], {"norm.weight": [(piece, 0)]}, {"norm.weight": (4,)}, {}, {}, {})
    with pytest.raises(RuntimeError, match=r"failed rank 1: OSError\('No space left on device'\)"):
        _write_snapshot(tmp_path / ".step_5.partial", {piece.name: torch.ones(4)}, plan, torch.float32, 1e18)
    # Through the callback's writer: logged as an error naming the step and rank, marked failed, not published.
    snapshots = HFSnapshots(every_n_steps=5, dirpath=str(tmp_path), timeout_s=0.5)
    with caplog.at_level(logging.ERROR):
        snapshots._write(5, {piece.name: torch.ones(4)}, plan)
    assert "HF snapshot step 5 failed on rank 0" in caplog.text
    assert not (tmp_path / "step_5").exists() and (tmp_path / ".step_5.partial" / ".failed_0").exists()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": -1}, r"checkpoint.hf_every_n_steps=-1; valid: an integer >= 0"),
        ({"keep": 0}, r"checkpoint.hf_keep=0; valid: an integer >= 1, or -1"),
        ({"dtype": "float16"}, r"checkpoint.hf_dtype='float16'; valid: float32, bfloat16"),
    ],
)
def test_bad_snapshot_settings_name_the_option(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        HFSnapshots(**kwargs)
