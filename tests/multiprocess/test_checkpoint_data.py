"""A checkpoint is data: a crafted file is refused at every entry point, naming the file and the type, and
its payload never runs; checkpoints written before (tests/data/checkpoints_before_data) still load."""

import json
import pickle
import re
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from cli_configs import compose_train as _compose
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from lightning_ultrascale import LlamaConfig, LlamaModule, OptimConfig, UltraScaleDataModule, UltraScaleStrategy, ZeRO
from lightning_ultrascale.cli.export import export
from lightning_ultrascale.cli.train import build
from lightning_ultrascale.core.checkpoint_io import CheckpointDataError, load, to_data
from lightning_ultrascale.core.fabric import FabricStrategy
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import get_model_config
from lightning_ultrascale.models.hf.convert import config_to_hf, hf_file_tensors
from lightning_ultrascale.models.llama import Llama
from lightning_ultrascale.testing import run_workers
from lightning_ultrascale.testing.parity import QUIET_TRAINER

#: Written by commit a1e54bd, before checkpoints were read as data (its make.py).
BEFORE = Path(__file__).parents[1] / "data" / "checkpoints_before_data"
_HPARAMS = torch.load(BEFORE / "dcp.ckpt" / "meta.pt", weights_only=True)["hyper_parameters"]
CONFIG = LlamaConfig(**_HPARAMS["model_config"])
OPTIM = OptimConfig(**_HPARAMS["optim"])


class Payload:
    """Unpickled, it creates ``marker``: the evidence that a checkpoint ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _refused(file: Path, entry: str = "") -> str:
    """The refusal of ``file`` for the payload: torch.save pickles ``Path.touch`` as getattr, pickle by name."""
    return rf"checkpoint {re.escape(str(file))}{re.escape(entry)} holds (builtins\.getattr|pathlib\S*Path\.touch), "


def _crafted(where: Path, marker: Path, part: str = "meta.pt") -> Path:
    """The old DCP checkpoint with its ``part`` (``meta.pt`` or ``.metadata``) replaced by one running the payload."""
    shutil.copytree(BEFORE / "dcp.ckpt", where)
    if part == "meta.pt":
        torch.save({"global_step": 5, "x": Payload(marker)}, where / part)
    else:
        (where / part).write_bytes(pickle.dumps(Payload(marker)))
    return where / part


def _crafted_file(where: Path, marker: Path) -> Path:
    torch.save({"global_step": 5, "state_dict": {}, "x": Payload(marker)}, where)
    return where


def _crafted_entry(where: Path, marker: Path) -> tuple[Path, str]:
    """The old DCP checkpoint with the payload as an optimizer hyperparameter: a non-tensor entry of a shard."""
    source = BEFORE / "dcp.ckpt"
    metadata = dcp.FileSystemReader(source).read_metadata()  # (ours, trusted)
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None
        for k, m in metadata.state_dict_metadata.items()
    }
    dcp.load(state, checkpoint_id=source)
    entry = "optimizer_0.param_groups.model.tok_embeddings.weight.lr"
    state[entry] = Payload(marker)
    dcp.save(state, checkpoint_id=where)
    shutil.copy(source / "meta.pt", where / "meta.pt")
    return where / "__0_0.distcp", f" (entry {entry})"


# --------------------------------------------------------------------------- crafted files, every entry point
def test_auto_resume_refuses_a_crafted_checkpoint_in_the_run_directory_without_running_it(tmp_path, monkeypatch):
    # Was: ultrascale-train (ckpt_path=auto, the default) ran the payload on every rank, before training.
    run = tmp_path / "run"
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(run))
    marker = tmp_path / "ran"
    for part in ("meta.pt", ".metadata"):
        file = _crafted(run / "checkpoints" / "step=5.ckpt", marker, part)
        with pytest.raises(CheckpointDataError, match=_refused(file) + "which a checkpoint may not hold: .* runs"):
            build(_compose())
        shutil.rmtree(file.parent)
    assert not marker.exists()


def test_an_explicit_ckpt_path_to_a_crafted_checkpoint_is_refused_without_running_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path / "run"))
    marker = tmp_path / "ran"
    files = [_crafted(tmp_path / "a.ckpt", marker), _crafted(tmp_path / "b.ckpt", marker, ".metadata")]
    for file in [*files, _crafted_file(tmp_path / "c.ckpt", marker)]:
        checkpoint = file.parent if file.name in ("meta.pt", ".metadata") else file
        with pytest.raises(CheckpointDataError, match=_refused(file)):
            build(_compose(f"ckpt_path={checkpoint}"))
    assert not marker.exists()


def _data() -> UltraScaleDataModule:
    return UltraScaleDataModule(seq_len=32, micro_batch_size=2, seed=0)


def _trainer_refusals(checkpoints: list[str]) -> list[str]:
    """Each checkpoint resumed through the Trainer's strategy: the error of each (all must fail)."""
    errors = []
    for checkpoint in checkpoints:
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=UltraScaleStrategy(), max_steps=3, **QUIET_TRAINER)
        with pytest.raises(ConfigError) as caught:
            trainer.fit(LlamaModule(CONFIG, optim=OPTIM), datamodule=_data(), ckpt_path=checkpoint)
        errors.append(str(caught.value))
    # Lightning 2.6 drops weights_only before a ModelParallelStrategy's load; refused either way, nothing runs.
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=UltraScaleStrategy(), max_steps=3, **QUIET_TRAINER)
    with pytest.raises(ConfigError):
        trainer.fit(LlamaModule(CONFIG, optim=OPTIM), datamodule=_data(), ckpt_path=checkpoints[0], weights_only=False)
    return errors


def test_the_trainer_strategy_refuses_a_crafted_checkpoint_without_running_it(tmp_path):
    # The strategy's load_checkpoint (trainer.fit(ckpt_path=...) in Python): meta.pt, a single file, a shard's entry.
    marker = tmp_path / "ran"
    files = [_crafted(tmp_path / "a.ckpt", marker), _crafted_file(tmp_path / "b.ckpt", marker)]
    shard, entry = _crafted_entry(tmp_path / "c.ckpt", marker)
    checkpoints = [str(files[0].parent), str(files[1]), str(shard.parent)]
    errors = run_workers(_trainer_refusals, 1, checkpoints)[0]
    for error, (file, named) in zip(errors, [(files[0], ""), (files[1], ""), (shard, entry)]):
        assert re.match(_refused(file, named), error), error
    assert not marker.exists()


def _fabric_refusals(checkpoints: list[str]) -> list[str]:
    fabric = L.Fabric(strategy=FabricStrategy(), accelerator="cpu", devices=1)
    fabric.launch()
    model = Llama(CONFIG)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    errors = []
    for checkpoint in checkpoints:
        with pytest.raises(CheckpointDataError) as caught:
            fabric.load(checkpoint, {"model": model, "optimizer": optimizer})
        errors.append(str(caught.value))
    with pytest.raises(ConfigError, match=r"fabric.load\(path=.*\) with weights_only=False: UltraScaleStrategy"):
        fabric.load(checkpoints[0], {"model": model}, weights_only=False)
    return errors


def test_fabric_load_refuses_a_crafted_checkpoint_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    files = [_crafted(tmp_path / "a.ckpt", marker), _crafted(tmp_path / "b.ckpt", marker, ".metadata")]
    shard, entry = _crafted_entry(tmp_path / "c.ckpt", marker)
    errors = run_workers(_fabric_refusals, 1, [str(f.parent) for f in [*files, shard]])[0]
    for error, (file, named) in zip(errors, [(files[0], ""), (files[1], ""), (shard, entry)]):
        assert re.match(_refused(file, named), error), error
    assert not marker.exists()


def test_export_refuses_a_crafted_checkpoint_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    for name, part in (("a.ckpt", "meta.pt"), ("b.ckpt", ".metadata")):
        file = _crafted(tmp_path / name, marker, part)
        with pytest.raises(CheckpointDataError, match=_refused(file)):
            export(file.parent, tmp_path / "out", with_tokenizer=False)
    assert not marker.exists()


def test_init_from_reads_only_safetensors_so_a_pickled_weight_file_never_runs(tmp_path, monkeypatch):
    # model.init_from=hf:DIR reads config.json and safetensors (DCP's HF reader): no pickle. An HF directory with
    # only a pickled pytorch_model.bin is refused before any process group (was: DCP's "Missing key" at init).
    monkeypatch.setenv("ULTRASCALE_RUN_DIR", str(tmp_path / "run"))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({**config_to_hf(get_model_config("llama_tiny")), "model_type": "llama"}))
    marker = tmp_path / "ran"
    torch.save({"model.embed_tokens.weight": Payload(marker)}, hf / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=rf"model.init_from=hf:{re.escape(str(hf))} holds no \*\.safetensors files"):
        build(_compose(f"model.init_from=hf:{hf}"))
    assert not marker.exists()


# --------------------------------------------------------------------------- what is admitted, and the save side
def test_hyperparameters_saved_as_a_dictconfig_load_and_are_saved_plain_now(tmp_path):
    # Lightning stores a LightningModule's hparams as the DictConfig it was given; such files still load.
    hparams = OmegaConf.create({"model": {"dim": 8, "name": "${model.dim}"}, "paths": [str(tmp_path)]})
    torch.save({"hyper_parameters": hparams, "dir": tmp_path, "hparams_type": DictConfig}, tmp_path / "old.pt")
    old = load(tmp_path / "old.pt")
    assert isinstance(old["hyper_parameters"], DictConfig) and old["hyper_parameters"].model.name == 8
    assert old["dir"] == tmp_path and old["hparams_type"] is DictConfig
    meta = {"hyper_parameters": hparams, "datamodule_hyper_parameters": {"nested": OmegaConf.create([1, 2])}}
    to_data(meta, tmp_path / "new.ckpt")  # what a save writes: plain containers, its interpolations resolved
    assert meta["hyper_parameters"] == {"model": {"dim": 8, "name": 8}, "paths": [str(tmp_path)]}
    assert type(meta["hyper_parameters"]) is dict and meta["datamodule_hyper_parameters"] == {"nested": [1, 2]}


def test_a_save_holding_an_object_fails_at_the_save_naming_it(tmp_path):
    # Rather than at the resume that needs the checkpoint.
    marker = tmp_path / "ran"
    meta = {"callbacks": {"MyCallback": {"state": Payload(marker)}}, "state_dict": {"w": torch.zeros(2)}}
    message = rf"checkpoint being saved to {re.escape(str(tmp_path))}/last.ckpt holds builtins.getattr, .* save plain"
    with pytest.raises(CheckpointDataError, match=message):
        to_data(meta, tmp_path / "last.ckpt")
    assert not marker.exists()


# --------------------------------------------------------------------------- checkpoints written before
def _resumed(checkpoint: str, devices: int) -> tuple[dict[str, torch.Tensor], int]:
    """Resumed by a Trainer on ``devices`` processes: one, or ZeRO-3 (DTensor parameters: Lightning's loader)."""
    strategy = UltraScaleStrategy(*([ZeRO(3)] if devices > 1 else []))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, **QUIET_TRAINER)
    module = LlamaModule(CONFIG, optim=OPTIM)
    trainer.fit(module, datamodule=_data(), ckpt_path=checkpoint)  # restores, then has no step left to train
    whole = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in module.named_parameters()}
    return {n: p.detach().clone() for n, p in whole.items()}, trainer.global_step


@pytest.mark.parametrize(("name", "devices"), [("dcp.ckpt", 1), ("single.ckpt", 1), ("single.ckpt", 2)])
def test_a_checkpoint_written_before_resumes_with_its_weights(name, devices):
    weights = load(BEFORE / "weights.pt")
    resumed, step = run_workers(_resumed, devices, str(BEFORE / name), devices)[0]
    assert step == 2 and resumed.keys() == weights.keys()
    assert all(torch.equal(resumed[n], weights[n]) for n in weights)


def test_a_checkpoint_written_before_exports_its_weights(tmp_path):
    from safetensors.torch import load_file

    export(BEFORE / "dcp.ckpt", tmp_path, with_tokenizer=False)
    exported = {k: v for f in tmp_path.glob("*.safetensors") for k, v in load_file(f).items()}
    weights = load(BEFORE / "weights.pt")
    files = hf_file_tensors(CONFIG)
    assert exported.keys() == files.keys()
    assert all(torch.equal(exported[hf], weights[f"model.{key}"]) for hf, (key, _) in files.items())
