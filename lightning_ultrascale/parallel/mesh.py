"""The one DeviceMesh of a run, with the named and flattened sub-meshes the plugins use.

Every dim of :data:`~lightning_ultrascale.parallel.dims.MESH_DIMS` is present even at size 1, so a
plugin can always ask for ``mesh["tp"]`` without knowing which other techniques are on. Three
flattened dims exist from the start, as in torchtitan:

- ``dp``: ``dp_replicate x dp_shard``, the ranks that read different samples (the sampler's view);
- ``dp_cp``: ``dp_replicate x dp_shard x cp``, the ranks that reduce gradients together (context
  parallel ranks hold different tokens of the same samples, so their gradients add up too);
- ``dp_shard_cp``: ``dp_shard x cp``, the ranks FSDP shards over (cp ranks join the sharding, as
  in torchtitan, so that their gradients are reduced with the others').

:meth:`ParallelMesh.over` flattens any other run of neighbouring dims on demand (a parameter group
that reduces over its own ranks), and :meth:`ParallelMesh.add` names a mesh a plugin built itself.
torch deprecates slicing flattened dims back out of the root mesh ("users need to bookkeep the
flattened mesh directly"), so :class:`ParallelMesh` keeps them.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_ultrascale.parallel.dims import DATA_DIMS, MESH_DIMS, ParallelDims

FLAT_DIMS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_cp": DATA_DIMS,
    "dp_shard_cp": ("dp_shard", "cp"),
}


class ParallelMesh:
    """The ``(pp, dp_replicate, dp_shard, cp, tp)`` mesh plus its flattened views.

    Example:
        >>> mesh = build_mesh(ParallelDims(dp_replicate=2), "cpu")  # doctest: +SKIP
        >>> mesh["dp"].size(), mesh["tp"].size(), mesh.over(("dp_shard", "cp", "tp")).size()  # doctest: +SKIP
        (2, 1, 1)
    """

    def __init__(self, dims: ParallelDims, root: DeviceMesh) -> None:
        self.dims = dims
        self.root = root
        self.flat: dict[str, DeviceMesh] = {}
        self._by_dims: dict[tuple[str, ...], str] = {}
        for name, sub in FLAT_DIMS.items():
            self._flatten(name, sub)

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(name, str) and name in self.flat:
            return self.flat[name]
        return self.root[name]

    def over(self, dims: tuple[str, ...]) -> DeviceMesh:
        """The 1-D mesh over the ranks of ``dims`` (neighbouring dims of the root mesh, in its order).

        Collective the first time (it creates a process group): every rank must ask for the same
        dims in the same order, as plugins applied in the strategy's fixed order do.
        """
        if len(dims) == 1:
            return self[dims[0]]
        if dims not in self._by_dims:
            self._flatten("_".join(dims), dims)
        return self.flat[self._by_dims[dims]]

    def add(self, name: str, mesh: DeviceMesh) -> None:
        """Name a mesh a plugin built (e.g. experts' own data-parallel ranks) for the plugins after it."""
        if name in self.flat or name in MESH_DIMS:
            raise ValueError(f"a mesh named {name!r} already exists")
        self.flat[name] = mesh

    def _flatten(self, name: str, dims: tuple[str, ...]) -> None:
        self.flat[name] = self.root[dims]._flatten(name)
        self._by_dims[dims] = name


def build_mesh(dims: ParallelDims, device_type: str) -> ParallelMesh:
    """Create the run's mesh over the default process group (which must exist)."""
    return ParallelMesh(dims, init_device_mesh(device_type, dims.shape, mesh_dim_names=MESH_DIMS))
