"""The planner's cost model against measurements: per-rank peak memory and traced bytes of real runs.

Each layout trains ``llama_tiny`` or ``moe_tiny`` (fp32, AdamW, seq 256) for two optimizer steps in
the real Lightning loop (``UltraScaleStrategy`` built from the planner's own ``Candidate.strategy()``)
and measures on every rank, during the second step (optimizer states exist):

- peak memory: torch's ``MemTracker`` (every storage alive on the device, parameters and optimizer
  states included), its module hooks off so that pipeline schedules may call a stage repeatedly;
- its parts: ``model_state_bytes`` (parameters, gradients, optimizer states after the step) and
  the activations kept for backward (distinct storages packed by autograd, parameters excluded;
  recomputation's own saves are invisible to these hooks, so this part is reported, not compared,
  under recomputation);
- communication: ``CommTracer``'s payload bytes by mesh dim and collective, and its calls (each pays a
  collective's latency, which the planner prices per call).

The planner (``lightning_ultrascale.plan.cost.estimate``) predicts the same per rank from formulas.
Peak memory must agree within 5%, traced bytes within 1% (scalar collectives of the loss logging and
grad norm, <= 256 bytes each, are not modelled and not compared). Expert parallelism's all-to-all
moves as many rows as the router sends each rank, so its bytes are compared as the mean over the
expert-parallel ranks (which routing cannot change); the per-rank spread is reported.

Usage: ``python benchmarks/plan.py [--quick] [--out results/plan.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L
import torch

torch.set_num_threads(1)

from torch.distributed.tensor import DTensor  # noqa: E402

from lightning_ultrascale import LlamaModule, OptimConfig, UltraScaleDataModule  # noqa: E402
from lightning_ultrascale.models import build_model, get_model_config  # noqa: E402
from lightning_ultrascale.plan import GPUS  # noqa: E402
from lightning_ultrascale.plan.cost import Candidate, Workload, estimate  # noqa: E402
from lightning_ultrascale.testing import run_workers  # noqa: E402
from lightning_ultrascale.testing.parity import QUIET_TRAINER  # noqa: E402
from lightning_ultrascale.utils.comm import CommTracer  # noqa: E402
from lightning_ultrascale.utils.memory import model_state_bytes  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "plan.json"
SEQ_LEN = 256
ADAMW = OptimConfig(name="adamw", lr=1e-3, warmup_steps=0)
MEMORY_BOUND, COMM_BOUND, SCALAR_BYTES = 0.05, 0.01, 256
#: Collective calls per parallelism: the planner's count (each call pays a collective's latency) against the
#: traced one, off by at most this share plus CALLS_EXTRA calls: the once-a-step calls it does not count (the
#: replicated norms' gradient bucket over tp, the router's statistics) are one or two.
CALLS_SLACK, CALLS_EXTRA = 0.05, 2

#: (model, candidate): every dim, both pipeline schedule families, every recomputation mode.
_ = Candidate.layout  # (short: one layout per line)
LAYOUTS: list[tuple[str, Candidate]] = [
    ("llama_tiny", _(dp=1, zero=0, micro_batch_size=2)),
    ("llama_tiny", _(dp=2, zero=0, micro_batch_size=2)),
    ("llama_tiny", _(dp=2, zero=1, micro_batch_size=2)),
    ("llama_tiny", _(dp=2, zero=2, micro_batch_size=2, recompute="selective", recompute_every=2)),
    ("llama_tiny", _(dp=2, zero=3, micro_batch_size=2, recompute="full")),
    ("llama_tiny", _(dp=1, zero=0, tp=2, micro_batch_size=2)),
    ("llama_tiny", _(tp=2, zero=0, sequence_parallel=False, micro_batch_size=2, recompute="selective_op")),
    ("llama_tiny", _(dp=1, zero=0, pp=2, schedule="1f1b", microbatches=4, micro_batch_size=1)),
    ("llama_tiny", _(dp=1, zero=0, pp=2, schedule="afab", microbatches=4, micro_batch_size=1)),
    ("llama_tiny", _(dp=1, zero=0, pp=2, schedule="interleaved_1f1b", microbatches=4, micro_batch_size=1)),
    ("llama_tiny", _(dp=1, zero=0, cp=2, cp_method="zigzag_ring", micro_batch_size=2)),
    ("llama_tiny", _(dp=1, zero=0, cp=2, cp_method="all_to_all", micro_batch_size=2)),
    ("moe_tiny", _(dp=1, zero=0, micro_batch_size=2)),
    ("moe_tiny", _(dp=2, zero=0, ep=2, micro_batch_size=2)),
    ("moe_tiny", _(dp=2, zero=3, ep=2, micro_batch_size=2)),
    ("llama_tiny", _(dp=2, zero=3, tp=2, micro_batch_size=2)),
    # what tensor parallelism runs again in backward: regathered inputs, and each recomputation mode's share
    ("llama_tiny", _(dp=1, zero=0, tp=2, micro_batch_size=2, regather=True)),
    ("llama_tiny", _(dp=1, zero=0, tp=2, micro_batch_size=2, recompute="full")),
    ("llama_tiny", _(dp=1, zero=0, tp=2, micro_batch_size=2, recompute="selective_op")),
    ("llama_tiny", _(dp=1, zero=0, tp=2, sequence_parallel=False, micro_batch_size=2, recompute="full")),
    ("moe_tiny", _(dp=1, zero=0, tp=2, micro_batch_size=2, recompute="full")),
    ("moe_tiny", _(dp=1, zero=0, tp=2, micro_batch_size=2, regather=True)),
    # ZeRO-3 of a folded MoE: its experts over edp, its router and shared experts over dp x tp, module by module
    ("moe_tiny", _(dp=2, zero=3, tp=2, ep=2, micro_batch_size=2)),
]
#: (model, candidate, micro-steps per optimizer step): what gradient accumulation and a pipeline
#: keep between micro-steps (ZeRO-3: sharded gradients; ZeRO-2: full buckets; ZeRO-3 under a
#: pipeline: unsharded gradients and gathered parameters until the schedule ends).
ACCUMULATED: list[tuple[str, Candidate, int]] = [
    ("llama_tiny", _(dp=2, zero=3, micro_batch_size=2), 2),
    ("llama_tiny", _(dp=2, zero=2, micro_batch_size=2), 2),
    ("llama_tiny", _(dp=2, zero=3, pp=2, schedule="1f1b", microbatches=4, micro_batch_size=1), 1),
    # (a rank holding a middle stage: its part's root holds no parameters, so gathers nothing)
    ("llama_tiny", _(dp=2, zero=3, pp=2, schedule="interleaved_1f1b", microbatches=4, micro_batch_size=1), 1),
    # HSDP: reduce-scattered every micro-step, all-reduced across the replicas once, at the last
    ("llama_tiny", _(dp=4, zero=3, replicate=2, micro_batch_size=2), 2),
]  # fmt: skip


def _peak_tracker() -> Any:
    from torch.distributed._tools.mem_tracker import MemTracker

    class StorageTracker(MemTracker):
        """MemTracker counting storages only: its per-module statistics refuse a module called twice per step."""

        def _pre_fw_hook(self, *args: Any) -> None: ...
        def _post_fw_hook(self, *args: Any) -> None: ...
        def _pre_bw_hook(self, *args: Any) -> None: ...
        def _post_bw_hook(self, *args: Any) -> None: ...

    return StorageTracker()


class KeptForBackward:
    """Peak bytes of distinct storages autograd keeps for backward (parameters and their views excluded)."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage address -> [bytes, holders]
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._base is not None else t
        if base.is_leaf and base.requires_grad:
            return t
        local = t.to_local() if isinstance(t, DTensor) else t
        try:
            storage = local.untyped_storage()
            nbytes, key = storage.nbytes(), storage.data_ptr()
        except RuntimeError:  # fake or freed storages (sharding propagation)
            return t
        if not nbytes:
            return t
        ref = self._refs.setdefault(key, [nbytes, 0])
        if ref[1] == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        ref[1] += 1
        return _Held(t, key, self)

    @staticmethod
    def _unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: int) -> None:
        ref = self._refs[key]
        ref[1] -= 1
        if ref[1] == 0:
            self.live -= ref[0]
            del self._refs[key]


class _Held:
    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int, meter: KeptForBackward) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter.release(self.key)


class MeasureSecondStep(L.Callback):
    def __init__(self) -> None:
        self.result: dict[str, Any] | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step != 1 or hasattr(self, "memory"):  # (accumulation: once per step)
            return
        self.kept = KeptForBackward()
        self.kept.hooks.__enter__()
        self.tracer = CommTracer(trainer.strategy.mesh.root).__enter__()
        self.memory = _peak_tracker()
        self.memory.track_external(pl_module, *trainer.optimizers)
        self.memory.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step != 2 or self.result is not None:
            return
        self.memory.__exit__(None, None, None)
        self.tracer.__exit__(None, None, None)
        self.kept.hooks.__exit__(None, None, None)
        peak = sum(d["Total"] for d in self.memory.get_tracker_snapshot("peak").values())
        state = model_state_bytes(pl_module, trainer.optimizers)
        comm: dict[str, int] = {}
        for r in self.tracer.records:
            if r.payload_bytes > SCALAR_BYTES:
                key = f"{r.dim}:{r.op}"
                comm[key] = comm.get(key, 0) + r.payload_bytes
        calls = self.tracer.launches(min_bytes=SCALAR_BYTES)
        self.result = {
            "peak": int(peak),
            "model_state": {"params": state.params, "grads": state.grads, "optimizer": state.optimizer_states},
            "activations_kept": self.kept.peak,
            "comm": comm,
            "calls": calls,
        }


def measure_worker(model: str, candidate: Candidate, accumulation: int = 1) -> dict[str, Any]:
    measure = MeasureSecondStep()
    trainer = L.Trainer(
        accelerator="cpu", devices=candidate.world_size, strategy=candidate.strategy(),
        max_steps=2, accumulate_grad_batches=accumulation, callbacks=[measure], **QUIET_TRAINER,
    )  # fmt: skip
    data = UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=candidate.batch_per_rank)
    trainer.fit(LlamaModule(model, optim=ADAMW), datamodule=data)
    assert measure.result is not None
    return measure.result


def compare(model: str, candidate: Candidate, accumulation: int = 1) -> dict[str, Any]:
    global_batch = candidate.batch_per_rank * candidate.dp * accumulation
    workload = Workload(get_model_config(model), SEQ_LEN, global_batch, precision="32-true")
    measured = run_workers(measure_worker, candidate.world_size, model, candidate, accumulation, timeout_s=600)
    meta = build_model(model, device="meta")
    # (the cpu profile: gloo, whose pipeline sends free later, Hardware.sends_polled)
    predicted = estimate(workload, candidate, meta, GPUS["cpu"], ranks=list(range(candidate.world_size)))
    ranks = []
    for rank, (m, p) in enumerate(zip(measured, predicted)):
        ranks.append(
            {
                "rank": rank,
                "measured_peak": m["peak"],
                "predicted_peak": p.peak,
                "memory_error": p.peak / m["peak"] - 1,
                "predicted_parts": p.memory,
                "measured_model_state": m["model_state"],
                "predicted_model_state": p.model_state,
                "measured_activations_kept": m["activations_kept"],
                "predicted_activations_kept": p.memory["activations"],
                "measured_comm": m["comm"],
                "predicted_comm": p.comm,
                "measured_calls_by_dim": _by_dim(m["calls"]),
                "predicted_calls_by_dim": _by_dim(p.calls),
            }
        )
    _comm_errors(ranks)
    label = candidate.label() + (f" acc{accumulation}" if accumulation > 1 else "")
    return {"model": model, "layout": label, "world_size": candidate.world_size, "ranks": ranks}


def _by_dim(comm: dict[str, int]) -> dict[str, int]:
    """Bytes per parallelism: tp, cp, pp, ep (all-to-alls on the data ranks EP borrows) and data.

    The tracer names a group by the mesh dim (or flattened dims) it was built on, e.g.
    ``dp_shard_cp`` for FSDP's group when cp is 1; the planner by the dims of size > 1.
    """
    out: dict[str, int] = {}
    for key, nbytes in comm.items():
        dim, op = key.split(":")
        if dim not in ("tp", "cp", "pp", "ep"):
            dim = "ep" if op == "all_to_all" else "data"
        out[dim] = out.get(dim, 0) + nbytes
    return out


def calls_off(ranks: list[dict[str, Any]]) -> int:
    """The most calls by which a rank's predicted collectives of one parallelism miss its traced ones, beyond
    :data:`CALLS_SLACK`'s share (0: every count within it)."""
    worst = 0
    for r in ranks:
        measured, predicted = r["measured_calls_by_dim"], r["predicted_calls_by_dim"]
        for dim in {*measured, *predicted}:
            m, p = measured.get(dim, 0), predicted.get(dim, 0)
            worst = max(worst, abs(p - m) - int(CALLS_SLACK * m))
    return worst


def _comm_errors(ranks: list[dict[str, Any]]) -> None:
    """Relative error of each rank's traced bytes per parallelism (EP: the mean over ranks, see the docstring)."""
    for r in ranks:
        r["measured_comm_by_dim"] = _by_dim(r["measured_comm"])
        r["predicted_comm_by_dim"] = _by_dim(r["predicted_comm"])
    for r in ranks:
        r["comm_errors"] = {}
        for dim in sorted({*r["measured_comm_by_dim"], *r["predicted_comm_by_dim"]}):
            measured: float = r["measured_comm_by_dim"].get(dim, 0)
            if dim == "ep":
                measured = sum(x["measured_comm_by_dim"].get(dim, 0) for x in ranks) / len(ranks)
            predicted = r["predicted_comm_by_dim"].get(dim, 0)
            r["comm_errors"][dim] = predicted / measured - 1 if measured else (0.0 if not predicted else 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one layout, dp2 zero0 (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    layouts = [(model, candidate, 1) for model, candidate in LAYOUTS] + ACCUMULATED
    if args.quick:
        layouts = layouts[1:2]
    rows = [compare(*layout) for layout in layouts]
    print(f"\nPlanner vs measured, per rank (seq {SEQ_LEN}, fp32, AdamW, second step)")
    print(f"{'model':<11}{'layout':<46}{'rank':>5}{'measured':>11}{'predicted':>11}{'error':>8}{'comm err':>10}")
    worst_memory = worst_comm = 0.0
    for row in rows:
        for r in row["ranks"]:
            comm_error = max((abs(e) for e in r["comm_errors"].values()), default=0.0)
            worst_memory, worst_comm = max(worst_memory, abs(r["memory_error"])), max(worst_comm, comm_error)
            print(
                f"{row['model']:<11}{row['layout']:<46}{r['rank']:>5}{r['measured_peak'] / 2**20:>9.2f}MB"
                f"{r['predicted_peak'] / 2**20:>9.2f}MB{r['memory_error']:>+8.1%}{comm_error:>10.2%}"
            )
    calls_over = max(calls_off(row["ranks"]) for row in rows)
    print(f"\nworst memory error {worst_memory:.1%} (bound {MEMORY_BOUND:.0%}), worst comm error {worst_comm:.2%}")
    print(f"collective calls: the most over {CALLS_SLACK:.0%} of the traced count {calls_over} (at most {CALLS_EXTRA})")
    within = sum(max(abs(r["memory_error"]) for r in row["ranks"]) <= MEMORY_BOUND for row in rows)
    out = {
        "benchmark": "plan",
        "layouts_within_memory_bound": within,
        "quick": args.quick,
        "seq_len": SEQ_LEN,
        "memory_bound": MEMORY_BOUND,
        "comm_bound": COMM_BOUND,
        "worst_memory_error": worst_memory,
        "worst_comm_error": worst_comm,
        "calls_slack": CALLS_SLACK,
        "calls_extra": CALLS_EXTRA,
        "calls_over_slack": calls_over,
        "layouts": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    print(f"{within} of {len(rows)} layouts within {MEMORY_BOUND:.0%} on every rank")
    if worst_comm > COMM_BOUND or calls_over > CALLS_EXTRA or (not args.quick and within < 12):
        sys.exit(1)


if __name__ == "__main__":
    main()
