"""``ultrascale-export CKPT OUT_DIR``: a checkpoint of any layout as a Hugging Face model directory.

Writes ``config.json`` and safetensors that ``transformers.AutoModelForCausalLM.from_pretrained``
loads, through DCP: every process reads a share of the parameters from the checkpoint (whatever
layout wrote it) and writes them with DCP's Hugging Face writer, which then consolidates the files
and writes ``model.safetensors.index.json``. One process holds the whole model; run it with
``torchrun --nproc-per-node N -m lightning_ultrascale.cli.export ...`` to give each of N
processes 1/N of it. The model's architecture comes from the checkpoint (``model_config`` in its
hyperparameters, or its named config).

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
from lightning_ultrascale.models.hf import _KEY_PAIRS, _rename, config_to_hf
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
    """Write ``checkpoint``'s model as an HF ``LlamaForCausalLM`` directory (every process calls it)."""
    from torch.distributed.checkpoint import load, save
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    check_checkpoint_path(checkpoint, "CKPT")
    path = checkpoint_location(checkpoint)
    config = checkpoint_config(path)
    if config.moe is not None:
        raise ConfigError(
            f"model {config.name} is a mixture of experts: ultrascale-export writes dense Llama checkpoints "
            "only so far; convert in memory with lightning_ultrascale.models.hf.state_dict_to_hf (Mixtral-shaped MoE)"
        )
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Llama(config).named_parameters()}
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    hf_names = _rename({n: n for n in shapes}, [(ours, hf) for hf, ours in _KEY_PAIRS], ignore=None)
    mine = sorted(hf_names)[rank::world]  # every process a share: no process holds the whole model
    ours = {hf: hf_names[hf] for hf in mine}
    state = {f"state_dict.model.{ours[hf]}": torch.empty(shapes[ours[hf]]) for hf in mine}
    load(state, checkpoint_id=path)
    tensors = {hf: state[f"state_dict.model.{ours[hf]}"].to(DTYPES[dtype]) for hf in mine}
    files = {hf: i % world + 1 for i, hf in enumerate(sorted(hf_names))}
    writer = HuggingFaceStorageWriter(
        str(out_dir), fqn_to_index_mapping=files, save_distributed=True, enable_consolidation=True
    )
    save(tensors, storage_writer=writer)
    if rank == 0:
        hf_config = {
            **config_to_hf(config),
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
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
