"""``ultrascale-export CKPT OUT_DIR``: a checkpoint of any layout as a Hugging Face model directory.

Writes ``config.json`` and safetensors that ``transformers.AutoModelForCausalLM.from_pretrained``
loads (a ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MixtralForCausalLM`` or ``DeepseekV3ForCausalLM``, with experts
stored one tensor per expert as the released checkpoints are), through DCP: every process reads a
share of the parameters from the checkpoint (whatever layout wrote it) and writes them with DCP's
Hugging Face writer, which then consolidates the files and writes ``model.safetensors.index.json``.
One process holds the whole model; run it with ``torchrun --nproc-per-node N -m
lightning_ultrascale.cli.export ...`` to give each of N processes 1/N of it. The model's
architecture comes from the checkpoint (``model_config`` in its hyperparameters, or its named config).
A checkpoint of a Hugging Face model trained as it is (``model=hf``) is written by transformers' own
``save_pretrained`` instead, in one process (:func:`export_hf_model`).

The tokenizer goes with the model: the checkpoint records what its data was tokenized with (the
datamodule's ``tokenizer_record``: name, content hash, where ``ultrascale-tokenize`` copied its
files), and export writes it as a Hugging Face tokenizer (:mod:`lightning_ultrascale.data.hf_tokenizer`)
after checking the files still hash to the record, so ``AutoTokenizer.from_pretrained(OUT)``
encodes text to the ids the model was trained on; with ``transformers`` installed it proves that on
probe texts. ``--tokenizer SPEC`` names the files when they moved (a token ``.bin``, its
``.tokenizer`` directory, a ``tokenizer.json``, a SentencePiece model, or ``byte``; their hash
must still match), ``--no-tokenizer`` exports the model alone.

    ultrascale-export outputs/<run>/checkpoints/last.ckpt exported/
    ultrascale-train model.init_from=hf:exported/ parallel.tp=2 trainer.devices=2    # and back
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_ultrascale.core.checkpoint import check_checkpoint_path, checkpoint_location
from lightning_ultrascale.core.checkpoint_io import load, load_dcp, read_metadata
from lightning_ultrascale.data.hf_tokenizer import write_hf_tokenizer
from lightning_ultrascale.data.index import TokenIndex, tokenizer_dir
from lightning_ultrascale.data.tokenizer import ByteTokenizer, TextTokenizer, load_tokenizer, tokenizer_hash
from lightning_ultrascale.errors import ConfigError, reported
from lightning_ultrascale.models import LlamaConfig, get_model_config
from lightning_ultrascale.models.common.decoder import Llama
from lightning_ultrascale.models.hf.convert import hf_architecture, hf_config_json, hf_file_tensors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
log = logging.getLogger(__name__)


def checkpoint_config(checkpoint: Path) -> LlamaConfig:
    """The architecture a checkpoint of ``LlamaModule`` was trained with."""
    hparams = load(checkpoint / "meta.pt").get("hyper_parameters", {})
    if "model_config" in hparams:
        return LlamaConfig(**hparams["model_config"])
    if "model" in hparams:
        return get_model_config(hparams["model"])
    raise ConfigError(f"{checkpoint} names no model in its hyperparameters (not a LlamaModule checkpoint)")


def checkpoint_tokenizer(checkpoint: Path) -> dict[str, Any] | None:
    """The tokenizer record a checkpoint's datamodule saved (``UltraScaleDataModule.state_dict``), or None."""
    for value in load(checkpoint / "meta.pt").values():
        if isinstance(value, dict) and isinstance(value.get("tokenizer"), dict) and "hash" in value["tokenizer"]:
            return value["tokenizer"]
    return None


def _spec_tokenizer(spec: str) -> TextTokenizer:
    """``--tokenizer``: a token ``.bin`` stands for the tokenizer its index names, anything else is loaded."""
    if spec.endswith(".bin"):
        index = TokenIndex.read(spec, "--tokenizer")
        if index is None:
            raise ConfigError(f"--tokenizer {spec} has no index; give the tokenizer's own files")
        if index.tokenizer == ByteTokenizer.name:
            return ByteTokenizer()
        return load_tokenizer(tokenizer_dir(spec), index.tokenizer)
    return load_tokenizer(spec)


def resolve_tokenizer(checkpoint: Path, spec: str | None) -> TextTokenizer | None:
    """The tokenizer to export: ``spec`` or the checkpoint's record, its files checked against the record's hash."""
    record = checkpoint_tokenizer(checkpoint)
    if spec is not None:
        tokenizer = _spec_tokenizer(spec)
        where = f"--tokenizer {spec}"
    elif record is None:
        log.warning(
            "%s records no tokenizer (its data came from a DataModule other than UltraScaleDataModule, or from a "
            ".bin without an index): the export has NO tokenizer; give one with --tokenizer",
            checkpoint,
        )
        return None
    elif record["name"] == ByteTokenizer.name and record["files"] is None:
        return ByteTokenizer()
    elif record["files"] is None or not Path(record["files"]).is_dir():
        raise ConfigError(
            f"{checkpoint} was trained on data tokenized with {record['name']!r}, whose files were at "
            f"{record['files']} and are gone; give them with --tokenizer PATH (the token .bin, its .tokenizer "
            "directory or the tokenizer's files), or export the model alone with --no-tokenizer"
        )
    else:
        tokenizer = load_tokenizer(record["files"], record["name"])
        where = f"the tokenizer files at {record['files']}"
    if record is not None and tokenizer_hash(tokenizer.files) != record["hash"]:
        raise ConfigError(
            f"{where} hash to {tokenizer_hash(tokenizer.files)[:12]}, but {checkpoint} was trained on data "
            f"tokenized with {record['name']!r} ({record['hash'][:12]}): another tokenizer would map the model's ids "
            "to other text; give the files it was trained with"
        )
    return tokenizer


def write_tokenizer(tokenizer: TextTokenizer, out_dir: Path, config: LlamaConfig) -> None:
    """Write the HF tokenizer and prove it encodes like ``tokenizer`` (with ``transformers``; else say so)."""
    write_hf_tokenizer(tokenizer, out_dir, config.vocab_size, config.max_seq_len)


def _on_rank_zero(write: Callable[[], None]) -> None:
    """Run ``write`` on process 0; every process raises its ConfigError (none waits in a collective for it)."""
    error = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            write()
        except ConfigError as err:
            error = str(err)
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ConfigError(error)


def _read_share(
    checkpoint: str | os.PathLike[str], path: str, config: LlamaConfig, mine: set[str], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """This process's share of the HF tensors (``mine``: our keys), read from the DCP checkpoint at ``path``.

    Every process gets a share, so no process holds the whole model.
    """
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in Llama(config).state_dict().items()}
    files = hf_file_tensors(config)
    ours = {key for key, _ in files.values()}
    # A softmax (Mixtral) router's selection bias has no HF tensor: it must be zero (every process checks all).
    biases = [k for k in shapes if k.endswith("router.expert_bias") and k not in ours]
    state = {f"state_dict.model.{k}": torch.empty(shapes[k]) for k in sorted(mine | set(biases))}
    load_dcp(state, path)
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
            tensors[hf] = (value if expert is None else value[expert]).to(dtype)
    return tensors


def export(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: str = "float32",
    tokenizer: str | None = None,
    with_tokenizer: bool = True,
) -> TextTokenizer | None:
    """Write ``checkpoint``'s model, and its tokenizer unless ``with_tokenizer=False``, as an HF directory.

    Every process calls it; the tokenizer is checked on every process before the model is read
    and written by process 0. Returns the tokenizer written (None without one).
    """
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    check_checkpoint_path(checkpoint, "CKPT")
    path = checkpoint_location(checkpoint)
    hparams = load(path / "meta.pt").get("hyper_parameters", {})
    if "hf_config" in hparams:  # a model=hf run: the transformers model itself, written by transformers
        return export_hf_model(path, hparams["hf_config"], out_dir, dtype, tokenizer, with_tokenizer)
    config = checkpoint_config(path)
    hf_architecture(config)  # a ConfigError for an MoE without an HF counterpart
    text_tokenizer = resolve_tokenizer(path, tokenizer) if with_tokenizer else None
    if text_tokenizer is not None:
        _on_rank_zero(lambda: write_tokenizer(text_tokenizer, Path(out_dir), config))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    files = hf_file_tensors(config)
    ours = sorted({key for key, _ in files.values()})
    tensors = _read_share(checkpoint, path, config, set(ours[rank::world]), DTYPES[dtype])
    owner = {k: i % world for i, k in enumerate(ours)}
    fqn_to_file = {hf: owner[key] + 1 for hf, (key, _) in files.items()}
    writer = HuggingFaceStorageWriter(
        str(out_dir), fqn_to_index_mapping=fqn_to_file, save_distributed=True, enable_consolidation=True
    )
    save(tensors, storage_writer=writer)
    if rank == 0:
        (Path(out_dir) / "config.json").write_text(json.dumps(hf_config_json(config, dtype), indent=2))
    return text_tokenizer


def export_hf_model(
    path: Path,
    hf_config: dict[str, Any],
    out_dir: str | os.PathLike[str],
    dtype: str = "float32",
    tokenizer: str | None = None,
    with_tokenizer: bool = True,
) -> TextTokenizer | None:
    """Write the checkpoint of an HF model trained as it is (``HFCausalLMModule``) with transformers' own
    ``save_pretrained``: its config, and its weights in the layout its family is released in.

    One process holds the whole model (the transformers model is built whole, on the CPU).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ConfigError(f"{path} holds a Hugging Face model (model=hf): export it in one process, without torchrun")
    settings = dict(hf_config)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    model = AutoModelForCausalLM.from_config(config)
    stored = read_metadata(path).state_dict_metadata
    state = {f"state_dict.model.{n}": t for n, t in model.state_dict().items() if f"state_dict.model.{n}" in stored}
    missing = sorted(n for n, _ in model.named_parameters() if f"state_dict.model.{n}" not in stored)
    if missing:
        raise ConfigError(f"{path} lacks parameters of its {config.model_type} model: {', '.join(missing[:5])}")
    load_dcp(state, path)
    model.tie_weights()
    text_tokenizer = resolve_tokenizer(path, tokenizer) if with_tokenizer else None
    if text_tokenizer is not None:
        write_hf_tokenizer(text_tokenizer, Path(out_dir), config.vocab_size, config.max_position_embeddings)
    model.to(DTYPES[dtype]).save_pretrained(out_dir)
    return text_tokenizer


def main(argv: list[str] | None = None) -> None:
    """Console entry point of ``ultrascale-export``."""
    parser = argparse.ArgumentParser(prog="ultrascale-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory of any layout (e.g. .../checkpoints/last.ckpt)")
    parser.add_argument("out_dir", help="the HF model directory to write")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the exported weights")
    parser.add_argument(
        "--tokenizer",
        help="the tokenizer when its files moved: a token .bin, its .tokenizer directory, a tokenizer.json, a "
        "SentencePiece model or byte (default: the one the checkpoint records)",
    )
    parser.add_argument("--no-tokenizer", action="store_true", help="export the model alone")
    args = parser.parse_args(argv)
    if "RANK" in os.environ and not dist.is_initialized():  # started by torchrun
        dist.init_process_group("gloo")
    try:
        with reported("ultrascale-export"):
            tokenizer = export(args.checkpoint, args.out_dir, args.dtype, args.tokenizer, not args.no_tokenizer)
        if not dist.is_initialized() or dist.get_rank() == 0:
            with_tokenizer = f" and its tokenizer {tokenizer.name!r}" if tokenizer is not None else " (no tokenizer)"
            print(f"exported {args.checkpoint}{with_tokenizer} to {args.out_dir}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
