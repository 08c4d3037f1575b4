"""A checkpoint of any layout exports to a Hugging Face directory that transformers loads, and imports back."""

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from llama_runs import ADAMW, SGD

from lightning_ultrascale import LlamaModule, TensorParallel, UltraScaleDataModule, UltraScaleStrategy, ZeRO
from lightning_ultrascale.cli.export import export
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import get_model_config
from lightning_ultrascale.models.llama import Llama
from lightning_ultrascale.testing import run_workers
from lightning_ultrascale.testing.parity import QUIET_TRAINER, record_run


def _train_and_save(path: str) -> None:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=UltraScaleStrategy(ZeRO(stage=3)), max_steps=3, **QUIET_TRAINER
    )
    trainer.fit(LlamaModule("llama_tiny", optim=ADAMW), datamodule=UltraScaleDataModule(seq_len=64, micro_batch_size=4))
    trainer.save_checkpoint(path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    run_workers(_train_and_save, 2, str(root / "ckpt"))
    run_workers(export, 2, str(root / "ckpt"), str(root / "hf"))  # each process exports half of the tensors
    return root


def _trained_model(checkpoint) -> Llama:
    model = Llama(get_model_config("llama_tiny"))
    state = {f"state_dict.model.{n}": t for n, t in model.state_dict().items()}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    return model


def test_transformers_loads_the_export_with_our_logits(exported):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(exported / "hf", local_files_only=True).eval()
    ours = _trained_model(exported / "ckpt").eval()
    tokens = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ours(tokens), hf(tokens).logits
    assert (got - want).norm() / want.norm() < 1e-5
    assert (exported / "hf" / "model.safetensors.index.json").is_file()


def test_the_export_imports_back_into_a_tp2_run_with_the_same_first_loss(exported):
    def module():
        return LlamaModule("llama_tiny", optim=SGD, init_from=f"hf:{exported / 'hf'}")

    def data():
        return UltraScaleDataModule(seq_len=64, micro_batch_size=8, seed=0)

    one = record_run(module, data, steps=1)
    tp2 = record_run(module, data, steps=1, strategy=lambda: UltraScaleStrategy(TensorParallel(2)), world_size=2)
    assert abs(tp2.losses[0] - one.losses[0]) / one.losses[0] < 1e-5
    # The imported weights are the trained ones, not a fresh initialisation.
    fresh = record_run(lambda: LlamaModule("llama_tiny", optim=SGD), data, steps=1)
    assert abs(fresh.losses[0] - one.losses[0]) > 1e-3


def test_an_hf_directory_of_another_architecture_is_refused(exported):
    with pytest.raises(ConfigError, match=r"model.init_from=hf:.* is another architecture: dim=64 \(model llama3_1b"):
        from lightning_ultrascale.models.hf import load_hf_weights

        with torch.device("meta"):
            load_hf_weights(Llama(get_model_config("llama3_1b")), exported / "hf")
