"""CommTracer sees every way a collective is issued and counts its bytes as the playbook does."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_ultrascale.testing import run_workers
from lightning_ultrascale.utils.comm import CommTracer, wire_bytes

FP32 = 4


def _row(calls: int, payload_bytes: int, wire_bytes: int) -> dict[str, int]:
    return {"calls": calls, "payload_bytes": payload_bytes, "wire_bytes": wire_bytes}


def test_ring_wire_bytes_follow_the_playbook_formulas() -> None:
    assert wire_bytes("all_reduce", 4000, 4) == 2 * 3 * 4000 // 4
    assert wire_bytes("all_gather", 4000, 4) == 3 * 4000 // 4
    assert wire_bytes("reduce_scatter", 4000, 4) == 3 * 4000 // 4
    assert wire_bytes("all_to_all", 4000, 4) == 3 * 4000 // 4
    assert wire_bytes("broadcast", 4000, 4) == 4000
    assert wire_bytes("send", 4000, 2) == 4000
    assert wire_bytes("all_reduce", 4000, 1) == 0
    assert wire_bytes("barrier", 0, 4) == 0


def _plain_all_reduce() -> tuple[list, dict, str]:
    before = torch.ones(10)
    dist.all_reduce(before)
    with CommTracer() as tracer:
        dist.all_reduce(torch.ones(1000))
        dist.barrier()
    dist.all_reduce(before)
    return tracer.records, tracer.summary(), tracer.table()


def test_plain_all_reduce_counts_tensor_bytes_and_nothing_outside() -> None:
    records, summary, table = run_workers(_plain_all_reduce, 2)[0]
    assert [(r.op, r.dim, r.group_size) for r in records] == [
        ("all_reduce", "world", 2),
        ("barrier", "world", 2),
    ]
    payload = 1000 * FP32
    assert summary["world"]["all_reduce"] == _row(1, payload, 2 * (2 - 1) * payload // 2)
    assert summary["world"]["barrier"]["payload_bytes"] == 0
    assert "all_reduce" in table and "world" in table


def _all_reduce_from_grad_hook() -> tuple[int, int, int]:
    param = nn.Parameter(torch.ones(256))
    works = []
    # What a bucketed DDP does: launch the gradient's all-reduce as soon as it is accumulated.
    param.register_post_accumulate_grad_hook(lambda p: works.append(dist.all_reduce(p.grad, async_op=True)))
    with CommTracer() as tracer:
        (param * 3).sum().backward()
    for work in works:
        work.wait()
    return len(works), tracer.total("all_reduce"), tracer.total("all_reduce", kind="wire")


def test_async_all_reduce_launched_from_backward_hook_is_recorded() -> None:
    launched, payload, wire = run_workers(_all_reduce_from_grad_hook, 2)[0]
    assert launched == 1
    assert payload == 256 * FP32
    assert wire == 256 * FP32  # 2 (n-1)/n = 1 for n = 2


def _dtensor_redistribute_on_2d_mesh() -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "tp"))
    local = torch.ones(4, 4)
    sharded = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False)
    flat = mesh["dp_replicate", "tp"]._flatten("dp")
    pair = dist.new_group([0, 1])
    with CommTracer(mesh) as tracer:
        sharded.redistribute(mesh, [Replicate(), Replicate()])
        dist.all_reduce(torch.ones(8), group=flat.get_group())
        if dist.get_rank() in (0, 1):
            dist.all_reduce(torch.ones(2), group=pair)
    return tracer.summary()


def test_dtensor_all_gather_is_filed_under_its_mesh_dim() -> None:
    summaries = run_workers(_dtensor_redistribute_on_2d_mesh, 4)
    gathered = 8 * 4 * FP32  # the tp all-gather outputs the full [8, 4] tensor
    for rank, summary in enumerate(summaries):
        assert summary["tp"] == {"all_gather": _row(1, gathered, gathered // 2)}
        assert "dp_replicate" not in summary
        assert summary["dp"]["all_reduce"]["payload_bytes"] == 8 * FP32
        assert ("other" in summary) == (rank in (0, 1))


def _fsdp2_forward_backward() -> dict:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with CommTracer(mesh) as tracer:
        model(torch.ones(2, 8)).sum().backward()
    return tracer.summary()


def test_fsdp2_all_gathers_and_reduce_scatters_param_bytes() -> None:
    summary = run_workers(_fsdp2_forward_backward, 2)[0]
    layer_bytes = (8 * 8 + 8) * FP32
    # Non-root layers reshard after forward, so each is gathered again for backward.
    gathers, scatters = 4, 2
    assert summary == {
        "dp_shard": {
            "all_gather": _row(gathers, gathers * layer_bytes, gathers * layer_bytes // 2),
            "reduce_scatter": _row(scatters, scatters * layer_bytes, scatters * layer_bytes // 2),
        }
    }


def _dtensor_state_under_tracer() -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    param = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    with CommTracer() as tracer:
        torch.zeros_like(param)  # sharding propagation runs on fake tensors: must not break
        param.full_tensor()
    return len(tracer.records)


def test_dtensor_ops_that_propagate_on_fake_tensors_still_work_under_the_tracer():
    assert run_workers(_dtensor_state_under_tracer, 2) == [1, 1]  # only the all-gather
