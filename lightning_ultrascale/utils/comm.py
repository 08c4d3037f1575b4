"""Count the bytes every collective moves, per mesh dimension: the playbook's comm tables, measured.

:class:`CommTracer` is a ``TorchDispatchMode``: every collective in PyTorch, whoever issues it,
ends up as one dispatcher op, either a ``torch.ops.c10d.*`` op (``torch.distributed.all_reduce``
and friends, which FSDP2's all-gather and reduce-scatter use) or a
``torch.ops._c10d_functional*`` op (the functional collectives that DTensor redistributions
issue). A dispatch mode sees both. Its stack is thread-local state that the autograd engine copies
into the thread running a backward pass (``at::ThreadLocalState``), so collectives launched from
gradient hooks are seen as well; collectives issued from threads *you* start are not.

Payload is what the collective is handed (all-reduce: the tensor; all-gather: the gathered output;
reduce-scatter and all-to-all: the input; send/recv: the tensor). Wire bytes are what one rank
sends in the bandwidth-optimal ring algorithm (the playbook's "A1: Distributed Training Basics"):
all-reduce ``2(n-1)/n`` of the payload, all-gather, reduce-scatter and all-to-all ``(n-1)/n``,
broadcast, reduce and point-to-point the payload itself.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ultrascale.utils.memory import format_bytes

__all__ = ["CommRecord", "CommTracer", "collective_device", "max_rows", "sum_rows", "wire_bytes"]


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a tensor handed to a collective on ``group`` must live on: CUDA under NCCL, else the CPU.

    NCCL serves CUDA tensors only ("No backend type associated with device type cpu"), gloo both;
    so a tensor built without a device works on every CPU test and fails on the first GPU run.
    Build every tensor that enters a collective here (or from a tensor already on that device).

    Example:
        >>> collective_device()  # no process group: the CPU
        device(type='cpu')
    """
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: Index tensors of groups' global ranks, by ranks and device: built once (a host-to-device copy waits).
_RANKS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def sum_rows(rows: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum of ``rows`` over the ranks of ``group`` (global ranks index the rows), on their device.

    Example:
        >>> sum_rows(torch.tensor([[1.0, 2.0]]), None).tolist()
        [1.0, 2.0]
    """
    return _rows_of(rows, group).sum(dim=0)


def max_rows(rows: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The element-wise maximum of ``rows`` over the ranks of ``group`` (global ranks index the rows).

    Example:
        >>> max_rows(torch.tensor([[1.0, 5.0], [3.0, 2.0]]), None).tolist()
        [3.0, 5.0]
    """
    return _rows_of(rows, group).amax(dim=0)


def _rows_of(rows: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is None or not dist.is_initialized():
        return rows
    key = (tuple(dist.get_process_group_ranks(group)), rows.device)
    if key not in _RANKS:
        _RANKS[key] = torch.tensor(key[0], dtype=torch.long, device=rows.device)
    return rows.index_select(0, _RANKS[key])


@dataclass(frozen=True)
class CommRecord:
    """One collective call on this rank.

    ``op`` is the playbook's name ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
    "broadcast", "reduce", "gather", "scatter", "send", "recv", "barrier"); ``dim`` the mesh
    dimension whose group it ran on ("world" for the default group, "other" for any other group);
    ``torch_op`` the dispatcher op that carried it, e.g. ``"c10d.allreduce_"``; ``launch`` the call of
    ``torch.distributed.batch_isend_irecv`` that issued it (its sends and receives run as one launch, paying
    one latency), ``None`` for a collective issued alone.
    """

    op: str
    dim: str
    group_name: str
    group_size: int
    payload_bytes: int
    wire_bytes: int
    torch_op: str
    launch: int | None = None


def wire_bytes(op: str, payload_bytes: int, group_size: int) -> int:
    """Bytes one rank sends for ``op`` on ``group_size`` ranks with the ring algorithm.

    Example:
        >>> wire_bytes("all_reduce", 1000, 4)   # 2 (n-1)/n: reduce-scatter then all-gather
        1500
        >>> wire_bytes("all_gather", 1000, 4)
        750
    """
    if op in ("send", "recv"):
        return payload_bytes
    n = group_size
    if n <= 1 or op == "barrier":
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * payload_bytes // n
    if op in ("broadcast", "reduce"):
        return payload_bytes
    # all_gather, reduce_scatter, all_to_all, gather, scatter: each rank moves all but its own 1/n.
    return (n - 1) * payload_bytes // n


def _nbytes(tensors: Any) -> int:
    """Bytes of a tensor or of a (nested) list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _process_group(group: Any) -> dist.ProcessGroup:
    # c10d ops receive the group boxed as a TorchScript object, functional ops receive its name.
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group)
    if isinstance(group, torch.ScriptObject):
        return dist.ProcessGroup.unbox(group)
    return group


@dataclass(frozen=True)
class _Collective:
    """Where a dispatcher op keeps its payload and group (see ``func._schema``).

    Gathers size their payload as the per-rank piece times the group size, because the full
    list (or the output of a functional all-gather) only exists after the call or on the root.
    """

    op: str
    payload_arg: int
    group_arg: int
    times_group: bool = False


#: Every collective op we can see, by (namespace, name). Torch adds ops between releases (the functional
#: ``isend``/``irecv`` are newer than torch 2.11), so only those this torch has are looked up.
_COLLECTIVE_OPS: dict[tuple[str, str], _Collective] = {
    ("c10d", "allreduce_"): _Collective("all_reduce", 0, 1),
    ("c10d", "allreduce_coalesced_"): _Collective("all_reduce", 0, 1),
    ("c10d", "allgather_"): _Collective("all_gather", 0, 2),
    ("c10d", "_allgather_base_"): _Collective("all_gather", 0, 2),
    ("c10d", "allgather_coalesced_"): _Collective("all_gather", 0, 2),
    ("c10d", "allgather_into_tensor_coalesced_"): _Collective("all_gather", 0, 2),
    ("c10d", "reduce_scatter_"): _Collective("reduce_scatter", 1, 2),
    ("c10d", "_reduce_scatter_base_"): _Collective("reduce_scatter", 1, 2),
    ("c10d", "reduce_scatter_tensor_coalesced_"): _Collective("reduce_scatter", 1, 2),
    ("c10d", "alltoall_"): _Collective("all_to_all", 1, 2),
    ("c10d", "alltoall_base_"): _Collective("all_to_all", 1, 2),
    ("c10d", "broadcast_"): _Collective("broadcast", 0, 1),
    ("c10d", "reduce_"): _Collective("reduce", 0, 1),
    ("c10d", "gather_"): _Collective("gather", 1, 2, times_group=True),
    ("c10d", "scatter_"): _Collective("scatter", 0, 2, times_group=True),
    ("c10d", "send"): _Collective("send", 0, 1),
    ("c10d", "recv_"): _Collective("recv", 0, 1),
    ("c10d", "recv_any_source_"): _Collective("recv", 0, 1),
    ("c10d", "barrier"): _Collective("barrier", 0, 1),
    ("c10d", "monitored_barrier_"): _Collective("barrier", 0, 1),
    ("_c10d_functional", "all_reduce"): _Collective("all_reduce", 0, 2),
    ("_c10d_functional", "all_reduce_"): _Collective("all_reduce", 0, 2),
    ("_c10d_functional", "all_reduce_coalesced"): _Collective("all_reduce", 0, 2),
    ("_c10d_functional", "all_reduce_coalesced_"): _Collective("all_reduce", 0, 2),
    ("_c10d_functional", "all_gather_into_tensor"): _Collective("all_gather", 0, 2, times_group=True),
    ("_c10d_functional", "all_gather_into_tensor_out"): _Collective("all_gather", 0, 2, times_group=True),
    ("_c10d_functional", "all_gather_into_tensor_coalesced"): _Collective("all_gather", 0, 2, times_group=True),
    ("_c10d_functional", "reduce_scatter_tensor"): _Collective("reduce_scatter", 0, 3),
    ("_c10d_functional", "reduce_scatter_tensor_out"): _Collective("reduce_scatter", 0, 3),
    ("_c10d_functional", "reduce_scatter_tensor_coalesced"): _Collective("reduce_scatter", 0, 3),
    ("_c10d_functional", "all_to_all_single"): _Collective("all_to_all", 0, 3),
    ("_c10d_functional", "broadcast"): _Collective("broadcast", 0, 2),
    ("_c10d_functional", "broadcast_"): _Collective("broadcast", 0, 2),
    ("_c10d_functional", "isend"): _Collective("send", 0, 3),
    ("_c10d_functional", "irecv"): _Collective("recv", 0, 3),
    ("_c10d_functional_autograd", "all_to_all_single"): _Collective("all_to_all", 0, 3),
    ("_c10d_functional_autograd", "reduce_scatter_tensor"): _Collective("reduce_scatter", 0, 3),
    ("_c10d_functional_autograd", "all_gather_into_tensor"): _Collective("all_gather", 0, 2, times_group=True),
}
_COLLECTIVES: dict[Any, _Collective] = {
    getattr(getattr(torch.ops, namespace), name): collective
    for (namespace, name), collective in _COLLECTIVE_OPS.items()
    if hasattr(getattr(torch.ops, namespace), name)
}


def _is_subclass_needing_dispatch(t: type) -> bool:
    # A tensor subclass (DTensor, float8 tensors) must run its own __torch_dispatch__ first so that
    # it desugars into plain-tensor collectives we can see. nn.Parameter also appears in `types`
    # but only carries the disabled implementation: deferring to it would hide its collectives.
    # FakeTensor is the exception: DTensor's sharding propagation runs ops on fake tensors under
    # this mode, and deferring to them makes that propagation fail; they never communicate.
    if issubclass(t, FakeTensor):
        return False
    impl = getattr(t, "__torch_dispatch__", None)
    return t is not torch.Tensor and impl is not None and impl is not torch._C._disabled_torch_dispatch_impl


class CommTracer(TorchDispatchMode):
    """Record every collective this rank issues while active, with bytes, grouped by mesh dim.

    Args:
        mesh: names the process groups: a call on ``mesh.get_group("tp")`` is filed under "tp",
            one on a flattened dim (``mesh["dp_replicate", "dp_shard"]._flatten("dp")``) under
            "dp". Without a mesh, or for groups the mesh does not own, calls are filed under
            "world" (the default group) or "other". When several dims share one group (a size-1
            neighbour can make a flattened dim equal a real one), the real dim's name wins; a dim
            spanning all ranks may reuse the default group, and then takes "world"'s calls too.

    Every op dispatched while the tracer is active passes through Python, a few microseconds
    each: trace a handful of steps, not a whole run. Collectives inside ``torch.compile``d
    regions have not been checked.

    Example:
        >>> with CommTracer(mesh) as tracer:                                  # doctest: +SKIP
        ...     loss = model(batch).sum(); loss.backward()
        >>> tracer.total("all_gather", dim="dp_shard")                        # doctest: +SKIP
        4194304
        >>> print(tracer.table())                                             # doctest: +SKIP
    """

    def __init__(self, mesh: DeviceMesh | None = None) -> None:
        super().__init__()
        self.mesh = mesh
        self.records: list[CommRecord] = []
        self._dim_by_group: dict[str, str] = {}
        self._depth, self._launches, self._launch = 0, 0, None  # (batch_isend_irecv's calls, see launches())
        self._batch_isend_irecv: Any = None

    def __enter__(self) -> CommTracer:
        # (re-entered around our custom ops' bodies: the wrapper goes in once, on the outermost entry)
        if self._depth == 0:
            self._batch_isend_irecv = dist.batch_isend_irecv
            dist.batch_isend_irecv = self._batched
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            dist.batch_isend_irecv = self._batch_isend_irecv
        return super().__exit__(*exc)

    def _batched(self, p2p_op_list: list[dist.P2POp]) -> Any:
        self._launches += 1
        self._launch = self._launches
        try:
            return self._batch_isend_irecv(p2p_op_list)
        finally:
            self._launch = None

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(_is_subclass_needing_dispatch(t) for t in types):
            return NotImplemented
        spec = _COLLECTIVES.get(func._overloadpacket)
        if spec is not None:
            self._record(spec, func, args, kwargs)
        if func.namespace == "ultrascale":
            # Our custom ops (ring attention) communicate inside; a mode is off while it runs an
            # op, so it runs their Python body itself, watching the collectives in it.
            from torch._library.custom_ops import _maybe_get_opdef

            opdef = _maybe_get_opdef(func)
            if opdef is not None:
                with self:
                    return opdef._init_fn(*args, **kwargs)
        return func(*args, **kwargs)

    def _record(self, spec: _Collective, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # Some callers pass schema arguments by keyword; look them up by position in the schema.
        def arg(i: int) -> Any:
            return args[i] if i < len(args) else kwargs[func._schema.arguments[i].name]

        pg = _process_group(arg(spec.group_arg))
        size = pg.size()
        payload = 0 if spec.op == "barrier" else _nbytes(arg(spec.payload_arg))
        if spec.times_group:
            payload *= size
        self.records.append(
            CommRecord(
                op=spec.op,
                dim=self._dim_of(pg.group_name),
                group_name=pg.group_name,
                group_size=size,
                payload_bytes=payload,
                wire_bytes=wire_bytes(spec.op, payload, size),
                torch_op=str(func._overloadpacket).removeprefix("_ops."),
                launch=self._launch,
            )
        )

    def _dim_of(self, group_name: str) -> str:
        if group_name not in self._dim_by_group:
            # Rebuilt on a miss: flattened dims may be created after the tracer was.
            self._dim_by_group = self._group_names_to_dims()
            self._dim_by_group.setdefault(group_name, "other")
        return self._dim_by_group[group_name]

    def _group_names_to_dims(self) -> dict[str, str]:
        names: dict[str, str] = {}
        if self.mesh is not None:
            root = self.mesh._get_root_mesh()
            meshes = [root, self.mesh, *root._flatten_mapping.values()]
            for m in meshes:
                for dim in m.mesh_dim_names or ():
                    names.setdefault(m.get_group(dim).group_name, dim)
        if dist.is_initialized():
            names.setdefault(dist.distributed_c10d._get_default_group().group_name, "world")
        return names

    def launches(self, min_bytes: int = 0) -> dict[str, int]:
        """Launches per ``"dim:op"`` of records over ``min_bytes`` (and every all-to-all's: the split sizes of a
        dispatch are its own call): a collective one each, the sends (or receives) of one
        ``batch_isend_irecv`` one together. Each pays a collective's latency once.

        Example:
            >>> tracer = CommTracer()
            >>> kv = [CommRecord("send", "cp", "1", 2, 2**20, 2**20, "c10d.send", launch=1) for _ in "kv"]
            >>> tracer.records += [*kv, CommRecord("all_gather", "tp", "2", 2, 2**20, 2**19, "c10d.allgather_")]
            >>> tracer.launches()  # (K and V sent in one batch_isend_irecv)
            {'cp:send': 1, 'tp:all_gather': 1}
        """
        seen: set[tuple[str, int]] = set()
        out: dict[str, int] = {}
        for r in list(self.records):
            key = f"{r.dim}:{r.op}"
            small = r.payload_bytes <= min_bytes and r.op != "all_to_all"
            if small or (r.launch is not None and (key, r.launch) in seen):
                continue
            if r.launch is not None:
                seen.add((key, r.launch))
            out[key] = out.get(key, 0) + 1
        return out

    def summary(self) -> dict[str, dict[str, dict[str, int]]]:
        """Totals as ``{dim: {op: {"calls", "payload_bytes", "wire_bytes"}}}``.

        Example:
            >>> tracer.summary()["tp"]["all_gather"]                          # doctest: +SKIP
            {'calls': 4, 'payload_bytes': 65536, 'wire_bytes': 32768}
        """
        out: dict[str, dict[str, dict[str, int]]] = defaultdict(
            lambda: defaultdict(lambda: {"calls": 0, "payload_bytes": 0, "wire_bytes": 0})
        )
        for r in list(self.records):
            row = out[r.dim][r.op]
            row["calls"] += 1
            row["payload_bytes"] += r.payload_bytes
            row["wire_bytes"] += r.wire_bytes
        return {dim: dict(ops) for dim, ops in out.items()}

    def total(self, op: str | None = None, dim: str | None = None, kind: Literal["payload", "wire"] = "payload") -> int:
        """Sum of payload (or wire) bytes, optionally for one op and/or one mesh dim.

        Example:
            >>> tracer.total("all_reduce", dim="dp_replicate", kind="wire")  # doctest: +SKIP
            2097152
        """
        if kind not in ("payload", "wire"):
            raise ValueError(f"kind={kind!r} must be 'payload' or 'wire'")
        field = "payload_bytes" if kind == "payload" else "wire_bytes"
        return sum(
            getattr(r, field)
            for r in list(self.records)
            if (op is None or r.op == op) and (dim is None or r.dim == dim)
        )

    def table(self) -> str:
        """A small table, one row per (dim, op).

        Example:
            >>> print(tracer.table())                                         # doctest: +SKIP
            dim       op              calls    payload       wire
            dp_shard  all_gather          8  12.0 MiB    6.0 MiB
            dp_shard  reduce_scatter      4   6.0 MiB    3.0 MiB
        """
        header = ("dim", "op", "calls", "payload", "wire")
        rows = [
            (dim, op, str(v["calls"]), format_bytes(v["payload_bytes"]), format_bytes(v["wire_bytes"]))
            for dim, ops in sorted(self.summary().items())
            for op, v in sorted(ops.items())
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [
            "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in [header, *rows]
        ]
        return "\n".join(lines)
