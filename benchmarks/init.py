"""Initialising one rank of a large layout: the old full draw against the shard-local draw, side by side.

Prints a table and writes ``benchmarks/results/init.json``. One rank (rank 0) of Llama 3 8B laid
out over 64 ranks (ZeRO-3 dp64; TP8 x ZeRO-3 dp8, where FSDP2 over TP gives ``_StridedShard``
placements) under torch's ``fake`` process group: the strategy's plugins shard a meta model,
``to_empty`` allocates this rank's shards only, and ``init_weights`` is what is timed:

- old: before shard-local initialisation, every parameter was drawn whole on the CPU by mt19937
  (seeded with a 32-bit hash of seed and name), and ``distribute_tensor`` kept this rank's shard
  (reproduced here as it was);
- new: ``Llama.init_weights``, which draws only the elements this rank holds (Philox,
  ``models/shard_init.py``).

Columns: wall time of ``init_weights`` (one thread), peak bytes alive during it (``peak_bytes``:
torch's ``MemTracker``, this rank's shards included) and normals drawn (old: every element of every
drawn parameter; new: counted at the generator, four per Philox call).

    python benchmarks/init.py            # 3-4.5 minutes on 2 CPU cores (the old path draws 8B values twice per layout)
    python benchmarks/init.py --quick    # llama_small over 8 ranks, seconds (the test suite's smoke run)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402

from lightning_ultrascale import TensorParallel, UltraScaleStrategy, ZeRO  # noqa: E402
from lightning_ultrascale.models import Llama, build_model, shard_init  # noqa: E402
from lightning_ultrascale.parallel.layout import Layout  # noqa: E402
from lightning_ultrascale.parallel.mesh import build_mesh  # noqa: E402
from lightning_ultrascale.parallel.plugin import apply_all  # noqa: E402
from lightning_ultrascale.utils.memory import format_bytes, peak_bytes  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "init.json"
SEED = 0
#: name -> (plugins, world size) of the full run and of --quick (the same kinds of placement, 8 ranks).
LAYOUTS: dict[str, tuple[Callable[[], list[Any]], int]] = {
    "zero3_dp64": (lambda: [ZeRO(stage=3)], 64),
    "tp8_x_zero3_dp8": (lambda: [TensorParallel(8), ZeRO(stage=3)], 64),
}
QUICK_LAYOUTS: dict[str, tuple[Callable[[], list[Any]], int]] = {
    "zero3_dp8": (lambda: [ZeRO(stage=3)], 8),
    "tp2_x_zero3_dp4": (lambda: [TensorParallel(2), ZeRO(stage=3)], 8),
}


def old_init_weights(model: Llama, seed: int) -> None:
    """``Llama.init_weights`` before shard-local initialisation: each parameter drawn whole, then cut."""
    model.tie_weights()
    model.init_buffers()
    for fqn, param in model.named_parameters():
        name = ".".join(c for c in fqn.split(".") if c not in ("_checkpoint_wrapped_module", "_orig_mod"))
        std = model._init_std(name)
        if std is None:
            full = torch.ones(param.shape)
        else:
            key = int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=4).digest(), "little")
            full = torch.empty(param.shape).normal_(0.0, std, generator=torch.Generator().manual_seed(key))
        with torch.no_grad():
            if isinstance(param, DTensor):
                param.to_local().copy_(
                    distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
                )
            else:
                param.copy_(full)


def _materialise(model_name: str, plugins: list[Any], world_size: int) -> Llama:
    strategy = UltraScaleStrategy(*plugins, seed=SEED)
    model: nn.Module = build_model(model_name, device="meta")
    strategy.validate(model.spec, world_size=world_size)  # type: ignore[arg-type]
    layout = Layout(strategy.parallel_dims, build_mesh(strategy.parallel_dims, "cpu"))
    model = apply_all(strategy.applied_plugins(), model, layout)
    return model.to_empty(device="cpu")  # type: ignore[return-value]


def _measure(model: Llama, init: Callable[[], None]) -> dict[str, Any]:
    """Seconds, peak bytes and normals drawn by ``init`` (run twice: timed alone, then under MemTracker)."""
    drawn = [0]
    normals = shard_init._normals

    def counting(counters: torch.Tensor, key: int) -> torch.Tensor:
        drawn[0] += 4 * counters.numel()
        return normals(counters, key)

    shard_init._normals = counting  # type: ignore[assignment]
    start = time.perf_counter()
    init()
    seconds = time.perf_counter() - start
    shard_init._normals = normals  # type: ignore[assignment]
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return {"seconds": seconds, "peak_bytes": peak_bytes(init, *local), "counted_normals": drawn[0]}


def rank_worker(model_name: str, layout: str, plugins: list[Any], world_size: int) -> dict[str, Any]:
    """Rank 0 of ``layout``: its shards, then old and new initialisation measured on the same tensors."""
    model = _materialise(model_name, plugins, world_size)
    new = _measure(model, lambda: model.init_weights(SEED))
    old = _measure(model, lambda: old_init_weights(model, SEED))
    drawn = [(p, p.to_local() if isinstance(p, DTensor) else p) for n, p in model.named_parameters() if "norm" not in n]
    old["drawn"] = sum(p.numel() for p, _ in drawn)
    new["drawn"] = new.pop("counted_normals")
    old.pop("counted_normals")
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return {
        "layout": layout,
        "model": model_name,
        "world_size": world_size,
        "rank": 0,
        "model_params": sum(p.numel() for p in model.parameters()),
        "held_elements": sum(t.numel() for t in local),
        "held_bytes": sum(t.nbytes for t in local),
        "held_drawn_elements": sum(t.numel() for _, t in drawn),  # norms start at 1: nothing drawn
        "placements": sorted({str(p.placements) for p in model.parameters() if isinstance(p, DTensor)}),
        "old": old,
        "new": new,
        "speedup": old["seconds"] / new["seconds"],
        "peak_ratio": old["peak_bytes"] / new["peak_bytes"],
    }


def in_fake_rank(fn: Callable[..., dict[str, Any]], world_size: int, *args: Any) -> dict[str, Any]:
    """``fn(*args)`` as rank 0 of ``world_size`` under the fake process group, in a forked child.

    Forked because a process group and its device meshes leave registries behind in the process
    (``plan/shards.py``'s dry run does the same).
    """
    context = mp.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, fn, world_size, args))
    child.start()
    send.close()
    ok, result = receive.recv()
    child.join()
    if not ok:
        raise RuntimeError(result)
    return result


def _child(send: Connection, fn: Callable[..., dict[str, Any]], world_size: int, args: tuple[Any, ...]) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    try:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        send.send((True, fn(*args)))
    except Exception:
        send.send((False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        send.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="llama_small over 8 ranks (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    model_name, layouts = ("llama_small", QUICK_LAYOUTS) if args.quick else ("llama3_8b", LAYOUTS)
    # Other processes on the machine slow both paths: the load is recorded beside the times.
    load, start = os.getloadavg()[0], time.perf_counter()
    rows = [
        in_fake_rank(rank_worker, size, model_name, name, plugins(), size) for name, (plugins, size) in layouts.items()
    ]
    wall_s = time.perf_counter() - start

    print(f"\ninit_weights of rank 0, {model_name} ({rows[0]['model_params'] / 1e9:.3g}B parameters), one CPU thread")
    print(f"{'layout (ranks)':<26}{'path':<6}{'seconds':>9}{'peak':>12}{'normals drawn':>16}")
    for row in rows:
        where = f"{row['layout']} ({row['world_size']})"
        for path in ("old", "new"):
            r = row[path]
            print(f"{where:<26}{path:<6}{r['seconds']:>9.2f}{format_bytes(r['peak_bytes']):>12}{r['drawn']:>16,}")
            where = ""
        print(
            f"{'':<26}old/new: time {row['speedup']:.1f}x, peak {row['peak_ratio']:.1f}x; "
            f"the rank holds {row['held_elements']:,} elements ({format_bytes(row['held_bytes'])})"
        )
    print(f"\nwhole run: {wall_s:.0f} s (load average {load:.1f} when it started)")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "init",
        "quick": args.quick,
        "torch": torch.__version__,
        "threads": 1,
        "wall_s": wall_s,
        "load_average": load,
    }
    args.out.write_text(json.dumps(payload | {"layouts": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
