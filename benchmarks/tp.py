"""Tensor and sequence parallelism: parameter bytes, traffic per block and activation bytes per rank.

Prints tables and writes ``benchmarks/results/tp.json``, for llama_tiny with 4 kv heads (so
tp=4 divides them; the variant the TP parity tests use) on tp = 1, 2, 4 forked gloo processes:

1. Parameter bytes per rank: the part the TP plan shards (DTensors with a ``Shard`` placement:
   embedding, attention and MLP projections, output head) against Ψ_sharded/tp, and the
   replicated rest (the RMSNorm gains), the same on every rank.
2. Communication per transformer block per training step on the ``tp`` mesh dim, traced
   (``CommTracer``) on rank 0 around the second optimizer step, split into forward, backward and
   optimizer step. A block's share is the difference between the same step with n_layers and
   with n_layers/2 blocks, divided by n_layers/2: whatever does not grow with depth (embedding,
   output head, loss-parallel softmax statistics, Lightning's loss logging) is left over and
   reported on its own. The playbook's volumes, with B = b·s·h activation bytes: TP all-reduces
   B after wo and w2 in forward and before wq/wk/wv and w1/w3 in backward, 4 all-reduces of
   2B(tp-1)/tp wire bytes each; with SP each becomes an all-gather plus a reduce-scatter of
   B(tp-1)/tp each: the same wire bytes.
3. Activation bytes per rank: storages a forward creates that are still alive after it (what
   autograd keeps for backward), not parameters, buffers or the logits, by the module that made
   them. SP divides the norm and residual part by tp; the all-gathered inputs of the column-parallel
   projections are kept whole (DTensor saves them; Megatron-SP would save the shard and re-gather).
4. Tokens/s of one process against tp=2 with and without SP, in alternated rounds: the median of the
   paired ratios to tp=1 with a 95% bootstrap interval (``testing.timing.Alternation``).

    python benchmarks/tp.py            # ~7 minutes on 2 CPU cores
    python benchmarks/tp.py --quick    # a smoke run for the test suite: tp=1 and tp=2+SP, one round of 4 steps
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L
import torch

torch.set_num_threads(1)

import torch.distributed.tensor  # noqa: E402  (imported before forking: testing/spawn.py)
from torch.distributed.tensor import DTensor, Shard  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from lightning_ultrascale import LlamaModule, TensorParallel, UltraScaleDataModule, UltraScaleStrategy  # noqa: E402
from lightning_ultrascale.models import get_model_config  # noqa: E402
from lightning_ultrascale.models.llama import Llama  # noqa: E402
from lightning_ultrascale.parallel.dims import ParallelDims  # noqa: E402
from lightning_ultrascale.parallel.layout import Layout  # noqa: E402
from lightning_ultrascale.parallel.mesh import build_mesh  # noqa: E402
from lightning_ultrascale.parallel.plugin import apply_all  # noqa: E402
from lightning_ultrascale.testing import run_workers  # noqa: E402
from lightning_ultrascale.testing.parity import QUIET_TRAINER  # noqa: E402
from lightning_ultrascale.testing.timing import Alternation, fit_tokens_per_s  # noqa: E402
from lightning_ultrascale.utils.comm import CommTracer, wire_bytes  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "tp.json"
MODEL = dataclasses.replace(get_model_config("llama_tiny"), n_kv_heads=4, name="llama_tiny_mha")
PHASES = ("forward", "backward", "optimizer")
ZERO = {"calls": 0, "payload_bytes": 0, "wire_bytes": 0}


# ----------------------------------------------------------------------------- 1 + 2: params, traffic
class TracePhases(L.Callback):
    """Trace the second optimizer step's collectives on the tp dim, cut at backward's start and end."""

    def __init__(self) -> None:
        self.tracer: CommTracer | None = None
        self.cuts: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step == 1:
            self.tracer = CommTracer(trainer.strategy.mesh.root).__enter__()

    def _cut(self) -> None:
        if self.tracer is not None:
            self.cuts.append(len(self.tracer.records))

    def on_before_backward(self, *args: Any) -> None:
        self._cut()

    def on_after_backward(self, *args: Any) -> None:
        self._cut()

    def on_train_batch_end(self, *args: Any) -> None:
        if self.tracer is not None and len(self.cuts) == 2:
            self.tracer.__exit__(None, None, None)
            self._cut()

    def by_phase(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{phase: {op: {"calls", "payload_bytes", "wire_bytes"}}}`` of the tp dim's collectives."""
        assert self.tracer is not None and len(self.cuts) == 3
        bounds = zip((0, *self.cuts[:2]), self.cuts)
        out: dict[str, dict[str, dict[str, int]]] = {}
        for phase, (start, end) in zip(PHASES, bounds):
            ops = out.setdefault(phase, {})
            for r in self.tracer.records[start:end]:
                if r.dim == "tp":
                    row = ops.setdefault(r.op, dict(ZERO))
                    row["calls"] += 1
                    row["payload_bytes"] += r.payload_bytes
                    row["wire_bytes"] += r.wire_bytes
        return out


def _param_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Local and global bytes of the parameters the TP plan shards, and of the replicated rest."""
    out = {"sharded_local": 0, "sharded_global": 0, "replicated": 0}
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        nbytes = local.numel() * local.element_size()
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements):
            out["sharded_local"] += nbytes
            out["sharded_global"] += p.numel() * p.element_size()
        else:
            out["replicated"] += nbytes
    return out


def comm_worker(tp: int, sp: bool, n_layers: int, seq_len: int, micro_batch: int) -> dict[str, Any]:
    trace = TracePhases()
    trainer = L.Trainer(
        accelerator="cpu", devices=tp, strategy=UltraScaleStrategy(TensorParallel(tp, sequence_parallel=sp)),
        max_steps=2, callbacks=[trace], **QUIET_TRAINER,
    )  # fmt: skip
    module = LlamaModule(dataclasses.replace(MODEL, n_layers=n_layers))
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=seq_len, micro_batch_size=micro_batch))
    return {"phases": trace.by_phase(), "params": _param_bytes(module)}


def _minus(a: Any, b: Any, times: int = 1, divide: int = 1) -> dict[str, dict[str, dict[str, int]]]:
    """Per phase and op, ``(a - times * b) / divide``; the division must be exact (every block does the same)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for phase in PHASES:
        for op in sorted({*a.get(phase, {}), *b.get(phase, {})}):
            x, y = a.get(phase, {}).get(op, ZERO), b.get(phase, {}).get(op, ZERO)
            diff = {k: x[k] - times * y[k] for k in ZERO}
            assert all(v % divide == 0 for v in diff.values()), f"{phase} {op}: {diff} not a multiple of {divide}"
            if any(diff.values()):
                out.setdefault(phase, {})[op] = {k: v // divide for k, v in diff.items()}
    return out


def block_formula(tp: int, sp: bool, activation_bytes: int) -> dict[str, dict[str, int]]:
    """The playbook's collectives of one block in forward + backward, for activations of B bytes."""
    if sp:
        ops = {"all_gather": 4, "reduce_scatter": 4}
    else:
        ops = {"all_reduce": 4}
    return {
        op: {"calls": n, "payload_bytes": n * activation_bytes, "wire_bytes": n * wire_bytes(op, activation_bytes, tp)}
        for op, n in ops.items()
    }


def _ops_of(phases: dict[str, dict[str, dict[str, int]]], which: tuple[str, ...]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for phase in which:
        for op, v in phases.get(phase, {}).items():
            row = out.setdefault(op, dict(ZERO))
            for k in row:
                row[k] += v[k]
    return out


# ----------------------------------------------------------------------------- 3: activations
def _part(module_name: str) -> str:
    """Which share of the activations a module's outputs belong to (names: ``layers.3.ffn_norm``)."""
    parts = module_name.split(".")
    if parts[0] == "norm" or (parts[0] == "layers" and (len(parts) == 2 or parts[2].endswith("norm"))):
        return "norm_residual"  # the norms and the block's own residual additions
    if parts[0] == "layers":
        return "attention_mlp"
    return "embedding_rope_head"


class LiveStorages(TorchDispatchMode):
    """Weakly records each storage an op creates (DTensor's local shards), with the module that ran it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self.where = [""]
        self.hooks: list[Any] = []
        for name, module in model.named_modules():
            # prepend: the TP styles' own input hooks (SP's all-gather) run inside the module
            self.hooks.append(module.register_forward_pre_hook(self._enter(name), prepend=True))
            self.hooks.append(module.register_forward_hook(self._leave))

    def _enter(self, name: str) -> Any:
        def hook(*_: Any) -> None:
            self.where.append(name)

        return hook

    def _leave(self, *_: Any) -> None:
        self.where.pop()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back through this mode
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if type(t) is torch.Tensor and t.device.type == "cpu":
                s = t.untyped_storage()
                known = self.storages.get(s.data_ptr())
                if s.nbytes() and (known is None or known[0].expired()):  # a view keeps its maker
                    self.storages[s.data_ptr()] = (StorageWeakRef(s), s.nbytes(), _part(self.where[-1]))
        return out

    def alive(self, exclude: list[torch.Tensor]) -> dict[str, int]:
        gc.collect()
        excluded = {(t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr() for t in exclude}
        out = {"norm_residual": 0, "attention_mlp": 0, "embedding_rope_head": 0}
        for ptr, (ref, nbytes, part) in self.storages.items():
            if not ref.expired() and ptr not in excluded:
                out[part] += nbytes
        for hook in self.hooks:
            hook.remove()
        return out


def activation_worker(tp: int, sp: bool, seq_len: int, micro_batch: int) -> dict[str, int]:
    plugin = TensorParallel(tp, sequence_parallel=sp)
    with torch.device("meta"):
        model = Llama(MODEL)
    dims = ParallelDims(tp=tp)
    layout = Layout(dims, build_mesh(dims, "cpu"))
    apply_all([plugin], model, layout)
    model.to_empty(device="cpu")
    model.init_weights(0)
    tokens = torch.randint(0, MODEL.vocab_size, (micro_batch, seq_len + 1), generator=torch.Generator().manual_seed(0))

    def step(tracker: LiveStorages | None) -> dict[str, int]:
        with tracker or contextlib.nullcontext():
            logits = model(tokens[:, :-1])
        alive = tracker.alive([*model.parameters(), *model.buffers(), logits]) if tracker else {}
        with layout.step_context():
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        return alive

    step(None)  # warm-up: DTensor's sharding-propagation caches are not activations
    return step(LiveStorages(model))


# ----------------------------------------------------------------------------- 4: speed


def speed_worker(tp: int, sp: bool, steps: int, seq_len: int, micro_batch: int) -> float:
    # Every tp rank works on the same micro-batch: tokens per step do not grow with tp.
    strategy = UltraScaleStrategy(TensorParallel(tp, sequence_parallel=sp))
    return fit_tokens_per_s(LlamaModule(MODEL), strategy, devices=tp, steps=steps, seq_len=seq_len,
                            micro_batch=micro_batch, data_ranks=1)  # fmt: skip


# ----------------------------------------------------------------------------- main
#: tp=1 first (the other rows are compared with it); a tp=2 row is needed (its plan names what tp=1 shards).
LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True)]
QUICK_LAYOUTS = [(1, False), (2, True)]


def _label(tp: int, sp: bool) -> str:
    return f"tp={tp}" + ("+SP" if sp else "") if tp > 1 else "tp=1"


def measure_params_and_comm(
    layouts: list[tuple[int, bool]], seq_len: int, micro_batch: int
) -> tuple[list[Any], list[Any]]:
    n_layers, half = MODEL.n_layers, MODEL.n_layers // 2
    activation_b = micro_batch * seq_len * MODEL.dim * 4  # B: one fp32 [b, s, h] activation
    params: dict[int, dict[str, Any]] = {}
    comm = []
    for tp, sp in layouts:
        full = run_workers(comm_worker, tp, tp, sp, n_layers, seq_len, micro_batch, timeout_s=300)[0]
        params.setdefault(tp, {"tp": tp, **full["params"]})
        if tp == 1:
            assert not any(full["phases"].values()), f"tp=1 communicates: {full['phases']}"
            continue
        shallow = run_workers(comm_worker, tp, tp, sp, half, seq_len, micro_batch, timeout_s=300)[0]
        block = _minus(full["phases"], shallow["phases"], divide=n_layers - half)
        measured = _ops_of(block, ("forward", "backward"))
        formula = block_formula(tp, sp, activation_b)
        comm.append(
            {
                "tp": tp,
                "sequence_parallel": sp,
                "n_layers": n_layers,
                "activation_bytes_B": activation_b,
                "block_forward_backward": measured,
                "block_formula": formula,
                "block_wire_ratio": sum(v["wire_bytes"] for v in measured.values())
                / sum(v["wire_bytes"] for v in formula.values()),
                "block_by_phase": block,
                "outside_blocks_by_phase": _minus(full["phases"], block, times=n_layers),
            }
        )
    # tp=1 has nothing sharded: its "sharded" part is the parameters the tp=2 plan shards.
    one, two = params[1], params[2]
    one.update(sharded_local=two["sharded_global"], sharded_global=two["sharded_global"])
    one["replicated"] -= two["sharded_global"]
    for row in params.values():
        row["formula_sharded"] = row["sharded_global"] / row["tp"]
        row["sharded_ratio"] = row["sharded_local"] / row["formula_sharded"]
    return list(params.values()), comm


def print_params(params: list[dict[str, Any]]) -> None:
    print(f"Parameter bytes per rank, fp32, {MODEL.name} (Ψ = {MODEL.num_params():,} parameters)")
    print(f"{'tp':>3} {'sharded B':>10} {'Ψ_sh/tp B':>10} {'ratio':>6} {'replicated B':>13} {'total B':>10}")
    for row in params:
        print(
            f"{row['tp']:>3} {row['sharded_local']:>10,} {row['formula_sharded']:>10,.0f} {row['sharded_ratio']:>6.3f} "
            f"{row['replicated']:>13,} {row['sharded_local'] + row['replicated']:>10,}"
        )
    print("(sharded: DTensors with a Shard placement; replicated: the RMSNorm gains)")


def print_comm(comm: list[dict[str, Any]], seq_len: int, micro_batch: int) -> None:
    n_layers, half = MODEL.n_layers, MODEL.n_layers // 2
    print(
        f"\nTP collectives per transformer block per training step (forward + backward), tp dim, rank 0;"
        f"\nblock = (step with {n_layers} layers - step with {half}) / {n_layers - half};"
        f" B = b·s·h·4 = {micro_batch}·{seq_len}·{MODEL.dim}·4 = {comm[0]['activation_bytes_B']:,} bytes"
    )
    header = f"{'layout':<9} {'op':<15} {'calls fwd+bwd':>13} {'payload B':>10} {'wire B':>9}"
    print(f"{header} {'playbook: calls':>16} {'wire B':>9}")
    for row in comm:
        label = _label(row["tp"], row["sequence_parallel"])
        for op in sorted({*row["block_forward_backward"], *row["block_formula"]}):
            m, f = row["block_forward_backward"].get(op, ZERO), row["block_formula"].get(op, ZERO)
            fwd, bwd = (row["block_by_phase"].get(phase, {}).get(op, ZERO)["calls"] for phase in PHASES[:2])
            print(
                f"{label:<9} {op:<15} {f'{fwd}+{bwd}':>13} {m['payload_bytes']:>10,} {m['wire_bytes']:>9,} "
                f"{f['calls']:>16} {f['wire_bytes']:>9,}"
            )
            label = ""
        print(f"{'':<9} {'wire bytes / playbook':<50} {row['block_wire_ratio']:>15.3f}")
    print(
        "(playbook: 4 all-reduces of B, 2B(tp-1)/tp wire bytes each; with SP 4 all-gathers + 4 reduce-scatters"
        "\n of B, B(tp-1)/tp each. Payload: the bytes handed to the collective, an all-gather's gathered output)"
    )

    print("\nOther tp collectives per step: the blocks' optimizer step, and everything outside the blocks")
    print(f"{'layout':<9} {'where':<20} {'op':<15} {'calls':>5} {'payload B':>10}")
    for row in comm:
        label = _label(row["tp"], row["sequence_parallel"])
        optimizer = row["block_by_phase"].get("optimizer", {})
        lines = [(f"{n_layers} blocks, optimizer", op, v["calls"] * n_layers, v["payload_bytes"] * n_layers)
                 for op, v in optimizer.items()]  # fmt: skip
        for phase in PHASES:
            outside = row["outside_blocks_by_phase"].get(phase, {})
            lines += [(f"outside, {phase}", op, v["calls"], v["payload_bytes"]) for op, v in outside.items()]
        for where, op, calls, payload in lines:
            print(f"{label:<9} {where:<20} {op:<15} {calls:>5} {payload:>10,}")


def measure_activations(layouts: list[tuple[int, bool]], seq_len: int, micro_batch: int) -> list[dict[str, Any]]:
    activations = []
    for tp, sp in layouts:
        parts = run_workers(activation_worker, tp, tp, sp, seq_len, micro_batch, timeout_s=300)[0]
        activations.append({"tp": tp, "sequence_parallel": sp, **parts, "total": sum(parts.values())})
    for a in activations:
        a["ratio_to_tp1"] = a["total"] / activations[0]["total"]
    return activations


def print_activations(activations: list[dict[str, Any]], seq_len: int, micro_batch: int) -> None:
    print(f"\nActivation bytes per rank one forward keeps for backward (b={micro_batch}, s={seq_len}, not the logits)")
    print(f"{'layout':<9} {'norm+residual':>14} {'attn+MLP':>10} {'emb+rope+head':>14} {'total':>10} {'x tp=1':>7}")
    for a in activations:
        print(
            f"{_label(a['tp'], a['sequence_parallel']):<9} {a['norm_residual']:>14,} {a['attention_mlp']:>10,} "
            f"{a['embedding_rope_head']:>14,} {a['total']:>10,} {a['ratio_to_tp1']:>7.3f}"
        )
    print("(by the module whose forward created the storage; with SP the all-gathered inputs count in attn+MLP)")


def _measure(tp: int, sp: bool, steps: int, seq_len: int, micro_batch: int) -> float:
    return run_workers(speed_worker, tp, tp, sp, steps, seq_len, micro_batch, timeout_s=300)[0]


def measure_speed(layouts: list[tuple[int, bool]], steps: int, rounds: dict[str, Any], seq_len: int,
                  micro_batch: int) -> dict[str, Any]:  # fmt: skip
    """Every layout against tp=1 in alternated rounds (``testing.timing.Alternation``)."""
    arms = {_label(tp, sp): partial(_measure, tp, sp, steps, seq_len, micro_batch) for tp, sp in layouts}
    alternation = Alternation(arms, baseline="tp=1", **rounds)
    ratios = alternation.run()
    tokens_per_s = {label: statistics.median(values) for label, values in alternation.samples.items()}
    return {
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "steps": steps,
        "rounds": len(alternation.samples["tp=1"]),
        "tokens_per_s": tokens_per_s,
        "ratio_to_tp1": {label: r.median for label, r in ratios.items()},
        "paired_ratios": {label: r.as_dict() for label, r in ratios.items()},
        "samples": alternation.samples,
    }


def print_speed(speed: dict[str, Any]) -> None:
    print(
        f"\nTokens/s (b={speed['micro_batch']}, s={speed['seq_len']}), one thread per process, medians of "
        f"{speed['rounds']} alternated rounds of {speed['steps']} steps; ratios paired within a round"
    )
    for label, value in speed["tokens_per_s"].items():
        paired = speed["paired_ratios"].get(label) or {"ci_low": None}
        interval = "" if paired["ci_low"] is None else f"  (95% CI {paired['ci_low']:.3f}-{paired['ci_high']:.3f})"
        ratio = speed["ratio_to_tp1"].get(label, 1.0)
        print(f"{label:<9} {value:>10,.0f} {ratio:>7.3f} x tp=1{interval}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="tp=1 (and tp=2 with SP for the traffic), 4 steps (smoke test)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    seq_len, micro_batch = (32, 2) if args.quick else (64, 4)
    steps, speed_seq_len, speed_batch = (4, 32, 2) if args.quick else (20, 256, 8)
    rounds = (
        {"min_rounds": 1, "max_rounds": 1} if args.quick else {"min_rounds": 6, "max_rounds": 30, "max_seconds": 420}
    )
    layouts = QUICK_LAYOUTS if args.quick else LAYOUTS

    params, comm = measure_params_and_comm(layouts, seq_len, micro_batch)
    # --quick: the traffic needs tp=2; the other tables run their first row.
    activations = measure_activations(layouts[:1] if args.quick else layouts, seq_len, micro_batch)
    speed = measure_speed(layouts if args.quick else LAYOUTS[:3], steps, rounds, speed_seq_len, speed_batch)
    print_params(params)
    print_comm(comm, seq_len, micro_batch)
    print_activations(activations, seq_len, micro_batch)
    print_speed(speed)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "tp",
        "quick": args.quick,
        "device": "cpu",
        "model": dataclasses.asdict(MODEL),
        "params": params,
        "comm": comm,
        "activations": activations,
        "speed": speed,
    }
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
