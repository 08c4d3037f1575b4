"""The one DeviceMesh of a run, with the named (and flattened) sub-meshes the plugins use.

Every dim of :data:`~lightning_ultrascale.parallel.dims.MESH_DIMS` is present even at size 1, so a
plugin can always ask for ``mesh["tp"]`` without knowing which other techniques are on. Two
flattened dims are added, as torchtitan does:

- ``dp``: ``dp_replicate x dp_shard``, the ranks that read different samples (the sampler's view);
- ``dp_cp``: ``dp_replicate x dp_shard x cp``, the ranks that reduce gradients together (context
  parallel ranks hold different tokens of the same samples, so their gradients add up too);
- ``dp_shard_cp``: ``dp_shard x cp``, the ranks FSDP shards over (cp ranks join the sharding, as
  in torchtitan, so that their gradients are reduced with the others').

torch deprecates slicing flattened dims back out of the root mesh ("users need to bookkeep the
flattened mesh directly"), so :class:`ParallelMesh` keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_ultrascale.parallel.dims import DATA_DIMS, MESH_DIMS, ParallelDims

FLAT_DIMS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": DATA_DIMS,
    "dp_shard_cp": ("dp_shard", "cp"),
}


@dataclass(frozen=True)
class ParallelMesh:
    """The ``(pp, dp_replicate, dp_shard, cp, tp)`` mesh plus its flattened ``dp`` and ``dp_cp`` views.

    Example:
        >>> mesh = build_mesh(ParallelDims(dp_replicate=2), "cpu")  # doctest: +SKIP
        >>> mesh["dp"].size(), mesh["tp"].size()  # doctest: +SKIP
        (2, 1)
    """

    dims: ParallelDims
    root: DeviceMesh
    flat: dict[str, DeviceMesh] = field(default_factory=dict)

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(name, str) and name in self.flat:
            return self.flat[name]
        return self.root[name]

    def names(self) -> dict[str, DeviceMesh]:
        """Every named 1-D mesh, for mapping a process group back to its dim."""
        return {**{d: self.root[d] for d in MESH_DIMS}, **self.flat}


def build_mesh(dims: ParallelDims, device_type: str) -> ParallelMesh:
    """Create the run's mesh over the default process group (which must exist)."""
    root = init_device_mesh(device_type, dims.shape, mesh_dim_names=MESH_DIMS)
    flat = {name: root[sub]._flatten(name) for name, sub in FLAT_DIMS.items()}
    return ParallelMesh(dims, root, flat)
