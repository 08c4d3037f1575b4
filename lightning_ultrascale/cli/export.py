"""``ultrascale-export CKPT OUT_DIR``: a checkpoint of any layout as a Hugging Face model directory.

Writes ``config.json`` and safetensors that ``transformers.AutoModelForCausalLM.from_pretrained``
loads (a ``LlamaForCausalLM``, ``MixtralForCausalLM`` or ``DeepseekV3ForCausalLM``, with experts
stored one tensor per expert as the released checkpoints are), through DCP: every process reads a
share of the parameters from the checkpoint (whatever layout wrote it) and writes them with DCP's
Hugging Face writer, which then consolidates the files and writes ``model.safetensors.index.json``.
One process holds the whole model; run it with ``torchrun --nproc-per-node N -m
lightning_ultrascale.cli.export ...`` to give each of N processes 1/N of it. The model's
architecture comes from the checkpoint (``model_config`` in its hyperparameters, or its named config).

    ultrascale-export outputs/<run>/checkpoints/last.ckpt exported/
    ultrascale-train model.init_from=hf:exported/ parallel.tp=2 trainer.devices=2    # and back
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_ultrascale.checkpoint import check_checkpoint_path, checkpoint_location
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import LlamaConfig, get_model_config
from lightning_ultrascale.models.hf import MODEL_TYPES, config_to_hf, hf_architecture, hf_file_tensors
from lightning_ultrascale.models.llama import Llama

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def checkpoint_config(checkpoint: Path) -> LlamaConfig:
    """The architecture a checkpoint of ``LlamaModule`` was trained with."""
    meta = torch.load(checkpoint / "meta.pt", map_location="cpu", weights_only=False)
    hparams = meta.get("hyper_parameters", {})
    if "model_config" in hparams:
        return LlamaConfig(**hparams["model_config"])
    if "model" in hparams:
        return get_model_config(hparams["model"])
    raise ConfigError(f"{checkpoint} names no model in its hyperparameters (not a LlamaModule checkpoint)")


def export(checkpoint: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str = "float32") -> None:
    """Write ``checkpoint``'s model as an HF model directory (every process calls it)."""
    from torch.distributed.checkpoint import load, save
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    check_checkpoint_path(checkpoint, "CKPT")
    path = checkpoint_location(checkpoint)
    config = checkpoint_config(path)
    model_class = hf_architecture(config)[1]  # a ConfigError for an MoE without an HF counterpart
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in Llama(config).state_dict().items()}
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    files = hf_file_tensors(config)
    ours = sorted({key for key, _ in files.values()})
    mine = set(ours[rank::world])  # every process a share: no process holds the whole model
    # A softmax (Mixtral) router's selection bias has no HF tensor: it must be zero (every process checks all).
    biases = [k for k in shapes if k.endswith("router.expert_bias") and k not in ours]
    state = {f"state_dict.model.{k}": torch.empty(shapes[k]) for k in sorted(mine | set(biases))}
    load(state, checkpoint_id=path)
    moved = [k for k in biases if state[f"state_dict.model.{k}"].any()]
    if moved:
        raise ConfigError(
            f"{checkpoint}: {moved[0]} is non-zero, and a softmax (Mixtral) router's selection bias has no HF "
            "counterpart; valid: a run with model.moe.bias_update_rate=0, or a sigmoid (DeepSeek-V3) router"
        )
    tensors = {}
    for hf, (key, expert) in files.items():
        if key in mine:
            value = state[f"state_dict.model.{key}"]
            tensors[hf] = (value if expert is None else value[expert]).to(DTYPES[dtype])
    owner = {k: i % world for i, k in enumerate(ours)}
    fqn_to_file = {hf: owner[key] + 1 for hf, (key, _) in files.items()}
    writer = HuggingFaceStorageWriter(
        str(out_dir), fqn_to_index_mapping=fqn_to_file, save_distributed=True, enable_consolidation=True
    )
    save(tensors, storage_writer=writer)
    if rank == 0:
        hf_config = {
            **config_to_hf(config),
            "architectures": [model_class],
            "model_type": MODEL_TYPES[model_class],
            "torch_dtype": dtype,
            "tie_word_embeddings": config.tie_embeddings,
        }
        (Path(out_dir) / "config.json").write_text(json.dumps(hf_config, indent=2))


def main() -> None:
    """Console entry point of ``ultrascale-export``."""
    parser = argparse.ArgumentParser(prog="ultrascale-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory of any layout (e.g. .../checkpoints/last.ckpt)")
    parser.add_argument("out_dir", help="the HF model directory to write")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the exported weights")
    args = parser.parse_args()
    if "RANK" in os.environ and not dist.is_initialized():  # started by torchrun
        dist.init_process_group("gloo")
    try:
        export(args.checkpoint, args.out_dir, args.dtype)
    except ConfigError as err:
        raise SystemExit(f"ultrascale-export: {err}") from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
