"""Sizes of the parallel dimensions and everything that can be checked about them without processes.

The mesh is ``(pp, dp_replicate, dp_shard, cp, tp)``, row-major, so ``tp`` peers are neighbouring
ranks (inside a node, as the playbook advises) and ``pp`` stages are the farthest apart. Expert
parallelism borrows its ranks from the data-parallel ones, ``dp_replicate x dp_shard x cp`` (torchtitan
borrows ``dp_shard x cp``), and adds no dimension.

Everything here is pure Python: it runs before any process group exists, so a bad layout fails
in seconds with a message that names the option, its value and what would be valid.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

from lightning_ultrascale.errors import ConfigError, divisors, is_positive_int, option
from lightning_ultrascale.models.spec import ModelSpec

MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: The dims whose ranks hold different samples (or sequence chunks) and so reduce gradients.
DATA_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard", "cp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism of one run.

    ``sources`` says which setting gave each dim its size (``{"tp": ("TensorParallel", "size")}``),
    so that errors name that setting; a dim without one is named ``parallel.<dim>``.

    Example:
        >>> dims = ParallelDims(dp_replicate=2, tp=2)
        >>> dims.validate(world_size=4)
        >>> dims.dp, dims.coordinate(3)
        (2, {'pp': 0, 'dp_replicate': 1, 'dp_shard': 0, 'cp': 0, 'tp': 1})
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    sources: Mapping[str, tuple[str, str]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            size = getattr(self, f.name)
            if f.name != "sources" and not is_positive_int(size):
                raise ConfigError(f"{self.option(f.name, size)} must be a positive integer")

    def option(self, dim: str, value: object = None) -> str:
        """The setting behind ``dim`` as errors name it (``TensorParallel(size=3)``, or ``parallel.tp=3``)."""
        value = getattr(self, dim) if value is None else value
        if dim in self.sources:
            return option(*self.sources[dim], value)
        return f"parallel.{dim}={value!r}"

    @classmethod
    def infer(
        cls,
        world_size: int,
        infer_dim: str | None = None,
        sources: Mapping[str, tuple[str, str]] | None = None,
        **sizes: int,
    ) -> ParallelDims:
        """Sizes with ``infer_dim`` filled in so that the mesh covers ``world_size`` ranks.

        Example:
            >>> ParallelDims.infer(8, infer_dim="dp_replicate", tp=2).dp_replicate
            4
        """
        if infer_dim is not None:
            if infer_dim not in MESH_DIMS:
                raise ConfigError(f"cannot infer parallel.{infer_dim}; valid: {', '.join(MESH_DIMS)}")
            known = math.prod(sizes.get(d, 1) for d in MESH_DIMS if d != infer_dim)
            if known < 1 or world_size % known:
                given = " x ".join(f"{d}={sizes[d]}" for d in MESH_DIMS if sizes.get(d, 1) > 1 and d != infer_dim)
                source = (sources or {}).get(infer_dim)
                what = option(*source, None) if source else f"parallel.{infer_dim}"
                raise ConfigError(
                    f"world size {world_size} is not divisible by {given or '1'} = {known}, so "
                    f"{what} cannot be inferred; choose sizes whose product divides "
                    f"{world_size} (divisors: {', '.join(map(str, divisors(world_size)))})"
                )
            sizes = {**sizes, infer_dim: world_size // known}
        return cls(**sizes, sources=dict(sources or {}))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in MESH_DIMS)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def dp(self) -> int:
        """Number of distinct data shards: ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        return " x ".join(f"{d}={getattr(self, d)}" for d in MESH_DIMS)

    def validate(self, world_size: int) -> None:
        """Check that the mesh covers exactly ``world_size`` ranks and EP fits inside it."""
        if self.world_size != world_size:
            raise ConfigError(
                f"parallel dims {self.describe()} multiply to {self.world_size}, but the job has "
                f"{world_size} ranks (trainer.devices x trainer.num_nodes); make the product equal "
                f"{world_size}, e.g. leave one data-parallel size unset so it is inferred"
            )
        ep_pool = self.dp * self.cp * self.tp
        if ep_pool % self.ep:
            raise ConfigError(
                f"{self.option('ep')} must divide the data-parallel and tensor-parallel ranks dp_replicate x dp_shard "
                f"x cp x tp = {self.dp_replicate} x {self.dp_shard} x {self.cp} x {self.tp} = {ep_pool} (experts "
                f"borrow those ranks); valid: {', '.join(map(str, divisors(ep_pool)))}"
            )

    def validate_model(self, spec: ModelSpec) -> None:
        """Check the sizes against the model's shape (heads, layers, experts)."""
        for heads, what in ((spec.n_heads, "n_heads"), (spec.n_kv_heads, "n_kv_heads")):
            if heads % self.tp:
                raise ConfigError(
                    f"{self.option('tp')} must divide {what}={heads} of model {spec.name}; "
                    f"valid: {', '.join(map(str, divisors(heads)))}"
                )
        if self.pp > spec.n_layers:
            raise ConfigError(
                f"{self.option('pp')} exceeds n_layers={spec.n_layers} of model {spec.name}; valid: 1..{spec.n_layers}"
            )
        if self.ep > 1 and spec.n_experts % self.ep:
            raise ConfigError(
                f"{self.option('ep')} must divide n_experts={spec.n_experts} of model {spec.name}; "
                f"valid: {', '.join(map(str, divisors(spec.n_experts)))}"
            )
        data = self.dp * self.cp
        if self.ep > 1 and self.tp > 1 and not spec.moe_folds_tp and data % self.ep:
            raise ConfigError(
                f"{self.option('ep')} must divide the data-parallel ranks dp_replicate x dp_shard x cp = "
                f"{self.dp_replicate} x {self.dp_shard} x {self.cp} = {data}: model {spec.name}'s MoE layers route "
                f"the same tokens on every tp rank (no MoE parallel folding), so experts borrow data ranks only; "
                f"valid: {', '.join(map(str, divisors(data)))}"
            )

    def grad_accumulation(self, global_batch_size: int, micro_batch_size: int) -> int:
        """Micro-steps per optimizer step: ``global_batch_size / (micro_batch_size x dp)``.

        Example:
            >>> ParallelDims(dp_replicate=2).grad_accumulation(global_batch_size=8, micro_batch_size=2)
            2
        """
        if micro_batch_size < 1:
            raise ConfigError(f"data.micro_batch_size={micro_batch_size} must be >= 1")
        per_step = micro_batch_size * self.dp
        if global_batch_size < 1 or global_batch_size % per_step:
            raise ConfigError(
                f"data.global_batch_size={global_batch_size} must be a positive multiple of "
                f"data.micro_batch_size x dp = {micro_batch_size} x {self.dp} = {per_step}; "
                f"valid: {per_step}, {2 * per_step}, {3 * per_step}, ..."
            )
        return global_batch_size // per_step

    def coordinate(self, rank: int) -> dict[str, int]:
        """Position of ``rank`` on each mesh dim (the mesh is row-major over :data:`MESH_DIMS`)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        coord: dict[str, int] = {}
        for dim, size in zip(reversed(MESH_DIMS), reversed(self.shape)):
            coord[dim] = rank % size
            rank //= size
        return {d: coord[d] for d in MESH_DIMS}

    def dp_rank(self, rank: int) -> int:
        """Index of the data shard that ``rank`` reads (same for its tp, cp and pp peers)."""
        c = self.coordinate(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]


@dataclass(frozen=True)
class DataShape:
    """The batch each data-parallel rank runs per micro-step, checked against the layout before any process group.

    ``owner`` names the object that set these sizes in errors (the DataModule's class; under the
    CLI its ``data.*`` keys). ``global_batch_size`` is known where the user gives it (the CLI's
    ``data.global_batch_size``); in Python it follows from the Trainer's gradient accumulation.

    Example:
        >>> DataShape(seq_len=250, micro_batch_size=8).option("seq_len")
        'UltraScaleDataModule(seq_len=250)'
    """

    seq_len: int
    micro_batch_size: int
    global_batch_size: int | None = None
    owner: str = "UltraScaleDataModule"
    #: Where the tokens come from and their largest id, where the DataModule tells (checked
    #: against the model's vocabulary).
    source: str | None = None
    max_token_id: int | None = None
    #: The vocabulary the data was tokenized with (a token file's index records it).
    vocab_size: int | None = None
    #: ``fits(dp)`` raises if the data cannot fill one global micro-step of ``dp`` ranks (where the
    #: DataModule can tell: ``check_fits``), so a too-small corpus fails before any process group.
    fits: Callable[[int], object] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def declared_by(cls, datamodule: object) -> DataShape | None:
        """The shape a DataModule declares (``seq_len``, ``micro_batch_size``; ``source``, ``max_token_id``), if any."""
        seq_len, micro = getattr(datamodule, "seq_len", None), getattr(datamodule, "micro_batch_size", None)
        if not (isinstance(seq_len, int) and isinstance(micro, int)):
            return None
        source, max_id = getattr(datamodule, "source", None), getattr(datamodule, "max_token_id", None)
        fits, vocab = getattr(datamodule, "check_fits", None), getattr(datamodule, "vocab_size", None)
        owner = type(datamodule).__name__
        return cls(seq_len, micro, owner=owner, source=source, max_token_id=max_id, vocab_size=vocab, fits=fits)

    def option(self, name: str) -> str:
        return option(self.owner, name, getattr(self, name))

    def validate_vocabulary(self, spec: ModelSpec) -> None:
        """Every token id must index the model's embedding, and the data's tokenizer must fit in it."""
        if self.vocab_size is not None and self.vocab_size > spec.vocab_size:
            raise ConfigError(
                f"{self.option('source')} was tokenized with a vocabulary of {self.vocab_size} ids, more than model "
                f"{spec.name}'s vocab_size={spec.vocab_size}; use a model whose vocabulary holds it "
                f"(model.vocab_size={self.vocab_size}) or tokenize with the model's tokenizer"
            )
        if self.max_token_id is not None and self.max_token_id >= spec.vocab_size:
            raise ConfigError(
                f"{self.option('source')} holds token id {self.max_token_id}, but model {spec.name} has "
                f"vocab_size={spec.vocab_size}; valid ids: 0..{spec.vocab_size - 1} (tokenize with the model's "
                "tokenizer, or choose a model whose vocabulary covers the data)"
            )
