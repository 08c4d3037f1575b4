"""Per-rank parameter shards: predicted by the plugins' pure rules, and measured by a dry run."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch.distributed as dist
from torch import nn

from lightning_ultrascale.core.strategy import UltraScaleStrategy
from lightning_ultrascale.parallel.dims import MESH_DIMS
from lightning_ultrascale.parallel.layout import Layout, ShardPlan
from lightning_ultrascale.parallel.mesh import build_mesh
from lightning_ultrascale.parallel.plugin import apply_all
from lightning_ultrascale.utils.memo import memoized
from lightning_ultrascale.utils.tensors import local_tensor

__all__ = ["dry_run", "predict_shards"]

# Path components that wrappers (activation checkpointing, torch.compile) insert into names.
_WRAPPERS = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})


def predict_shards(strategy: UltraScaleStrategy, model: nn.Module, world_size: int, rank: int) -> ShardPlan:
    """Each parameter ``rank`` would hold and its local shape, from the plugins' rules (no processes).

    ``model``: the whole model on the meta device (it is not modified).
    """
    dims = strategy.resolve_dims(world_size)
    dims.validate(world_size)
    whole = memoized(("shapes", id(model)), lambda: {n: tuple(p.shape) for n, p in model.named_parameters()})
    sizes = {d: getattr(dims, d) for d in MESH_DIMS}
    plan = ShardPlan(coordinate=dims.coordinate(rank), sizes=sizes, shapes=dict(whole), whole=whole)
    for plugin in strategy.applied_plugins():
        if plugin.active:
            plugin.plan_shards(model, plan)
    return plan


def dry_run(
    make_strategy: Callable[[], UltraScaleStrategy], make_model: Callable[[], nn.Module], world_size: int, rank: int
) -> dict[str, tuple[int, ...]]:
    """What ``rank`` of a ``world_size`` job really holds: the real plugins applied to a meta model.

    A forked process plays ``rank`` under torch's ``fake`` process-group backend (collectives do
    nothing, so no values are computed: shapes only). The strategy validates first, as a run would.
    Forked because process groups and device meshes leave registries behind in their process,
    which a later real run there would trip over; the caller's process stays as it was.
    """
    context = mp.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_dry_run_child, args=(send, make_strategy, make_model, world_size, rank))
    child.start()
    send.close()
    try:
        if not receive.poll(_DRY_RUN_TIMEOUT_S):
            raise RuntimeError(f"the dry run of rank {rank} of {world_size} took over {_DRY_RUN_TIMEOUT_S} s")
        ok, result = receive.recv()
    except EOFError:
        raise RuntimeError(f"the dry run of rank {rank} of {world_size} died (exit code {child.exitcode})") from None
    finally:
        child.join(timeout=5)
        if child.is_alive():
            child.kill()
    if not ok:
        raise result
    return dict(result)


_DRY_RUN_TIMEOUT_S = 600


def _dry_run_child(
    send: Connection,
    make_strategy: Callable[[], UltraScaleStrategy],
    make_model: Callable[[], nn.Module],
    world_size: int,
    rank: int,
) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    try:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            strategy, model = make_strategy(), make_model()
            strategy.validate(model.spec, world_size=world_size)  # type: ignore[arg-type]
            dims = strategy.parallel_dims
            layout = Layout(dims, build_mesh(dims, "cpu"))
            model = apply_all(strategy.applied_plugins(), model, layout)
            shapes = {_plain_name(name): tuple(local_tensor(p).shape) for name, p in model.named_parameters()}
        finally:
            dist.destroy_process_group()
        send.send((True, shapes))
    except Exception as err:  # the error travels to the caller, whatever rank it names
        try:
            send.send((False, err))
        except Exception:
            send.send((False, RuntimeError(traceback.format_exc())))
    finally:
        send.close()


def _plain_name(name: str) -> str:
    return ".".join(c for c in name.split(".") if c not in _WRAPPERS)
