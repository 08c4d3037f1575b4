"""Writes this directory's checkpoints: run with the code of commit a1e54bd (before checkpoints were read as data).

    cd <a checkout at a1e54bd> && python <this file> <this directory>

Two runs of 2 AdamW steps of a tiny Llama from the same seed, one process: ``dcp.ckpt`` (the
sharded format every layout writes), ``single.ckpt`` (``save_distributed_checkpoint=False``), and
``weights.pt``, the parameters both hold. tests/test_checkpoint_data.py loads them.
"""

import os
import sys
from dataclasses import replace

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L
import torch

from lightning_ultrascale import LlamaModule, OptimConfig, UltraScaleDataModule, UltraScaleStrategy
from lightning_ultrascale.models import get_model_config
from lightning_ultrascale.testing import run_workers
from lightning_ultrascale.testing.parity import QUIET_TRAINER

CONFIG = replace(
    get_model_config("llama_tiny"), dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden_dim=16, vocab_size=264
)
OPTIM = OptimConfig(name="adamw", lr=3e-3, warmup_steps=0)


def fit(path: str, distributed: bool) -> dict[str, torch.Tensor]:
    L.seed_everything(0, verbose=False)
    strategy = UltraScaleStrategy(save_distributed_checkpoint=distributed)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, **QUIET_TRAINER)
    module = LlamaModule(CONFIG, optim=OPTIM)
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=32, micro_batch_size=2, seed=0))
    trainer.save_checkpoint(path)
    return {n: p.detach().clone() for n, p in module.named_parameters()}


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = sys.argv[1]
    weights = run_workers(fit, 1, f"{out}/dcp.ckpt", True)[0]
    again = run_workers(fit, 1, f"{out}/single.ckpt", False)[0]
    assert all(torch.equal(weights[n], again[n]) for n in weights), "the two runs differ"
    torch.save(weights, f"{out}/weights.pt")
