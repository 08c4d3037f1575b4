"""A checkpoint is data: every file of one the package reads is unpickled here, and nothing in it runs.

A pickle names functions that unpickling calls: ``torch.load`` with ``weights_only`` off calls
any, and so do DCP's ``FileSystemReader.read_metadata`` (plain ``pickle`` on ``.metadata``) and
its planner's load of each non-tensor entry. A run directory holding a crafted ``meta.pt`` ran
its payload on every rank at ``ckpt_path=auto``, before training. Here:

- :func:`load`: ``meta.pt`` and single-file checkpoints, through torch's weights-only unpickler:
  tensors, numbers, strings, plain containers, torch's dtypes and sizes, and :func:`admitted`'s
  few types on top (paths; OmegaConf's containers, which Lightning stores for hyperparameters given
  as a ``DictConfig``, their nodes holding the same plain values);
- :class:`DataReader`: DCP's ``.metadata`` through :class:`MetadataUnpickler` (DCP's own index
  dataclasses and enums, torch's sizes, dtypes and layouts, paths), and :class:`DataLoadPlanner`:
  DCP's non-tensor entries (optimizer hyperparameters) through :func:`load`;
  :func:`load_dcp` loads with both.

Anything else is refused with a :class:`CheckpointDataError` naming the file and the type.
:func:`to_data` is the save side: hyperparameters become plain containers, and what a save would
write is checked to load back, so a run fails at its first save, not at its resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import io
import pathlib
import pickle
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from lightning_ultrascale.errors import ConfigError

__all__ = [
    "CheckpointDataError",
    "DataLoadPlanner",
    "DataReader",
    "check_weights_only",
    "load",
    "load_dcp",
    "read_metadata",
    "to_data",
]

#: What to do with a checkpoint refused for holding something else, as docs/checkpoints.md says it.
CONVERT = (
    "if you trust the file, convert it once in Python: torch.load it with weights_only off, replace that object by "
    "plain data (numbers, strings, lists, dicts, tensors) and torch.save the result "
    "(docs/checkpoints.md: Checkpoints are data)"
)

#: The classes of DCP's index: its modules' dataclasses and enums (data; their constructors only store fields).
_INDEX_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_PATHS = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")


class CheckpointDataError(ConfigError):
    """A checkpoint file holds something other than data: ``.../meta.pt holds posix.system, which ...``.

    ``file``: the file (or entry) as named; ``what``: the type's dotted name, or torch's reason.
    """

    def __init__(self, file: object, what: str, fix: str = CONVERT) -> None:
        super().__init__(
            f"checkpoint {file} holds {what}, which a checkpoint may not hold: a checkpoint is loaded as data "
            f"(tensors, numbers, strings, plain containers), nothing in it runs, so it was not loaded; {fix}"
        )
        self.file, self.what, self.fix = file, what, fix

    def __reduce__(self) -> tuple[Any, ...]:  # DCP gathers every rank's exceptions (pickled) before raising
        return type(self), (self.file, self.what, self.fix)


@functools.cache
def admitted() -> tuple[Any, ...]:
    """What :func:`load` admits beyond torch's weights-only defaults, each safe to construct from a file.

    Paths are built from strings. OmegaConf's containers store plain values in their nodes;
    ``defaultdict`` and the builtin types are what their metadata names (a node's type, a
    ``defaultdict`` of flags), callable only as ``int(...)`` or ``list(...)``.
    """
    import collections
    import typing

    paths = tuple(getattr(pathlib, name) for name in _PATHS)
    plain = (collections.defaultdict, typing.Any, dict, list, int, float, str, bool)
    try:
        from omegaconf import DictConfig, ListConfig, base, nodes
    except ImportError:  # (the library without its CLI): then no file of this install holds them
        return (*paths, *plain)
    node_types = (nodes.AnyNode, nodes.StringNode, nodes.IntegerNode, nodes.FloatNode, nodes.BooleanNode)
    return (*paths, *plain, DictConfig, ListConfig, base.ContainerMetadata, base.Metadata, *node_types, nodes.PathNode)


def _what(err: Exception, source: str | Path | IO[bytes]) -> str:
    """The globals ``source`` names that are not admitted (inside :func:`data_only`), else torch's reason."""
    try:
        if not isinstance(source, (str, Path)):
            source.seek(0)
        found = torch.serialization.get_unsafe_globals_in_checkpoint(source)
    except Exception:  # not torch.save's zip format: torch's message says what it met
        found = []
    reason = str(err).split("WeightsUnpickler error:", 1)[-1].strip().splitlines()
    return ", ".join(found) or (reason[0] if reason else type(err).__name__)


@contextlib.contextmanager
def data_only(source: str | Path | IO[bytes], name: object = None) -> Iterator[None]:
    """Inside: ``torch.load(source, weights_only=True)`` admits :func:`admitted` too; a refusal names ``name``.

    ``name``: how errors name ``source`` (default: ``source``, a path). For a loader that calls
    ``torch.load`` itself (Lightning's own, for a tensor-parallel model) as for :func:`load`.
    """
    with torch.serialization.safe_globals(list(admitted())):
        try:
            yield
        except pickle.UnpicklingError as err:
            raise CheckpointDataError(source if name is None else name, _what(err, source)) from None


def check_weights_only(weights_only: bool | None, where: str) -> None:
    """Refuse Lightning's ``weights_only`` argument set false for ``where``: a load that may run the file's code."""
    if weights_only is False:
        raise ConfigError(
            f"{where} with weights_only={weights_only}: UltraScaleStrategy loads every checkpoint as data only "
            f"(leave weights_only unset); for a checkpoint that holds other objects, {CONVERT}"
        )


def load(
    source: str | Path | IO[bytes], name: object = None, mmap: bool = False, map_location: str | None = "cpu"
) -> Any:
    """The contents of a ``torch.save`` file (``meta.pt``, a single-file checkpoint), as data only.

    ``name``: how an error names ``source`` (default: ``source`` itself, a path). ``mmap`` and
    ``map_location``: as ``torch.load``'s.

    Raises:
        CheckpointDataError: the file holds an object of a type outside the admitted ones.
    """
    with data_only(source, name):
        return torch.load(source, map_location=map_location, weights_only=True, mmap=mmap)


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``, finding only the classes of DCP's index (else a refusal naming ``file``)."""

    def __init__(self, stream: IO[bytes], file: object) -> None:
        super().__init__(stream)
        self.file = file

    def find_class(self, module: str, name: str) -> Any:
        found = _index_class(module, name)
        if found is None:
            raise CheckpointDataError(self.file, f"{module}.{name}", "a .metadata holds DCP's index only; " + CONVERT)
        return found


def _index_class(module: str, name: str) -> Any:
    """``module.name`` if DCP's index may hold it, else None; looked up, never imported."""
    if module in _INDEX_MODULES:
        value = getattr(sys.modules[module], name, None)
        is_data = isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))
        return value if is_data and value.__module__ == module else None
    if module == "torch":
        value = getattr(torch, name, None)
        return value if value is torch.Size or isinstance(value, torch.dtype) else None
    if (module, name) == ("torch.serialization", "_get_layout"):  # a layout by its name (torch.strided)
        return torch.serialization._get_layout
    if module in ("pathlib", "pathlib._local") and name in _PATHS:  # StorageMeta.checkpoint_id
        return getattr(pathlib, name)
    return None


def read_metadata(path: str | Path, rank: int | None = None) -> Metadata:
    """DCP's index of the checkpoint directory ``path`` (``.metadata``), read as data."""
    file = Path(path) / (".metadata" if rank is None else f"__{rank}.metadata")
    with open(file, "rb") as stream:
        metadata = MetadataUnpickler(stream, file).load()
    if not isinstance(metadata, Metadata):
        raise CheckpointDataError(file, type(metadata).__name__, "a .metadata holds DCP's Metadata; " + CONVERT)
    return metadata


class DataReader(FileSystemReader):
    """DCP's file-system reader with the index read by :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.path, kwargs.get("rank"))
        if metadata.storage_meta is None:  # (as FileSystemReader does)
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class DataLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with each non-tensor entry read by :func:`load` (DCP's: any pickle).

    ``path``: the checkpoint directory, which errors name with the entry's shard file.
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        shard = self.metadata.storage_data[read_item.storage_index].relative_path  # type: ignore[union-attr]
        loaded = load(value, name=f"{self.path / shard} (entry {fqn})")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load_dcp(state: dict[str, Any], path: str | Path) -> None:
    """``torch.distributed.checkpoint.load(state, checkpoint_id=path)``, reading index and entries as data."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp_load(state, storage_reader=DataReader(path), planner=DataLoadPlanner(path))
    except CheckpointException as err:  # DCP wraps what any rank raised: a refusal is the error to show
        refused = [e for e, _ in err.failures.values() if isinstance(e, CheckpointDataError)]
        if refused:
            raise refused[0] from None
        raise


def _plain(value: Any) -> Any:
    """``value`` with OmegaConf containers and mapping subclasses (Lightning's ``AttributeDict``) made plain."""
    if type(value).__module__ in ("omegaconf.dictconfig", "omegaconf.listconfig"):  # (omegaconf is installed then)
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        try:
            return OmegaConf.to_container(value, resolve=True)
        except OmegaConfBaseException:  # an interpolation that does not resolve: kept as written
            return OmegaConf.to_container(value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    return value


#: Lightning's entries for a module's and a datamodule's hyperparameters.
HYPERPARAMETERS = ("hyper_parameters", "datamodule_hyper_parameters")
#: Lightning's entries for the weights and optimizer states of a single-file checkpoint: tensors and torch's formats.
WEIGHTS = ("state_dict", "optimizer_states")


def to_data(meta: dict[str, Any], path: object) -> None:
    """Before ``meta`` is saved to ``path`` (every rank): hyperparameters made plain, the rest checked to load back.

    A save of something :func:`load` refuses (a callback's or the user's object) fails now, naming
    it, rather than the resume that needs the checkpoint. Its tensors are serialized once more.
    """
    for key in HYPERPARAMETERS:
        if key in meta:
            meta[key] = _plain(meta[key])
    buffer = io.BytesIO()
    torch.save({k: v for k, v in meta.items() if k not in WEIGHTS}, buffer)
    buffer.seek(0)
    try:
        load(buffer, name=f"being saved to {path}")
    except CheckpointDataError as err:
        fix = "save plain data instead (what state_dict and on_save_checkpoint return: numbers, strings, tensors)"
        raise CheckpointDataError(err.file, err.what, fix) from None
