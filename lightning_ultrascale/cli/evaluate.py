"""``ultrascale-eval CKPT --tasks A,B``: lm-evaluation-harness tasks on a checkpoint of any layout, in one process.

The model's architecture and the tokenizer come from the checkpoint, as ``ultrascale-export`` reads them
(its hyperparameters; the tokenizer its data recorded, its files checked against the recorded hash); the
weights are read through DCP as data, whatever layout wrote them. The metrics are printed and, with
``--out``, written as JSON. The run's own tasks (``--include-path``: a folder of lm-eval task YAML files)
work offline; hub tasks download their data. One process holds the whole model: for a model that does
not fit one device, evaluate inside the training layout (``LMEvaluation``).

    ultrascale-eval outputs/<run>/checkpoints/last.ckpt --tasks hellaswag,arc_easy --limit 200 --out eval.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from lightning_ultrascale.cli.export import checkpoint_config, resolve_tokenizer
from lightning_ultrascale.core.checkpoint import check_checkpoint_path, checkpoint_location
from lightning_ultrascale.core.checkpoint_io import load, load_dcp
from lightning_ultrascale.errors import ConfigError, reported
from lightning_ultrascale.models.llama import Llama
from lightning_ultrascale.training.evaluation import _metrics

__all__ = ["evaluate_checkpoint", "main"]


def evaluate_checkpoint(
    checkpoint: str | Path,
    tasks: list[str],
    include_path: str | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    tokenizer: str | None = None,
) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` of ``tasks`` on ``checkpoint``'s model (see the module docstring)."""
    check_checkpoint_path(checkpoint, "CKPT")
    path = checkpoint_location(checkpoint)
    if "hf_config" in load(path / "meta.pt").get("hyper_parameters", {}):
        raise ConfigError(
            f"{checkpoint} is a model=hf run's: export it (ultrascale-export CKPT DIR) and evaluate the directory "
            "with lm-eval's own hf model (lm_eval --model hf --model_args pretrained=DIR)"
        )
    config = checkpoint_config(path)
    text_tokenizer = resolve_tokenizer(path, tokenizer)
    if text_tokenizer is None:
        raise ConfigError(f"{checkpoint} records no tokenizer: give the one its data was made with, --tokenizer SPEC")
    import lm_eval  # (after the checks: it starts a thread, see training/evaluation.py)

    from lightning_ultrascale.training.evaluation import LayoutLM, task_manager

    model = Llama(config)
    state = {f"state_dict.model.{name}": tensor for name, tensor in model.state_dict().items()}
    load_dcp(state, path)  # (into the model's own tensors: the state dict's entries are views of them)
    lm = LayoutLM(model.eval(), text_tokenizer, batch_size, max_length=config.max_seq_len)
    with torch.no_grad():
        out = lm_eval.simple_evaluate(
            model=lm, tasks=tasks, limit=limit, task_manager=task_manager(tasks, include_path),
            bootstrap_iters=0, log_samples=False, verbosity="WARNING",
        )  # fmt: skip
    return _metrics(out["results"])


def main(argv: list[str] | None = None) -> None:
    """Console entry point of ``ultrascale-eval``."""
    parser = argparse.ArgumentParser(prog="ultrascale-eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory of any layout (e.g. .../checkpoints/last.ckpt)")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    parser.add_argument("--include-path", help="a folder of lm-eval task YAML files (tasks of one's own)")
    parser.add_argument("--limit", type=int, help="documents per task (default: all)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    parser.add_argument("--tokenizer", help="the tokenizer when its files moved (as ultrascale-export's --tokenizer)")
    parser.add_argument("--out", type=Path, help="write the metrics as JSON here")
    args = parser.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    with reported("ultrascale-eval"):
        if not tasks:
            raise ConfigError(f"--tasks {args.tasks!r} names no task; valid: comma-separated lm-eval task names")
        metrics = evaluate_checkpoint(
            args.checkpoint, tasks, args.include_path, args.limit, args.batch_size, args.tokenizer
        )
    for task, values in metrics.items():
        for name, value in values.items():
            print(f"{task:<24}{name:<20}{value:.6g}")
    if args.out is not None:
        payload: dict[str, Any] = {"checkpoint": str(args.checkpoint), "tasks": tasks, "results": metrics}
        args.out.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
