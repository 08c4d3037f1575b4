"""Hugging Face snapshots every N steps, from any layout, written while training goes on.

``checkpoint.hf_every_n_steps=N`` (:class:`HFSnapshots`) writes ``<run>/hf/step_<N>/``: ``config.json``,
safetensors and the run's tokenizer, a directory ``transformers.AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer.from_pretrained`` load (what ``ultrascale-export`` writes from a checkpoint, with
the same names and files: experts one tensor each, a tied head once).

**What training waits for**: each rank copies the pieces of the weights it writes to host memory (a
DTensor's local shard, a pipeline stage's parameters; each element is copied by exactly one rank, and
the tensors every data-parallel rank holds whole, under DP and ZeRO-1/2, are spread over their holders,
the largest first to the least loaded, so each copies about 1/dp of them). That copy, and any wait
for the previous snapshot's writer, is the stall, measured on every rank and logged (its maximum over
the ranks) as ``hf_snapshot/stall_s`` and in a line on rank 0. Which rank writes which piece is
agreed once, at the first snapshot (one gather of the pieces' coordinates, which also proves that the
pieces cover every element of every tensor).

**In the background** (a thread per rank, no collective: training's collectives own the process group),
each rank writes its pieces to a file, waits for every rank's, assembles the whole tensors it was given
(the largest first, to the least loaded rank), converts them to the HF names and writes one safetensors
file; rank 0 waits for every rank's file, adds ``config.json``, the index and the tokenizer, then
publishes. The ranks meet through files in the run directory, which every rank reads (the checkpoints'
directory must be shared already).

**Crash-safe**: everything is written into ``.step_<N>.partial`` and renamed to ``step_<N>`` once
complete (a rename within a directory is atomic): a snapshot is complete or absent. A failure on a rank
(disk full, a timeout waiting for a peer) is logged as an error with its cause, marks the partial
directory failed so that no peer waits for it, and leaves training running; a later start removes the
partial directories. The newest ``keep`` snapshots are kept.

The weights are those the model computes with: bf16 under ``bf16-mixed`` with ZeRO 0-2 (a checkpoint
holds their fp32 masters), fp32 otherwise; ``dtype`` is what the files store.

Example:
    >>> snapshots = HFSnapshots(every_n_steps=500, keep=3)  # L.Trainer(callbacks=[snapshots])
    >>> snapshots.every_n_steps, snapshots.keep
    (500, 3)
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.tensor import DTensor

from lightning_ultrascale.errors import ConfigError

__all__ = ["HFSnapshots"]

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: The model's tensors in a LightningModule's state dict (``LlamaModule.model``).
PREFIX = "model."


@dataclass(frozen=True)
class Piece:
    """A box of one tensor: ``shape`` elements from ``offsets`` of the whole ``key`` (our state-dict name)."""

    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def name(self) -> str:
        """Its name in a rank's pieces file."""
        return f"{self.key}@{','.join(map(str, self.offsets))}"


@dataclass
class SnapshotPlan:
    """Who copies which piece and who assembles which tensor, agreed by every rank at the first snapshot."""

    rank: int
    world: int
    mine: list[Piece]  # the pieces this rank copies and writes
    pieces: dict[str, list[tuple[Piece, int]]]  # key -> every piece and the rank that writes it
    shapes: dict[str, tuple[int, ...]]
    merges: dict[int, list[str]]  # rank -> the keys it assembles into its file
    files: dict[int, str]  # rank -> its safetensors file name
    hf: dict[str, list[tuple[str, int | None]]]  # key -> (HF name, expert index)


class HFSnapshots(L.Callback):
    """Write a Hugging Face model directory every ``every_n_steps`` optimizer steps and at the end of training.

    Args:
        every_n_steps: 0: off.
        keep: the newest snapshots kept (-1: all).
        dtype: ``"float32"`` or ``"bfloat16"``: what the safetensors store.
        dirpath: where ``step_<N>`` directories go (default: ``<default_root_dir>/hf``).
        timeout_s: how long a rank's writer waits for its peers' files before it gives the snapshot up.
    """

    def __init__(
        self,
        every_n_steps: int = 0,
        keep: int = 3,
        dtype: str = "float32",
        dirpath: str | None = None,
        timeout_s: float = 1800.0,
    ) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ConfigError(f"checkpoint.hf_every_n_steps={every_n_steps!r}; valid: an integer >= 0 (0: off)")
        if not isinstance(keep, int) or (keep < 1 and keep != -1):
            raise ConfigError(f"checkpoint.hf_keep={keep!r}; valid: an integer >= 1, or -1 (keep all)")
        if dtype not in DTYPES:
            raise ConfigError(f"checkpoint.hf_dtype={dtype!r}; valid: {', '.join(DTYPES)}")
        if timeout_s <= 0:
            raise ConfigError(f"HFSnapshots(timeout_s={timeout_s}) must be > 0")
        self.every_n_steps, self.keep, self.dtype, self.timeout_s = every_n_steps, keep, dtype, timeout_s
        self.dirpath = Path(dirpath) if dirpath else None
        self._plan: SnapshotPlan | None = None
        self._config: Any = None
        self._writer: threading.Thread | None = None
        self._last_step = -1
        #: (step, stall in seconds over the ranks) of every snapshot so far
        self.stalls: list[tuple[int, float]] = []

    # ----------------------------------------------------------------------------- Lightning's hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.every_n_steps or stage != "fit":
            return
        self._config = _hf_model_config(pl_module)
        self.dirpath = self.dirpath or Path(trainer.default_root_dir) / "hf"
        tokenizer = _run_tokenizer(trainer.datamodule)
        error = None
        if trainer.is_global_zero:
            try:
                self._prepare(tokenizer)
            except (ConfigError, OSError) as err:
                error = f"{type(err).__name__}: {err}"
        box = [error]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise ConfigError(f"checkpoint.hf_every_n_steps: {box[0]}")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_steps and step % self.every_n_steps == 0 and not trainer.fit_loop._should_accumulate():
            self.snapshot(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.every_n_steps and self._last_step != trainer.global_step:
            self.snapshot(trainer, pl_module)
        self.wait()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.wait()

    # ----------------------------------------------------------------------------- the snapshot
    def snapshot(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Copy this rank's pieces to host memory (the stall) and write the snapshot in the background."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        step = trainer.global_step
        start = time.perf_counter()
        self.wait()
        state = get_model_state_dict(pl_module)
        if self._plan is None:
            self._plan = _plan(state, self._config)
        host = {p.name: _local(state[PREFIX + p.key]).detach().to("cpu", copy=True) for p in self._plan.mine}
        stall = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=pl_module.device)
        if dist.is_initialized():
            dist.all_reduce(stall, op=dist.ReduceOp.MAX)
        self.stalls.append((step, float(stall)))
        self._last_step = step
        for logger in trainer.loggers:
            logger.log_metrics({"hf_snapshot/stall_s": float(stall)}, step=step)
        assert self.dirpath is not None
        size = sum(t.numel() * t.element_size() for t in host.values()) / 2**20
        rank_zero_info(
            f"HF snapshot step {step}: training stalled {float(stall):.3f} s (rank 0 copied {size:.1f} MiB to host "
            f"memory); writing {self.dirpath / f'step_{step}'} in the background"
        )
        self._writer = threading.Thread(
            target=self._write, args=(step, host, self._plan), name=f"hf-snapshot-{step}", daemon=True
        )
        self._writer.start()

    def wait(self) -> None:
        """Wait for the snapshot being written (its own timeouts bound the wait)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    # ----------------------------------------------------------------------------- in the background
    def _write(self, step: int, host: dict[str, torch.Tensor], plan: SnapshotPlan) -> None:
        assert self.dirpath is not None
        partial = self.dirpath / f".step_{step}.partial"
        start = time.perf_counter()
        try:
            _write_snapshot(partial, host, plan, DTYPES[self.dtype], time.monotonic() + self.timeout_s)
            if plan.rank == 0:
                self._publish(partial, step, plan)
                log.info(
                    "HF snapshot step %d complete: %s (%.2f s in the background)",
                    step, self.dirpath / f"step_{step}", time.perf_counter() - start,
                )  # fmt: skip
        except Exception as err:  # a snapshot that fails must not take training down
            log.error("HF snapshot step %d failed on rank %d, left incomplete in %s: %r", step, plan.rank, partial, err)
            _mark(partial / f".failed_{plan.rank}", repr(err))

    def _prepare(self, tokenizer: Any) -> None:
        """Rank 0, before training: remove partial snapshots a stopped run left; write the tokenizer once."""
        assert self.dirpath is not None
        self.dirpath.mkdir(parents=True, exist_ok=True)
        for stale in self.dirpath.glob(".step_*.partial"):
            shutil.rmtree(stale)
        target = self.dirpath / ".tokenizer"
        shutil.rmtree(target, ignore_errors=True)
        if tokenizer is not None:
            from lightning_ultrascale.data.hf_tokenizer import write_hf_tokenizer

            write_hf_tokenizer(tokenizer, target, self._config.vocab_size, self._config.max_seq_len)

    def _publish(self, partial: Path, step: int, plan: SnapshotPlan) -> None:
        """Rank 0, once every rank wrote its file: config, index and tokenizer, then the rename; old ones rotated."""
        from lightning_ultrascale.models.hf.convert import hf_config_json

        assert self.dirpath is not None
        shutil.rmtree(partial / ".pieces")
        for marker in partial.glob(".merged_*"):
            marker.unlink()
        total, weight_map = 0, {}
        for rank, keys in plan.merges.items():
            for key in keys:
                for hf, expert in plan.hf[key]:
                    shape = plan.shapes[key][1:] if expert is not None else plan.shapes[key]
                    total += math.prod(shape) * DTYPES[self.dtype].itemsize
                    weight_map[hf] = plan.files[rank]
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (partial / "config.json").write_text(json.dumps(hf_config_json(self._config, self.dtype), indent=2))
        tokenizer = self.dirpath / ".tokenizer"
        if tokenizer.is_dir():
            for file in tokenizer.iterdir():
                shutil.copy2(file, partial / file.name)
        final = self.dirpath / f"step_{step}"
        if final.exists():  # a resumed run passing the same step again
            shutil.rmtree(final)
        partial.rename(final)
        if self.keep > 0:
            done = sorted(self.dirpath.glob("step_*"), key=lambda p: int(p.name[5:]) if p.name[5:].isdigit() else -1)
            for old in done[: -self.keep]:
                shutil.rmtree(old)


def _hf_model_config(pl_module: L.LightningModule) -> Any:
    """The model's ``LlamaConfig``, refused where no HF directory can hold the model."""
    from lightning_ultrascale.models import LlamaConfig
    from lightning_ultrascale.models.hf.convert import hf_architecture

    config = getattr(pl_module, "config", None)
    if not isinstance(config, LlamaConfig):
        raise ConfigError(
            f"checkpoint.hf_every_n_steps: {type(pl_module).__name__} holds no LlamaConfig (a model=hf run trains the "
            "transformers model itself); valid: our models, or ultrascale-export on a checkpoint"
        )
    hf_architecture(config)  # a ConfigError for an architecture without an HF counterpart
    if config.moe is not None and config.moe.router == "softmax" and config.moe.bias_update_rate:
        raise ConfigError(
            f"checkpoint.hf_every_n_steps with model.moe.bias_update_rate={config.moe.bias_update_rate}: a softmax "
            "(Mixtral) router's selection bias has no HF counterpart; valid: bias_update_rate=0, or a sigmoid router"
        )
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise ConfigError(
            "checkpoint.hf_every_n_steps needs safetensors: pip install 'lightning-ultrascale[hf]'"
        ) from None
    return config


def _run_tokenizer(datamodule: Any) -> Any:
    """The data's tokenizer, its files checked against the hash the data recorded; None (with a warning) if unknown."""
    from lightning_ultrascale.data.tokenizer import tokenizer_hash
    from lightning_ultrascale.training.evaluation import run_tokenizer

    record = datamodule.tokenizer_record() if hasattr(datamodule, "tokenizer_record") else None
    if record is None:
        log.warning("HF snapshots: the data records no tokenizer; the snapshots hold the model alone")
        return None
    tokenizer = run_tokenizer(datamodule)
    if tokenizer_hash(tokenizer.files) != record["hash"]:
        raise ConfigError(
            f"checkpoint.hf_every_n_steps: the tokenizer files at {record['files']} no longer hash to the data's "
            f"record ({record['hash'][:12]}): the snapshot's tokenizer would map its ids to other text"
        )
    return tokenizer


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _held(state: dict[str, Any], keys: set[str]) -> list[tuple[Piece, tuple[int, ...]]]:
    """The pieces of ``keys`` this rank holds, with their tensors' whole shapes."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    held = []
    for name, tensor in state.items():
        key = name[len(PREFIX) :]
        if not name.startswith(PREFIX) or key not in keys or tensor.device.type == "meta":
            continue
        whole = tuple(tensor.shape)
        if isinstance(tensor, DTensor):
            shape, offsets = compute_local_shape_and_global_offset(whole, tensor.device_mesh, tensor.placements)
            if tuple(tensor.to_local().shape) != tuple(shape):
                raise RuntimeError(f"HF snapshot: {key}'s local shard is {tuple(tensor.to_local().shape)}, not {shape}")
        else:
            shape, offsets = whole, (0,) * len(whole)
        if math.prod(shape):
            held.append((Piece(key, tuple(offsets), tuple(shape)), whole))
    return held


def _plan(state: dict[str, Any], config: Any) -> SnapshotPlan:
    """Agree who copies each piece (one of its holders) and who assembles each tensor (one gather)."""
    from lightning_ultrascale.models.hf.convert import hf_file_tensors

    hf: dict[str, list[tuple[str, int | None]]] = {}
    for name, (key, expert) in hf_file_tensors(config).items():
        hf.setdefault(key, []).append((name, expert))
    held = _held(state, set(hf))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    everyone: list[Any] = [held]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, held)
    holders: dict[Piece, list[int]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for holder in range(world):
        for piece, whole in everyone[holder]:
            holders.setdefault(piece, []).append(holder)
            shapes[piece.key] = whole
    # Each piece is copied by one of its holders: the largest first, to the least loaded (replicas spread the
    # copy, and so the stall, over the data-parallel ranks).
    copied = [0] * world
    pieces: dict[str, dict[Piece, int]] = {}
    for piece in sorted(holders, key=lambda p: (-math.prod(p.shape), p.name)):
        writer = min(holders[piece], key=lambda r: (copied[r], r))
        copied[writer] += math.prod(piece.shape)
        pieces.setdefault(piece.key, {})[piece] = writer
    for key in hf:
        covered = sum(math.prod(p.shape) for p in pieces.get(key, {}))
        if key not in shapes or covered != math.prod(shapes[key]):
            raise RuntimeError(
                f"HF snapshot: the ranks hold {covered} elements of {key} in distinct pieces, not its "
                f"{math.prod(shapes.get(key, (0,)))}: a layout whose shards the snapshot cannot describe"
            )
    load = [0] * world
    merges: dict[int, list[str]] = {}
    for key in sorted(hf, key=lambda k: (-math.prod(shapes[k]), k)):  # the largest first, to the least loaded
        target = min(range(world), key=lambda r: (load[r], r))
        load[target] += math.prod(shapes[key])
        merges.setdefault(target, []).append(key)
    files = {r: f"model-{i + 1:05d}-of-{len(merges):05d}.safetensors" for i, r in enumerate(sorted(merges))}
    mine = sorted((p for key in pieces for p, r in pieces[key].items() if r == rank), key=lambda p: p.name)
    return SnapshotPlan(
        rank, world, mine, {k: sorted(v.items(), key=lambda x: x[0].name) for k, v in pieces.items()},
        shapes, merges, files, hf,
    )  # fmt: skip


def _write_snapshot(
    partial: Path, host: dict[str, torch.Tensor], plan: SnapshotPlan, dtype: torch.dtype, deadline: float
) -> None:
    """This rank's part of a snapshot (see the module docstring); rank 0 returns once every rank's file is there."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    pieces = partial / ".pieces"
    pieces.mkdir(parents=True, exist_ok=True)
    _save(save_file, host, pieces / f"rank_{plan.rank}.safetensors")
    _wait(partial, [pieces / f"rank_{r}.safetensors" for r in range(plan.world)], deadline)
    keys = plan.merges.get(plan.rank, [])
    if keys:
        out: dict[str, torch.Tensor] = {}
        with contextlib.ExitStack() as stack:  # each rank's file opened once (its header read once), not per piece
            files = [stack.enter_context(safe_open(str(pieces / f"rank_{r}.safetensors"), framework="pt"))
                     for r in range(plan.world)]  # fmt: skip
            for key in keys:
                whole = _assemble(key, plan, files)
                for name, expert in plan.hf[key]:
                    out[name] = (whole if expert is None else whole[expert]).to(dtype).contiguous()
        _save(save_file, out, partial / plan.files[plan.rank])
    _mark(partial / f".merged_{plan.rank}", "")
    if plan.rank == 0:
        _wait(partial, [partial / f".merged_{r}" for r in range(plan.world)], deadline)


def _assemble(key: str, plan: SnapshotPlan, files: list[Any]) -> torch.Tensor:
    """The whole tensor ``key`` from its pieces in the ranks' open ``files``; every element written exactly once."""
    whole: torch.Tensor | None = None
    filled = torch.zeros(plan.shapes[key], dtype=torch.int8)
    for piece, rank in plan.pieces[key]:
        part = files[rank].get_tensor(piece.name)
        if whole is None:
            whole = torch.empty(plan.shapes[key], dtype=part.dtype)
        box = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.shape))
        whole[box] = part
        filled[box] += 1
    if whole is None or not bool((filled == 1).all()):
        raise RuntimeError(f"HF snapshot: the pieces of {key} do not cover it exactly once")
    return whole


def _save(save_file: Any, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write a safetensors file whole or not at all (written aside, then renamed)."""
    aside = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(aside))
    os.replace(aside, path)


def _mark(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _wait(partial: Path, paths: list[Path], deadline: float) -> None:
    """Until every path exists; a peer's failure marker or the deadline gives the snapshot up."""
    while not all(p.exists() for p in paths):
        failed = sorted(partial.glob(".failed_*"))
        if failed:
            raise RuntimeError(f"{failed[0].name[1:].replace('_', ' rank ')}: {failed[0].read_text()}")
        if time.monotonic() > deadline:
            missing = [p.name for p in paths if not p.exists()]
            raise TimeoutError(f"waited for the other ranks' {', '.join(missing)}")
        time.sleep(0.02)
