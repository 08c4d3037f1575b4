"""One checkpoint format for every layout, as a part of :class:`~lightning_ultrascale.UltraScaleStrategy`.

A checkpoint is a DCP directory holding, by the full model's parameter names:

- ``state_dict.<name>``: the model's tensors (torch's ``get_model_state_dict``);
- ``optimizer_<i>.state.<name>.<key>``: each parameter's optimizer state at the parameter's own
  shape (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``), and
  ``optimizer_<i>.param_groups.<name>.<hyperparameter>``: torch's flattened optimizer format;
- Lightning's loops, LR schedulers, callbacks and data position in its ``meta.pt``; a checkpoint
  Lightning Fabric saves (``fabric.py``) has ``global_step``, ``lr_schedulers`` and the data
  loaders' positions there instead, which a Trainer takes as its loop position
  (:func:`trainer_progress`), and the user's own entries. Names may differ by a wrapper's prefix
  (a bare model's ``layers.0...``, a LightningModule's ``model.layers.0...``): each loads the
  other's (:func:`checkpoint_names`).

Every rank writes the chunks it holds, whatever holds them: a replica (DP), a DTensor shard (FSDP,
TP), a pipeline stage's own parameters, a sharded optimizer's flat range (``data/flat_chunks.py``).
DCP matches chunks by name and offset, so any layout loads any other's checkpoint, under any world
size, without gathering to one rank. A tied weight is saved under both its names, so a pipeline
whose last stage holds the head's copy finds it in a one-process checkpoint, and the reverse.
Every file of a checkpoint is read as data (:mod:`~lightning_ultrascale.core.checkpoint_io`).
"""

from __future__ import annotations

import copy
import itertools
import logging
import shutil
import zipfile
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning
import torch
import torch.distributed as dist
from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ultrascale.core.checkpoint_io import (
    CheckpointDataError,
    check_weights_only,
    data_only,
    load,
    load_dcp,
    read_metadata,
    to_data,
)
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.utils.optim import initialize_state

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from lightning_ultrascale.parallel.data.engines import GradientSync
    from lightning_ultrascale.parallel.layout import Layout
    from lightning_ultrascale.parallel.step import StepRunner


def _same(name: str) -> str:
    return name


def parameter_names(module: nn.Module, rename: Callable[[str], str] = _same) -> dict[nn.Parameter, list[str]]:
    """Every name of every parameter (a tied weight has two), in ``named_parameters`` order.

    ``rename``: how a checkpoint names them (:func:`checkpoint_names`), if not as ``module`` does.
    """
    names: dict[nn.Parameter, list[str]] = defaultdict(list)
    for name, p in module.named_parameters(remove_duplicate=False):
        names[p].append(rename(name))
    return names


def optimizer_names(
    module: nn.Module, syncs: Sequence[GradientSync], rename: Callable[[str], str] = _same
) -> dict[nn.Parameter, list[str]]:
    """:func:`parameter_names`, plus a parameter's names for the tensor the optimizer steps in its place (a master)."""
    names = parameter_names(module, rename)
    for sync in syncs:
        for param, alias in sync.optimizer_aliases().items():
            names[alias] = names[param]  # type: ignore[index]
    return names


def named_optimizer_state(
    module: nn.Module, optimizer: Optimizer, syncs: Sequence[GradientSync], rename: Callable[[str], str] = _same
) -> dict[str, Any]:
    """``optimizer``'s state in the one format: ``state.<name>.<key>`` and ``param_groups.<name>.<hyperparameter>``.

    Values are the live tensors (or views of them), so ``dcp.load`` into the result fills the
    optimizer in place; :func:`load_named_optimizer_state` does the rest.
    """
    initialize_state(optimizer)
    names = optimizer_names(module, syncs, rename)
    out: dict[str, Any] = {}
    handled: set[int] = set()
    for sync in syncs:
        out.update(sync.named_optimizer_state(names))
        handled.update(id(t) for t in sync.optimizer_shards())
    for group in optimizer.param_groups:
        hyper = {h: v for h, v in group.items() if h != "params"}
        for p in group["params"]:
            if id(p) in handled:
                continue
            for name in _names_of(p, names):
                out.update({f"state.{name}.{k}": v for k, v in optimizer.state[p].items()})
                out.update({f"param_groups.{name}.{h}": v for h, v in hyper.items()})
    return out


def load_named_optimizer_state(
    module: nn.Module,
    optimizer: Optimizer,
    syncs: Sequence[GradientSync],
    loaded: dict[str, Any],
    rename: Callable[[str], str] = _same,
) -> None:
    """After ``dcp.load`` into :func:`named_optimizer_state`'s dict: hyperparameters and non-tensor state."""
    names = optimizer_names(module, syncs, rename)
    handled: set[int] = set()
    for sync in syncs:
        sync.load_named_optimizer_state(loaded, names)
        handled.update(id(t) for t in sync.optimizer_shards())
    for group in optimizer.param_groups:
        own = [p for p in group["params"] if id(p) not in handled]
        for p in own:
            first = _names_of(p, names)[0]
            state = optimizer.state[p]
            for key, value in list(state.items()):
                if not isinstance(value, torch.Tensor):  # tensors were filled in place
                    state[key] = loaded[f"state.{first}.{key}"]
        if own:
            first = _names_of(own[0], names)[0]
            group.update({h: loaded[f"param_groups.{first}.{h}"] for h in group if h != "params"})


def _names_of(p: torch.Tensor, names: Mapping[nn.Parameter, list[str]]) -> list[str]:
    if p not in names:
        raise RuntimeError(
            f"the optimizer holds a tensor of shape {tuple(p.shape)} that is no parameter of the model: checkpoints "
            "key optimizer states by parameter name (put only model parameters in configure_optimizers)"
        )
    return names[p]  # type: ignore[index]


def _previous(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def publish(partial: Path, path: Path) -> None:
    """Make the complete checkpoint in ``partial`` the one at ``path`` (rank 0, once every rank has written).

    Two renames; a crash between them leaves the previous checkpoint complete at ``<path>.old``,
    which :func:`checkpoint_location` finds.
    """
    _remove(_previous(path))
    if path.exists():
        path.rename(_previous(path))
    partial.rename(path)
    _remove(_previous(path))


def begin_save(path: Path, rank: int, barrier: Callable[[], None]) -> Path:
    """The directory every rank writes ``path``'s checkpoint into, emptied by rank 0, until :func:`publish_save`."""
    partial = _partial(path)
    if rank == 0:
        _remove(partial)
        partial.mkdir(parents=True)
    barrier()
    return partial


def publish_save(meta: dict[str, Any], partial: Path, path: Path, rank: int, barrier: Callable[[], None]) -> None:
    """Once every rank has written its shards into ``partial``: rank 0 adds ``meta`` and publishes it at ``path``."""
    if rank == 0:
        torch.save(meta, partial / _METADATA_FILENAME)
    barrier()  # every rank has written its files
    if rank == 0:
        publish(partial, path)
    barrier()


def master_state(
    module: nn.Module, syncs: Sequence[GradientSync], rename: Callable[[str], str] = _same
) -> dict[str, Any]:
    """The fp32 master weights the syncs keep (``bf16-mixed``, ZeRO 0-2), by parameter name: what a checkpoint holds."""
    names = parameter_names(module, rename)
    return {k: v for sync in syncs for k, v in sync.master_state(names).items()}


def with_masters(state: dict[str, Any], module: nn.Module, syncs: Sequence[GradientSync]) -> dict[str, Any]:
    """A sharded model state dict with the fp32 masters in place of the bf16 weights they round to.

    A rank holding no element of a parameter's master writes nothing under its name.
    """
    masters = master_state(module, syncs)
    return {k: masters.get(k, v) for k, v in state.items() if masters.get(k, v) is not None}


def checkpoint_names(path: Path, names: Collection[str]) -> Callable[[str], str]:
    """How the DCP checkpoint at ``path`` names a model whose tensors are ``names`` here.

    The same, or under another wrapper: a Fabric run that sets up the bare model saves
    ``layers.0...``, a Trainer run whose LightningModule holds it as ``model`` saves
    ``model.layers.0...``; each loads the other's. Found from one name, checked on all.

    Example:
        >>> rename = _rename("model.", "")
        >>> rename("model.layers.0.attention.wq.weight")
        'layers.0.attention.wq.weight'
    """
    section = "state_dict."
    saved = {k[len(section) :] for k in read_metadata(path).state_dict_metadata if k.startswith(section)}
    if not names or set(names) <= saved:
        return _same
    probe = next(iter(names))

    def shared(theirs: str) -> int:  # dotted components the two names end with
        pairs = zip(reversed(probe.split(".")), reversed(theirs.split(".")))
        return sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], pairs))

    match = max(saved, key=shared, default="")
    cut = shared(match)
    if not cut:
        return _same
    rename = _rename(_prefix(probe, cut), _prefix(match, cut))
    return rename if all(rename(n) in saved for n in names) else _same


def _prefix(name: str, cut: int) -> str:
    """``name`` without its last ``cut`` dotted components: ``_prefix("model.norm.weight", 2) == "model."``."""
    parts = name.split(".")
    return "".join(f"{p}." for p in parts[: len(parts) - cut])


def _rename(strip: str, add: str) -> Callable[[str], str]:
    def rename(name: str) -> str:
        return add + name[len(strip) :] if name.startswith(strip) else name

    return rename


def load_layout_state(
    path: Path, module: nn.Module, optimizers: Sequence[Optimizer], syncs: Sequence[GradientSync], strict: bool
) -> None:
    """Fill ``module``, its fp32 masters and ``optimizers`` in place from a DCP checkpoint of any layout."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    # DCP loads into the tensors of a template, in place, each rank its own chunks.
    weights = get_model_state_dict(module)
    rename = checkpoint_names(path, weights)
    state: dict[str, Any] = {"state_dict": {rename(k): v for k, v in weights.items()}}
    # fp32 master weights (bf16-mixed, ZeRO 0-2) are loaded in place of the bf16 parameters.
    masters = {k: v for k, v in master_state(module, syncs, rename).items() if k in state["state_dict"]}
    live = {k: state["state_dict"][k] for k in masters}
    for k, master in masters.items():  # (a rank holding none of a master reads nothing of it)
        if master is None:
            del state["state_dict"][k]
        else:
            state["state_dict"][k] = master
    for idx, optimizer in enumerate(optimizers):
        state[f"optimizer_{idx}"] = named_optimizer_state(module, optimizer, syncs, rename)
    load_dcp(state, path)
    state["state_dict"].update(live)
    module.load_state_dict({k: state["state_dict"][rename(k)] for k in weights}, strict=strict)
    for sync in syncs:
        sync.load_masters()
    for idx, optimizer in enumerate(optimizers):
        load_named_optimizer_state(module, optimizer, syncs, state[f"optimizer_{idx}"], rename)


def checkpoint_location(path: _PATH) -> Path:
    """Where the checkpoint saved as ``path`` is: itself, or its previous version if a crash interrupted a save."""
    where = Path(path)
    if not where.exists() and (_previous(where) / ".metadata").is_file():
        log.warning("checkpoint %s was being replaced when the run stopped: loading its previous version", where)
        return _previous(where)
    return where


def check_checkpoint_path(path: _PATH, option: str = "ckpt_path") -> None:
    """Refuse a ``ckpt_path`` that is not a checkpoint, saying what is there instead."""
    where = checkpoint_location(path)
    hint = "a checkpoint is a directory like outputs/<run>/checkpoints/last.ckpt (or a single file)"
    if not where.exists():
        parent = where.parent
        near = sorted(p.name for p in parent.iterdir())[:8] if parent.is_dir() else []
        found = f"; {parent} holds: {', '.join(near)}" if near else ""
        raise ConfigError(f"{option}={path} does not exist{found}; {hint}")
    if where.is_dir() and not (where / ".metadata").is_file():
        found = sorted(p.name for p in where.iterdir())[:8]
        raise ConfigError(
            f"{option}={path} is a directory but not a checkpoint (it has no .metadata, DCP's index); it holds: "
            f"{', '.join(found) or 'nothing'}; {hint}"
        )
    if where.is_dir() and not (where / _METADATA_FILENAME).is_file():
        raise ConfigError(
            f"{option}={path} has DCP's .metadata but no {_METADATA_FILENAME} (the loops, LR schedulers and "
            "hyperparameters every checkpoint of ours has): an incomplete copy, or a save that did not finish; "
            f"copy the whole directory, or resume from another checkpoint; {hint}"
        )
    if where.is_dir():
        _check_shard_files(path, where, option)
    elif not zipfile.is_zipfile(where):
        raise ConfigError(
            f"{option}={path} is a file but not a checkpoint (not torch.save's zip format: a truncated copy, or "
            f"another kind of file); {hint}"
        )


def _check_shard_files(path: _PATH, where: Path, option: str) -> None:
    """Every file DCP's index names is there and long enough (else every rank fails deep in the load)."""
    try:
        metadata = read_metadata(where)
    except CheckpointDataError:
        raise
    except Exception as err:
        raise ConfigError(
            f"{option}={path} has an unreadable .metadata (DCP's index: {type(err).__name__}); an incomplete copy "
            "or a save that did not finish; copy the whole directory, or resume from another checkpoint"
        ) from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(f for f in needed if not (where / f).is_file())
    short = sorted(f for f in needed if f not in missing and (where / f).stat().st_size < needed[f])
    if missing or short:
        what = [
            f"missing {', '.join(missing[:4])}" if missing else "",
            f"truncated {', '.join(short[:4])}" if short else "",
        ]
        raise ConfigError(
            f"{option}={path} is incomplete: {'; '.join(w for w in what if w)} (of the {len(needed)} shard files "
            "its .metadata names); copy the whole directory, or resume from another checkpoint"
        )


def check_checkpoint_model(path: _PATH, hparams: Mapping[str, Any], option: str = "ckpt_path") -> None:
    """Refuse a checkpoint saved by another architecture, naming every setting that differs.

    Compares the ``model_config`` hyperparameter the checkpoint was saved with (``LlamaModule``
    saves one) with this run's, before any process group: otherwise DCP fails deep inside the
    load with ``Size mismatch`` on some optimizer state.
    """
    from lightning_ultrascale.models.common.decoder import LlamaConfig

    where = checkpoint_location(path)
    meta = where / _METADATA_FILENAME if where.is_dir() else where
    saved_hparams = load(meta, mmap=True).get("hyper_parameters") or {}
    mine, saved = _model_record(hparams), _model_record(saved_hparams)
    if mine is None or saved is None:
        return
    if mine[0] != saved[0]:
        kinds = {"model_config": "our Llama", "hf_config": "a Hugging Face model as it is (model=hf)"}
        wrong = [f"{kinds[saved[0]]} vs {kinds[mine[0]]}"]
        theirs, ours = saved_hparams.get("model", kinds[saved[0]]), hparams.get("model", kinds[mine[0]])
    elif mine[0] == "model_config":
        a, b = LlamaConfig(**saved[1]), LlamaConfig(**mine[1])
        wrong, theirs, ours = a.architecture_differences(b), a.name, b.name
    else:  # a Hugging Face model trained as it is: its config.json's architecture
        keys = [k for k in HF_ARCHITECTURE if saved[1].get(k) != mine[1].get(k)]
        wrong = [f"{k}={saved[1].get(k)!r} (this run: {mine[1].get(k)!r})" for k in keys]
        theirs, ours = saved_hparams.get("model", "an HF model"), hparams.get("model", "an HF model")
    if wrong:
        raise ConfigError(
            f"{option}={path} was saved by model {theirs}, and this run builds {ours}: {', '.join(wrong)}; "
            f"resume with the model the checkpoint was saved with ({theirs}), or start a new run"
        )


#: The settings of an HF ``config.json`` that shape the parameters (and so the checkpoint).
HF_ARCHITECTURE = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "tie_word_embeddings", "num_local_experts", "num_experts",
    "moe_intermediate_size", "attention_bias",
)  # fmt: skip


def _model_record(hparams: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
    """``("model_config", our config)`` or ``("hf_config", an HF config.json)`` that a module saved, if any."""
    for key in ("model_config", "hf_config"):
        if isinstance(hparams.get(key), Mapping):
            return key, hparams[key]
    return None


def resume_where_the_data_stopped(checkpoint: dict[str, Any]) -> None:
    """Make a checkpoint written when ``max_steps`` stopped training mid-epoch resume mid-epoch.

    Lightning runs its epoch-end bookkeeping when ``max_steps`` ends a run, so the end-of-training
    checkpoint (the one users resume from) says the epoch was completed, and a resumed run starts
    the next epoch: other data than the uninterrupted run's. While the epoch's data is not
    exhausted (``is_last_batch`` false), the epoch is marked processed up to its last batch
    instead, which Lightning restores as a mid-epoch restart at the saved data position.
    """
    loop = checkpoint.get("loops", {}).get("fit_loop")
    if not loop or loop["epoch_loop.batch_progress"].get("is_last_batch", True):
        return
    for progress in loop["epoch_progress"].values():
        if progress["processed"] == progress["started"] and progress["started"] > 0:
            progress["processed"] = progress["completed"] = progress["started"] - 1


#: The saving run's ``accumulate_grad_batches``, kept beside Lightning's loops in a checkpoint.
ACCUMULATION_KEY = "ultrascale_accumulate_grad_batches"


def rebase_accumulation(checkpoint: dict[str, Any], accumulate: int) -> None:
    """Count a mid-epoch checkpoint's micro-batches in this run's gradient accumulation.

    Lightning steps the optimizer when the epoch's micro-batch count reaches a multiple of
    ``accumulate_grad_batches``, and restores the SAVING run's count: a ZeRO-1 dp2 checkpoint
    (accumulation 1) after 3 steps says 3 micro-batches, so a resume under pp2 (accumulation 2)
    stepped after one micro-batch and every later step straddled two global batches. The saved
    micro-batches are whole optimizer steps; they become as many steps of ``accumulate`` each.
    A checkpoint written inside an accumulation (its partial gradients are not in it) is refused.
    """
    loop = checkpoint.get("loops", {}).get("fit_loop")
    saved = checkpoint.get(ACCUMULATION_KEY)
    if not loop or saved is None:
        return
    progress = loop["epoch_loop.batch_progress"]
    if progress.get("is_last_batch", False):
        return  # the epoch is over: the next one starts from zero
    trained = progress["current"]["processed"]
    if trained % saved:
        raise ConfigError(
            f"the checkpoint was written after micro-batch {trained} of its epoch, inside a gradient accumulation of "
            f"{saved} micro-batches (step {checkpoint.get('global_step')}): the gradients of its unfinished step are "
            "not in it, so resuming would train that step on part of its batch; resume from a checkpoint written "
            "after an optimizer step (ModelCheckpoint and checkpoint.every_n_steps write only those)"
        )
    shift = trained // saved * accumulate - trained
    for counters in (progress["current"], progress["total"]):
        for key in ("ready", "started", "processed", "completed"):
            counters[key] += shift


#: Where a Fabric checkpoint keeps the positions of the resumable data loaders it was given, in order.
TRAIN_DATA_KEY = "ultrascale_train_data"


def data_positions(meta: Mapping[str, Any]) -> list[Any] | None:
    """The data loaders' positions a checkpoint holds: Fabric's (:data:`TRAIN_DATA_KEY`), or the Trainer's loops'."""
    if TRAIN_DATA_KEY in meta:
        return list(meta[TRAIN_DATA_KEY])
    return meta.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader")


def trainer_progress(checkpoint: dict[str, Any], fit_loop: dict[str, Any], schedulers: int, option: str) -> None:
    """Give a checkpoint Lightning Fabric wrote what the Trainer resumes from (a Trainer's own: nothing to do).

    Fabric saves ``global_step``, a step's micro-steps (:data:`ACCUMULATION_KEY`), the LR
    schedulers and the resumable data loaders' positions (:data:`TRAIN_DATA_KEY`); they become
    the progress of ``fit_loop`` (this Trainer's fresh ``fit_loop.state_dict()``, so every key is
    its Lightning version's): training continues at that step and, given a data position, at
    that batch of its epoch (else at the epoch's first batch). ``schedulers``: this run's count.
    """
    if "loops" in checkpoint:  # every checkpoint a Trainer writes has them
        return
    saved = checkpoint.setdefault("lr_schedulers", [])
    if len(saved) < schedulers:
        raise ConfigError(
            f"{option} was saved by Lightning Fabric with {len(saved)} LR scheduler(s), and this run has "
            f"{schedulers}: put the scheduler in the state fabric.save writes (e.g. {{'model': model, 'optimizer': "
            "optimizer, 'scheduler': scheduler}) to resume it in a Trainer"
        )
    steps = int(checkpoint.get("global_step", 0))
    data = data_positions(checkpoint)
    micro = steps * checkpoint.setdefault(ACCUMULATION_KEY, 1) if data else 0
    loop = copy.deepcopy(fit_loop)
    _count(loop["epoch_progress"], ready=1, started=1)
    _count(loop["epoch_loop.batch_progress"], ready=micro, started=micro, processed=micro, completed=micro)
    optimizer = loop["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
    _count(optimizer["step"], ready=steps, completed=steps)
    _count(optimizer["zero_grad"], ready=steps, started=steps, completed=steps)
    _count(loop["epoch_loop.manual_optimization.optim_step_progress"], ready=steps, completed=steps)
    _count(loop["epoch_loop.scheduler_progress"], ready=steps, completed=steps)
    loop["epoch_loop.state_dict"]["_batches_that_stepped"] = steps
    loop["state_dict"] = {"combined_loader": data} if data else {}
    checkpoint["loops"] = {"fit_loop": loop}
    checkpoint.setdefault("pytorch-lightning_version", lightning.__version__)


def _count(progress: dict[str, Any], **counts: int) -> None:
    for scope in ("current", "total"):
        progress[scope].update(counts)


class LayoutCheckpoints(ModelParallelStrategy):
    """Lightning's checkpoint hooks for the strategy's layout (its ``layout`` and ``step``).

    Saves are crash-safe: every rank writes into ``<path>.partial``, and rank 0 renames it to
    ``path`` once all have finished, so a crash during a save leaves the previous checkpoint
    loadable. With ``async_checkpoint`` DCP writes in a background thread while training goes on;
    the save is published at the next save or when fitting ends.
    """

    layout: Layout
    step: StepRunner
    async_checkpoint: bool = False
    _pending_save: tuple[Any, dict[str, Any], Path, Path] | None = None
    _save_group: Any = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        resume_where_the_data_stopped(checkpoint)
        if self.lightning_module is not None and self.lightning_module._trainer is not None:
            checkpoint[ACCUMULATION_KEY] = self.lightning_module.trainer.accumulate_grad_batches
        to_data(checkpoint, filepath)
        if not self._save_distributed_checkpoint or storage_options is not None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        from torch.distributed.checkpoint import async_save, save

        path = Path(self.broadcast(filepath))
        self.finish_checkpoint()
        partial = begin_save(path, self.global_rank, self.barrier)
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        if self.async_checkpoint and self.lightning_module is not None and self.lightning_module.trainer.training:
            if self._save_group is None:  # the background thread's collectives stay off training's group
                self._save_group = dist.new_group(backend="gloo")
            future = async_save(state, checkpoint_id=partial, process_group=self._save_group)
            self._pending_save = (future, checkpoint, partial, path)
            return None
        save(state, checkpoint_id=partial)
        self._publish(checkpoint, partial, path)
        return None

    def finish_checkpoint(self) -> None:
        """Wait for an asynchronous save and publish it (every rank calls it)."""
        if self._pending_save is not None:
            future, meta, partial, path = self._pending_save
            self._pending_save = None
            future.result()
            self._publish(meta, partial, path)

    def _publish(self, meta: dict[str, Any], partial: Path, path: Path) -> None:
        publish_save(meta, partial, path, self.global_rank, self.barrier)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self.finish_checkpoint()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state dict, with the fp32 master weights in place of bf16 ones (``bf16-mixed``, ZeRO 0-2).

        A checkpoint holds what the optimizer steps, so a run resumes exactly, and an fp32 run
        (or any layout) loads it as its own weights.
        """
        state = super().lightning_module_state_dict()
        masters = self._master_state()
        if not masters:
            return state
        if not self._save_distributed_checkpoint:
            if any(not isinstance(m, torch.Tensor) for m in masters.values()):
                raise ConfigError(
                    f"{self.parallel_dims.describe()}: the fp32 master weights are sharded across ranks; save them "
                    "with UltraScaleStrategy(save_distributed_checkpoint=True), the default"
                )
            masters = {k: (m.full_tensor() if isinstance(m, DTensor) else m).detach().cpu() for k, m in masters.items()}
            return {**state, **{k: v for k, v in masters.items() if k in state}}
        assert self.model is not None
        return with_masters(state, self.model, self.layout.grad_syncs)

    def _master_state(self) -> dict[str, Any]:
        assert self.model is not None
        return master_state(self.model, self.layout.grad_syncs)

    def _shards_optimizer(self) -> bool:
        return any(sync.optimizer_shards() for sync in self.layout.grad_syncs)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if not self._save_distributed_checkpoint:
            if self._shards_optimizer():
                raise ConfigError(
                    f"{self.parallel_dims.describe()}: the optimizer states are sharded across ranks; save them "
                    "with UltraScaleStrategy(save_distributed_checkpoint=True), the default"
                )
            masters = [m for sync in self.layout.grad_syncs for m in sync.optimizer_aliases().values()]
            if masters:  # whole fp32 masters (bf16-mixed, ZeRO-0): torch's own format, by position
                if any(isinstance(m, DTensor) for m in masters):
                    raise ConfigError(
                        f"{self.parallel_dims.describe()}: the fp32 master weights are tensor-parallel DTensors; "
                        "save them with UltraScaleStrategy(save_distributed_checkpoint=True), the default"
                    )
                return inner.state_dict()
            return super().optimizer_state(optimizer)
        assert self.model is not None
        return named_optimizer_state(self.model, inner, self.layout.grad_syncs)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint of any layout's model: sharded (DCP) or full, DTensor parameters or not.

        Lightning's own loader insists on DTensor parameters, which replicated layouts do not have,
        and on optimizer states in torch's nested format, which pipeline stages cannot share. The
        saved loop position is counted in this run's gradient accumulation (:func:`rebase_accumulation`);
        a checkpoint Lightning Fabric saved gets the loop position of its step (:func:`trainer_progress`).
        The files are read as data only (:mod:`~lightning_ultrascale.core.checkpoint_io`), and ``weights_only`` set
        false is refused.
        """
        check_weights_only(weights_only, f"ckpt_path={checkpoint_path}")
        checkpoint = self._load_layout_checkpoint(checkpoint_path)
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        schedulers = len(trainer.lr_scheduler_configs)
        trainer_progress(checkpoint, trainer.fit_loop.state_dict(), schedulers, f"ckpt_path={checkpoint_path}")
        rebase_accumulation(checkpoint, trainer.accumulate_grad_batches)
        return checkpoint

    def _load_single_file(self, path: Path, strict: bool) -> dict[str, Any]:
        """A full (``torch.save``) checkpoint: into the model, the optimizers and the fp32 masters."""
        assert self.model is not None
        if any(isinstance(p, DTensor) for p in self.model.parameters()):
            if self._master_state():
                raise ConfigError(
                    f"ckpt_path={path} is a single-file checkpoint, which loads tensor-parallel layouts only "
                    "without master weights (bf16-mixed at ZeRO 0-2 keeps them): save with "
                    "save_distributed_checkpoint=True (the default) and resume from that directory"
                )
            with data_only(path):  # Lightning's loader, which distributes the weights to the DTensor shards
                return super().load_checkpoint(path, weights_only=True)
        checkpoint = load(path)
        weights = checkpoint.pop("state_dict")
        self.model.load_state_dict(weights, strict=strict)
        # The masters (bf16-mixed, ZeRO 0-2) take the file's full precision.
        values = {p: weights[n[0]] for p, n in parameter_names(self.model).items() if n[0] in weights}
        for sync in self.layout.grad_syncs:
            sync.load_masters(values)
        for optimizer, state in zip(self.optimizers, checkpoint.pop("optimizer_states", [])):
            optimizer.load_state_dict(state)
        return checkpoint

    def _load_layout_checkpoint(self, checkpoint_path: _PATH) -> dict[str, Any]:
        path = checkpoint_location(self.broadcast(checkpoint_path))
        assert self.model is not None and self.lightning_module is not None
        # The CLI checks both before any process group; Lightning hands us the path only now.
        check_checkpoint_path(path)
        check_checkpoint_model(path, self.lightning_module.hparams)
        strict = self.lightning_module.strict_loading
        if not _is_sharded_checkpoint(path):
            return self._load_single_file(path, strict)
        load_layout_state(path, self.model, self.optimizers, self.layout.grad_syncs, strict)
        # Loops, schedulers, callbacks and the datamodule restore themselves from the rest.
        return load(path / _METADATA_FILENAME, map_location=None)
