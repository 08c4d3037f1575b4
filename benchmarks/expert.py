"""Mixture of experts and expert parallelism: all-to-all bytes, expert bytes per rank, speed, grouped GEMM, balancing.

Prints tables and writes ``benchmarks/results/expert.json``, for moe_tiny (dim 64, 4 blocks of
which 3 are MoE, 8 routed experts of width 64, top-2, DeepSeek-V3's sigmoid router with 4 groups
of 2 experts, 2 groups per token, 1 shared expert; fp32) on the bundled corpus
(``load_default_corpus_tokens``: rank ``r`` of the byte-count runs reads sequences
``r b .. r b + b - 1``, the training runs read ``UltraScaleDataModule``'s shuffled batches):

1. All-to-all bytes per MoE layer per training step, at ep = 2 and 4 (forked gloo processes),
   each running one forward and backward of the model with ``ExpertParallel(ep)`` applied (the
   optimizer step moves no tokens). ``CommTracer`` sees the dispatcher's
   ``all_to_all_single_autograd`` in forward and its reverse exchange in backward; a subclass
   also keeps each call's split sizes, so the bytes that leave the rank (every split but its
   own) are known exactly. Per layer and rank there are four exchanges: forward dispatch (the
   rank's ``T k`` (token, expert) rows to the ranks holding their experts), forward combine (the
   results back), and in backward the combine's gradient (the same splits as dispatch) and the
   dispatch's (the same as combine). Dropless routing decides what travels, so the check is
   exact against the routers: dispatch sends ``R_out dim 4`` bytes, ``R_out`` the rank's rows
   routed to another rank's experts, and combine ``R_in dim 4``, ``R_in`` the rows other ranks
   route to this rank's experts (both counted from every rank's router choices). The playbook's
   volume assumes uniform routing: ``T k dim 4 (ep-1)/ep`` bytes per exchange, 4 per layer per
   step. Averaged over ranks it holds whenever every rank routes with the same distribution over
   experts, skewed or not (each rank then keeps ``1/ep`` of its rows on average); what skewed
   routing changes is which rank sends and which computes. The ``skewed`` rows add the router
   skew of part 5 (most rows to experts 0 and 2: both on rank 0 at ep=2, on ranks 0 and 1 at
   ep=4): the per-rank dispatch bytes then range from about a tenth to about twice the uniform
   volume, and the ranks holding the hot experts run most rows. The small exchange of row counts
   (``E`` int64 per layer, forward only) is counted apart. ``CommTracer``'s own ``wire_bytes`` is the uniform
   estimate, ``(ep-1)/ep`` of the payload each all-to-all is handed, not what leaves the rank;
   both are printed.
2. Parameter bytes per rank: the routed experts (``w1``, ``w2``, ``w3`` of every MoE block, one
   ``Shard(0)`` DTensor each) against exactly ``E/ep`` experts' bytes (ratio 1), and the rest
   (embedding, attention, norms, dense block, router, shared expert, head), replicated: the
   same bytes at every ep.
3. Tokens/s of ep=1 (plain data parallel, ``UltraScaleStrategy()``) and ep=2
   (``UltraScaleStrategy(ExpertParallel(2))``), both on 2 forked processes with the same
   micro-batch per rank (so the same global batch), in alternated rounds: the median of the paired
   ratios with a 95% bootstrap interval (``testing.timing.Alternation``). Two CPU cores and gloo:
   these timings say little about GPUs, where the all-to-alls cross NVLink or InfiniBand and the
   experts' GEMMs are the bulk of the work; here a tiny model's dispatch bookkeeping and gloo's
   latency dominate.
4. Grouped GEMM (``torch._grouped_mm``, ``expert_kernel="grouped_mm"``) against the per-expert
   loop (``"loop"``): forward + backward time of ``GroupedExperts`` alone on one process for a
   few (experts, rows, dim, hidden) shapes, the rows split over the experts by a random top-2
   routing (uneven counts), median of the repeats (one thread); the outputs and the gradients of
   the input and of ``w1``, ``w2``, ``w3`` must agree within fp32 tolerance (``rtol=1e-4,
   atol=1e-5``), and the largest differences are printed.
5. Load imbalance over training steps: one process, moe_tiny with a deliberately skewed router:
   in every MoE block, ``SKEW x`` the unit mean direction of the block's router input (over a
   fixed calibration batch, the corpus' first 8 sequences of 128) is added to the router rows of
   experts 0 and 2, which sit in different groups, so group-limited top-2 routing sends most
   tokens to that pair: max/mean about 3.6 at step 0, where 4 is the most top-2 of 8 allows.
   Trained with ``LlamaModule`` under Lightning, so the aux loss and the bias update are the ones
   training uses (``LlamaModule._balance_experts`` after every optimizer step). AdamW with the
   library's schedule (lr 3e-3, cosine decay to 0.1 x lr at the last step; no warm-up, the skew
   is there from step 0): AdamW because the recipes train with it, and because its steps are
   about ``lr`` whatever the gradient's size, the aux-loss coefficient sets how much of the
   router's gradient asks for balance rather than how far the router moves. Methods: the
   sequence-wise aux loss (DeepSeek-V3) with a coefficient and no bias update; the aux-loss-free
   bias with a rate and no aux loss; neither (the control); and (full run) moe_tiny's defaults,
   a 1e-4 sequence aux loss and a 1e-3 bias rate together. The coefficient and rate are printed;
   the full run's were tuned so that the stated number of steps suffices (the bias at moe_tiny's
   1e-3 needs several hundred steps to undo this skew: the full run shows it with the defaults).
   Recorded each step: every MoE block's global tokens per expert (``LlamaModule.expert_stats.loads``)
   and max/mean of the worst block; step ``s`` is the routing of the (s+1)-th forward, after
   ``s`` updates. A batch is a few dozen contiguous chunks of text, and which experts a chunk needs
   depends on what it is (code, prose, indentation), and every optimizer step moves the router
   of a model this small noticeably, so the per-step value jumps by 0.1-0.3 from step to step
   even once balanced on average. Reported: step 0, the first step below 1.3, and the step from
   which it **stays** below 1.3: the mean of the last ``WINDOW`` = 10 per-step values is below
   1.3 at that step and at every later step until the run ends (one odd batch does not undo
   it, a sustained rise does); also the same with the per-step value itself ("strictly", which a
   single spike breaks), and the share of per-step values below 1.3 and their maximum from the
   "stays" step on.

    python benchmarks/expert.py            # ~6 minutes on 2 CPU cores
    python benchmarks/expert.py --quick    # a smoke run for the test suite: ep=2, a few steps, one of each table
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L
import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
import torch.distributed.tensor  # noqa: E402  (imported before forking: testing/spawn.py)
from torch import Tensor, nn  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from lightning_ultrascale import (  # noqa: E402
    ExpertParallel,
    LlamaModule,
    OptimConfig,
    UltraScaleDataModule,
    UltraScaleStrategy,
)
from lightning_ultrascale.data.corpus import load_default_corpus_tokens  # noqa: E402
from lightning_ultrascale.data.datasets import PackedDataset  # noqa: E402
from lightning_ultrascale.models import build_model, get_model_config  # noqa: E402
from lightning_ultrascale.models.common.moe import GroupedExperts, MoEConfig  # noqa: E402
from lightning_ultrascale.models.llama import Llama  # noqa: E402
from lightning_ultrascale.parallel.dims import ParallelDims  # noqa: E402
from lightning_ultrascale.parallel.layout import Layout  # noqa: E402
from lightning_ultrascale.parallel.mesh import build_mesh  # noqa: E402
from lightning_ultrascale.testing import run_workers  # noqa: E402
from lightning_ultrascale.testing.parity import QUIET_TRAINER  # noqa: E402
from lightning_ultrascale.testing.timing import Alternation, PairedRatio, fit_tokens_per_s  # noqa: E402
from lightning_ultrascale.utils.comm import CommTracer  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "expert.json"
MODEL = get_model_config("moe_tiny")
MOE: MoEConfig = MODEL.moe  # type: ignore[assignment]
FP32 = 4
EXCHANGES = ("forward_dispatch", "forward_combine", "backward_combine", "backward_dispatch")
#: The router skew: ``SKEW x`` the unit mean router input added to these experts' router rows.
SKEW = 0.5
SKEW_EXPERTS = (0, 2)
CALIBRATION_SEQUENCES = 8
THRESHOLD = 1.3
WINDOW = 10
#: The library's AdamW and cosine schedule (down to 0.1 x lr at the last step), without warm-up.
ADAMW = OptimConfig(name="adamw", lr=3e-3, warmup_steps=0)
GEMM_TOL = {"rtol": 1e-4, "atol": 1e-5}


def _sequences(seq_len: int, first: int, n: int) -> tuple[Tensor, Tensor]:
    """Sequences ``first .. first + n - 1`` of the bundled corpus: ``(input_ids, labels)``, each ``[n, seq_len]``."""
    data = PackedDataset(load_default_corpus_tokens(), seq_len)
    items = [data[i] for i in range(first, first + n)]
    return torch.stack([i["input_ids"] for i in items]), torch.stack([i["labels"] for i in items])


# ----------------------------------------------------------------------------- the router skew (1 and 5)
@torch.no_grad()
def skew_router(model: Llama, strength: float = SKEW, experts: tuple[int, ...] = SKEW_EXPERTS) -> None:
    """Add ``strength x`` the unit mean router input (calibration batch) to ``experts``' router rows, every MoE block.

    The same calibration tokens on every rank, so every rank skews its (replicated) router alike.
    """
    tokens, _ = _sequences(128, 0, CALIBRATION_SEQUENCES)
    inputs: dict[str, Tensor] = {}
    hooks = [
        moe.router.register_forward_hook(lambda mod, args, out, name=name: inputs.__setitem__(name, args[0]))
        for name, moe in model.moe_layers().items()
    ]
    training = model.training
    model.eval()  # no load counted, no aux loss left behind
    try:
        model(tokens)
    finally:
        model.train(training)
        for hook in hooks:
            hook.remove()
    for name, moe in model.moe_layers().items():
        mean = inputs[name].float().mean(0)
        for e in experts:
            moe.router.weight[e] += strength * mean / mean.norm()


# ----------------------------------------------------------------------------- 1 + 2: bytes (in the workers)
class SplitTracer(CommTracer):
    """A :class:`CommTracer` that also keeps, per all-to-all, the bytes leaving this rank and where it ran.

    ``exchanges[i]`` belongs to ``records[i]``: its phase (forward or backward), the MoE block running
    in forward, the split sizes this rank sends and the bytes of all splits but its own.
    """

    def __init__(self) -> None:
        super().__init__()
        self.exchanges: list[dict[str, Any]] = []
        self.block = ""

    def _record(self, spec: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super()._record(spec, func, args, kwargs)
        record = self.records[-1]
        if record.op != "all_to_all":
            self.exchanges.append({})
            return
        schema = [a.name for a in func._schema.arguments]

        def arg(name: str) -> Any:
            i = schema.index(name)
            return args[i] if i < len(args) else kwargs[name]

        x = arg("input")
        group = dist.distributed_c10d._resolve_process_group(record.group_name)
        me, n = dist.get_rank(group), record.group_size
        rows = x.shape[0]
        splits = [int(s) for s in arg("input_split_sizes")] or [rows // n] * n
        row_bytes = x[0].numel() * x.element_size() if rows else 0
        self.exchanges.append(
            {
                "phase": "backward" if torch._C._current_graph_task_id() != -1 else "forward",
                "block": self.block,
                "kind": "counts" if x.dtype == torch.int64 else "rows",
                "send_splits": splits,
                "remote_bytes": (rows - splits[me]) * row_bytes,
            }
        )


def _param_bytes(model: nn.Module) -> dict[str, int]:
    """This rank's bytes of the routed experts (local shard and global) and of every other parameter."""
    out = {"expert_local": 0, "expert_global": 0, "replicated": 0}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        nbytes = local.numel() * local.element_size()
        if ".experts." in name:
            out["expert_local"] += nbytes
            out["expert_global"] += p.numel() * p.element_size()
            if isinstance(p, DTensor):
                assert p.placements == (Shard(0),), f"{name}: {p.placements}"
        else:
            assert not isinstance(p, DTensor), f"{name} is a DTensor {p.placements}: not replicated"
            out["replicated"] += nbytes
    return out


def ep_worker(ep: int, seq_len: int, micro_batch: int, skewed: bool) -> dict[str, Any]:
    """One forward + backward with ``ExpertParallel(ep)``: parameter bytes, all-to-alls, router choices."""
    model = build_model(MODEL, seed=0).train()
    if skewed:
        skew_router(model)
    if ep > 1:
        dims = ParallelDims(dp_shard=ep, ep=ep)
        ExpertParallel(ep).apply(model, Layout(dims, build_mesh(dims, "cpu")))
    rank = dist.get_rank() if ep > 1 else 0
    inputs, labels = _sequences(seq_len, rank * micro_batch, micro_batch)
    tracer = SplitTracer()
    counts: dict[str, list[int]] = {}

    def enter(name: str) -> Any:
        return lambda *_: setattr(tracer, "block", name)

    def routed(name: str) -> Any:
        def hook(module: nn.Module, args: Any, routing: Any) -> None:
            counts[name] = torch.bincount(routing.experts.flatten(), minlength=MOE.n_routed_experts).tolist()

        return hook

    hooks = []
    for name, moe in model.moe_layers().items():
        hooks.append(moe.register_forward_pre_hook(enter(name)))
        hooks.append(moe.router.register_forward_hook(routed(name)))
    with tracer:
        logits = model(inputs)
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    for hook in hooks:
        hook.remove()
    records = [
        {"op": r.op, "payload_bytes": r.payload_bytes, "wire_bytes": r.wire_bytes, "torch_op": r.torch_op, **x}
        for r, x in zip(tracer.records, tracer.exchanges)
    ]
    return {"params": _param_bytes(model), "records": records, "counts": counts, "tokens": inputs.numel()}


# ----------------------------------------------------------------------------- 1: all-to-all bytes (pure)
def _by_layer(records: list[dict[str, Any]], blocks: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{block: {exchange or "counts": record}}`` of one rank; backward runs the blocks in reverse."""
    out: dict[str, dict[str, dict[str, Any]]] = {b: {} for b in blocks}
    forward = [r for r in records if r["phase"] == "forward"]
    backward = [r for r in records if r["phase"] == "backward"]
    assert all(r["op"] == "all_to_all" for r in records), {r["op"] for r in records}
    for block in blocks:
        mine = [r for r in forward if r["block"] == block]
        assert [r["kind"] for r in mine] == ["counts", "rows", "rows"], f"block {block}: {mine}"
        out[block] |= {"counts": mine[0], "forward_dispatch": mine[1], "forward_combine": mine[2]}
    assert len(backward) == 2 * len(blocks), f"{len(backward)} backward all-to-alls for {len(blocks)} blocks"
    for i, block in enumerate(reversed(blocks)):
        combine, dispatch = backward[2 * i], backward[2 * i + 1]
        # The reverse exchanges send what the forward ones received: the same splits mirrored.
        assert combine["send_splits"] == out[block]["forward_dispatch"]["send_splits"], block
        assert dispatch["send_splits"] == out[block]["forward_combine"]["send_splits"], block
        out[block] |= {"backward_combine": combine, "backward_dispatch": dispatch}
    return out


def remote_rows(counts: list[list[int]], rank: int) -> tuple[int, int]:
    """(rows ``rank`` routes to other ranks' experts, rows other ranks route to its experts), from router counts.

    ``counts[r][e]``: rows rank ``r`` routes to expert ``e``; rank ``r`` holds experts ``r E/ep .. (r+1) E/ep - 1``.

    Example:
        >>> remote_rows([[3, 1, 0, 2], [1, 1, 4, 0]], 0)   # ep=2, experts 0-1 on rank 0
        (2, 2)
    """
    ep, n = len(counts), len(counts[0])
    local = n // ep
    mine = range(rank * local, (rank + 1) * local)
    out = sum(c for e, c in enumerate(counts[rank]) if e not in mine)
    incoming = sum(counts[r][e] for r in range(ep) if r != rank for e in mine)
    return out, incoming


def comm_table(ep: int, routing: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    blocks = [str(b) for b in MODEL.moe_blocks()]
    tokens = ranks[0]["tokens"]
    k = MOE.top_k
    uniform = tokens * k * MODEL.dim * FP32 * (ep - 1) // ep  # per exchange, T k dim 4 (ep-1)/ep
    layers = []
    for block in blocks:
        counts = [r["counts"][block] for r in ranks]
        per_rank = []
        for rank, result in enumerate(ranks):
            ex = _by_layer(result["records"], blocks)[block]
            out_rows, in_rows = remote_rows(counts, rank)
            local = MOE.n_routed_experts // ep
            computed = sum(c[e] for c in counts for e in range(rank * local, (rank + 1) * local))
            expected = {
                "forward_dispatch": out_rows,
                "backward_combine": out_rows,
                "forward_combine": in_rows,
                "backward_dispatch": in_rows,
            }
            traced = {name: ex[name]["remote_bytes"] for name in EXCHANGES}
            per_rank.append(
                {
                    "rank": rank,
                    "rows_routed_to_remote_experts": out_rows,
                    "rows_received_from_remote_ranks": in_rows,
                    "rows_for_local_experts": computed,
                    "traced_remote_bytes": traced,
                    "expected_remote_bytes": {n: rows * MODEL.dim * FP32 for n, rows in expected.items()},
                    "exact": all(traced[n] == expected[n] * MODEL.dim * FP32 for n in EXCHANGES),
                    "tracer_payload_bytes": sum(ex[n]["payload_bytes"] for n in EXCHANGES),
                    "tracer_wire_bytes": sum(ex[n]["wire_bytes"] for n in EXCHANGES),
                    "traced_total": sum(traced.values()),
                    "counts_exchange": {
                        "payload_bytes": ex["counts"]["payload_bytes"],
                        "remote_bytes": ex["counts"]["remote_bytes"],
                    },
                }
            )
        totals = [r["traced_total"] for r in per_rank]
        computed_rows = [r["rows_for_local_experts"] for r in per_rank]
        layers.append(
            {
                "block": block,
                "per_rank": per_rank,
                "traced_total_mean": sum(totals) / ep,
                "uniform_formula_total": 4 * uniform,
                "ratio_mean": sum(totals) / ep / (4 * uniform),
                "ratio_per_rank": [t / (4 * uniform) for t in totals],
                "dispatch_ratio_per_rank": [r["traced_remote_bytes"]["forward_dispatch"] / uniform for r in per_rank],
                "expert_rows_max_over_mean": max(computed_rows) * ep / sum(computed_rows),
            }
        )
    return {
        "ep": ep,
        "routing": routing,
        "tokens_per_rank": tokens,
        "top_k": k,
        "dim": MODEL.dim,
        "bytes_per_element": FP32,
        "uniform_bytes_per_exchange": uniform,
        "layers": layers,
        "all_exact": all(r["exact"] for layer in layers for r in layer["per_rank"]),
    }


def measure_bytes(eps: tuple[int, ...], seq_len: int, micro_batch: int) -> tuple[list[Any], list[Any]]:
    comm, params = [], []
    for ep in (1, *eps):
        for routing in ("init", "skewed") if ep > 1 else ("init",):
            ranks = run_workers(ep_worker, ep, ep, seq_len, micro_batch, routing == "skewed", timeout_s=300)
            if ep > 1:
                comm.append(comm_table(ep, routing, ranks))
            if routing == "init":
                p = ranks[0]["params"]
                assert all(r["params"] == p for r in ranks), "ranks hold different bytes"
                params.append({"ep": ep, **p})
    expected_global = len(MODEL.moe_blocks()) * MOE.n_routed_experts * MOE.expert_params(MODEL.dim) * FP32
    for row in params:
        assert row["expert_global"] == expected_global, (row, expected_global)
        row["expected_expert_local"] = expected_global // row["ep"]
        row["expert_ratio"] = row["expert_local"] / row["expected_expert_local"]
        row["replicated_ratio_to_ep1"] = row["replicated"] / params[0]["replicated"]
        row["total"] = row["expert_local"] + row["replicated"]
    return comm, params


# ----------------------------------------------------------------------------- 3: speed
def speed_worker(ep: int, steps: int, seq_len: int, micro_batch: int) -> float:
    strategy = UltraScaleStrategy(*([ExpertParallel(ep)] if ep > 1 else []))
    return fit_tokens_per_s(LlamaModule(MODEL, optim=ADAMW), strategy, devices=2, steps=steps, seq_len=seq_len,
                            micro_batch=micro_batch, data_ranks=2)  # fmt: skip


def _measure(ep: int, steps: int, seq_len: int, micro_batch: int) -> float:
    return run_workers(speed_worker, 2, ep, steps, seq_len, micro_batch, timeout_s=600)[0]


def measure_speed(steps: int, rounds: dict[str, Any], seq_len: int, micro_batch: int) -> dict[str, Any]:
    """ep=2 against ep=1 in alternated rounds (``testing.timing.Alternation``)."""
    arms = {f"ep={ep}": partial(_measure, ep, steps, seq_len, micro_batch) for ep in (1, 2)}
    alternation = Alternation(arms, baseline="ep=1", **rounds)
    paired = alternation.run()["ep=2"]
    tokens_per_s = {label: statistics.median(v) for label, v in alternation.samples.items()}
    return {
        "processes": 2,
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "global_batch_tokens": 2 * micro_batch * seq_len,
        "steps": steps,
        "rounds": len(paired.ratios),
        "tokens_per_s": tokens_per_s,
        "ratio_ep2_over_ep1": paired.median,
        "paired_ratio": paired.as_dict(),
        "samples": alternation.samples,
    }


# ----------------------------------------------------------------------------- 4: grouped GEMM vs loop
def _fwd_bwd(experts: GroupedExperts, x: Tensor, counts: Tensor, grad: Tensor) -> tuple[Tensor, ...]:
    experts.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_()
    y = experts(xi, counts)
    y.backward(grad)
    assert xi.grad is not None
    return y.detach(), xi.grad, experts.w1.grad, experts.w2.grad, experts.w3.grad  # type: ignore[return-value]


def gemm_worker(shapes: list[tuple[int, int, int, int]], repeats: int) -> list[dict[str, Any]]:
    rows_out = []
    for n_experts, rows, dim, hidden in shapes:
        gen = torch.Generator().manual_seed(0)
        grouped = GroupedExperts(n_experts, dim, hidden, "grouped_mm")
        for p in grouped.parameters():
            p.data.normal_(0, dim**-0.5, generator=gen)
        loop = GroupedExperts(n_experts, dim, hidden, "loop")
        loop.load_state_dict(grouped.state_dict())
        # A random top-2 routing of rows/2 tokens: uneven counts, rows sorted by expert.
        choice = torch.randn(rows // 2, n_experts, generator=gen).topk(2, dim=-1).indices
        counts = torch.bincount(choice.flatten(), minlength=n_experts)
        x = torch.randn(rows, dim, generator=gen)
        grad = torch.randn(rows, dim, generator=gen)
        results = {"grouped_mm": _fwd_bwd(grouped, x, counts, grad), "loop": _fwd_bwd(loop, x, counts, grad)}
        times: dict[str, list[float]] = {"grouped_mm": [], "loop": []}
        for _ in range(repeats):
            for name, experts in (("grouped_mm", grouped), ("loop", loop)):
                start = time.perf_counter()
                _fwd_bwd(experts, x, counts, grad)
                times[name].append(time.perf_counter() - start)
        a, b = results["grouped_mm"], results["loop"]
        close = True
        for ta, tb in zip(a, b):
            try:
                torch.testing.assert_close(ta, tb, **GEMM_TOL)
            except AssertionError:
                close = False
        grouped_s, loop_s = statistics.median(times["grouped_mm"]), statistics.median(times["loop"])
        rows_out.append(
            {
                "experts": n_experts,
                "rows": rows,
                "dim": dim,
                "hidden": hidden,
                "min_count": int(counts.min()),
                "max_count": int(counts.max()),
                "grouped_mm_ms": 1e3 * grouped_s,
                "loop_ms": 1e3 * loop_s,
                "loop_over_grouped": loop_s / grouped_s,
                "max_abs_diff_output": float((a[0] - b[0]).abs().max()),
                "max_abs_diff_grads": max(float((ta - tb).abs().max()) for ta, tb in zip(a[1:], b[1:])),
                "equal_within_tolerance": close,
            }
        )
    return rows_out


# ----------------------------------------------------------------------------- 5: balancing
class RecordLoads(L.Callback):
    """Skew the router before the first step; after every optimizer step keep the global tokens per expert."""

    def __init__(self) -> None:
        self.loads: list[list[list[float]]] = []
        self.ce: list[float] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert isinstance(pl_module, LlamaModule) and pl_module.model is not None
        skew_router(pl_module.model)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        assert isinstance(pl_module, LlamaModule) and pl_module.expert_stats is not None
        self.loads.append(pl_module.expert_stats.loads.tolist())
        aux = trainer.callback_metrics.get("train/aux_loss")
        self.ce.append(float(outputs["loss"]) - (float(aux) if aux is not None else 0.0))


def balance_worker(moe: MoEConfig, steps: int, seq_len: int, micro_batch: int) -> dict[str, Any]:
    record = RecordLoads()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[record], **QUIET_TRAINER)
    module = LlamaModule(dataclasses.replace(MODEL, moe=moe), optim=ADAMW)
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=seq_len, micro_batch_size=micro_batch))
    return {"loads": record.loads, "ce": record.ce}


def _imbalance(loads: list[list[float]]) -> float:
    """max/mean tokens per expert of the worst block."""
    return max(max(block) / (sum(block) / len(block)) for block in loads)


def stays_below(values: list[float | None], threshold: float = THRESHOLD) -> int | None:
    """The first step from which every value is below ``threshold`` until the end (``None``: never).

    Example:
        >>> stays_below([2.0, 1.2, 1.4, 1.2, 1.1])
        3
        >>> stays_below([None, 1.2, 1.1]), stays_below([1.2, 1.5])
        (1, None)
    """
    settled = None
    for step, v in enumerate(values):
        if v is None or v >= threshold:
            settled = None
        elif settled is None:
            settled = step
    return settled


def balance_summary(name: str, moe: MoEConfig, run: dict[str, Any]) -> dict[str, Any]:
    per_step = [_imbalance(step) for step in run["loads"]]
    trailing: list[float | None] = [None] * (WINDOW - 1)
    trailing += [statistics.mean(per_step[end - WINDOW + 1 : end + 1]) for end in range(WINDOW - 1, len(per_step))]
    settled = stays_below(trailing)
    after = per_step[settled:] if settled is not None else []
    return {
        "method": name,
        "aux_loss": moe.aux_loss,
        "aux_loss_coeff": moe.aux_loss_coeff if moe.aux_loss != "none" else 0.0,
        "bias_update_rate": moe.bias_update_rate,
        "steps": len(per_step),
        "step0": per_step[0],
        "first_below": next((s for s, v in enumerate(per_step) if v < THRESHOLD), None),
        "stays_below_from": settled,
        "per_step_stays_below_from": stays_below(list(per_step)),
        "fraction_below_after": sum(v < THRESHOLD for v in after) / len(after) if after else None,
        "max_after": max(after) if after else None,
        "final_trailing_mean": trailing[-1],
        "ce_loss_last_20_mean": statistics.mean(run["ce"][-20:]),
        "per_step": per_step,
        "trailing_mean": trailing,
        "final_loads": run["loads"][-1],
    }


def balancing_methods(quick: bool, aux_coeff: float, bias_rate: float) -> dict[str, MoEConfig]:
    def moe(aux: str, coeff: float, rate: float) -> MoEConfig:
        return dataclasses.replace(MOE, aux_loss=aux, aux_loss_coeff=coeff, bias_update_rate=rate)

    methods = {
        "aux_loss": moe("sequence", aux_coeff, 0.0),
        "aux_free_bias": moe("none", MOE.aux_loss_coeff, bias_rate),
        "neither": moe("none", MOE.aux_loss_coeff, 0.0),
        "moe_tiny_defaults": MOE,
    }
    return {"aux_loss": methods["aux_loss"]} if quick else methods


def measure_balancing(
    quick: bool, steps: int, seq_len: int, micro_batch: int, aux_coeff: float, bias_rate: float
) -> dict[str, Any]:
    methods = balancing_methods(quick, aux_coeff, bias_rate)
    rows = []
    for name, moe in methods.items():
        run = run_workers(balance_worker, 1, moe, steps, seq_len, micro_batch, timeout_s=900)[0]
        rows.append(balance_summary(name, moe, run))
    return {
        "skew": SKEW,
        "skew_experts": list(SKEW_EXPERTS),
        "threshold": THRESHOLD,
        "window_steps": WINDOW,
        "steps": steps,
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "tokens_per_step": seq_len * micro_batch,
        "optimizer": dataclasses.asdict(ADAMW),
        "data": "bundled corpus (UltraScaleDataModule, seed 0)",
        "methods": rows,
    }


# ----------------------------------------------------------------------------- printing
def _step(s: int | None) -> str:
    return "never" if s is None else str(s)


def print_comm(comm: list[dict[str, Any]]) -> None:
    print(
        f"All-to-all bytes per MoE layer per training step (forward + backward), {MODEL.name}, fp32,"
        f" T = {comm[0]['tokens_per_rank']} tokens per rank, top-{MOE.top_k}, dim {MODEL.dim}"
    )
    print(
        f"{'ep':>2} {'routing':<7} {'block':>5} {'rank':>4} {'R_out':>5} {'R_in':>5} {'fwd disp':>8} {'fwd comb':>8} "
        f"{'bwd comb':>8} {'bwd disp':>8} {'total':>8} {'uniform':>8} {'ratio':>5} {'disp':>5} {'exact':>5} "
        f"{'Tracer wire':>11} {'counts':>6}"
    )
    for row in comm:
        for layer in row["layers"]:
            for r in layer["per_rank"]:
                t, rank = r["traced_remote_bytes"], r["rank"]
                print(
                    f"{row['ep']:>2} {row['routing']:<7} {layer['block']:>5} {rank:>4} "
                    f"{r['rows_routed_to_remote_experts']:>5} {r['rows_received_from_remote_ranks']:>5} "
                    + " ".join(f"{t[n]:>8,}" for n in EXCHANGES)
                    + f" {r['traced_total']:>8,} {layer['uniform_formula_total']:>8,}"
                    f" {layer['ratio_per_rank'][rank]:>5.2f} {layer['dispatch_ratio_per_rank'][rank]:>5.2f}"
                    f" {'yes' if r['exact'] else 'NO':>5} {r['tracer_wire_bytes']:>11,}"
                    f" {r['counts_exchange']['remote_bytes']:>6}"
                )
    print(
        "(R_out: this rank's (token, expert) rows routed to experts on other ranks; R_in: rows other ranks route"
        "\n to this rank's experts; both counted from the routers' choices. Bytes: the splits leaving the rank, traced."
        "\n exact: dispatch and the combine's gradient sent R_out x dim x 4 bytes, combine and the dispatch's gradient"
        "\n R_in x dim x 4, to the byte. uniform: 4 x T k dim 4 (ep-1)/ep; ratio: total / uniform; disp: forward"
        "\n dispatch / T k dim 4 (ep-1)/ep. Tracer wire: CommTracer's (ep-1)/ep of the payloads handed to the four"
        "\n all-to-alls, the uniform estimate. counts: bytes of the row-count exchange leaving the rank, forward only)"
    )
    print(
        f"\n{'ep':>2} {'routing':<7} {'ratio, mean over ranks':>22} {'per rank':>9} {'disp per rank':>13} "
        f"{'expert rows max/mean':>20}"
    )
    for row in comm:
        mean = statistics.mean(layer["ratio_mean"] for layer in row["layers"])
        ratios = [v for layer in row["layers"] for v in layer["ratio_per_rank"]]
        disp = [v for layer in row["layers"] for v in layer["dispatch_ratio_per_rank"]]
        rows = max(layer["expert_rows_max_over_mean"] for layer in row["layers"])
        print(
            f"{row['ep']:>2} {row['routing']:<7} {mean:>22.3f} {f'{min(ratios):.2f}-{max(ratios):.2f}':>9} "
            f"{f'{min(disp):.2f}-{max(disp):.2f}':>13} {rows:>20.2f}"
        )
    print(
        "(per rank, disp per rank: the range over ranks and blocks; expert rows: rows a rank's experts run, worst"
        "\n block: what the slowest rank computes, over the mean)"
    )


def print_params(params: list[dict[str, Any]]) -> None:
    print(f"\nParameter bytes per rank, fp32, {MODEL.name} ({MODEL.num_params():,} parameters)")
    print(f"{'ep':>2} {'experts B':>10} {'E/ep experts B':>14} {'ratio':>6} {'replicated B':>13} {'total B':>10}")
    for row in params:
        print(
            f"{row['ep']:>2} {row['expert_local']:>10,} {row['expected_expert_local']:>14,} "
            f"{row['expert_ratio']:>6.3f} {row['replicated']:>13,} {row['total']:>10,}"
        )
    print("(experts: w1, w2, w3 of every MoE block; replicated: attention, norms, dense block, router, shared expert)")


def print_speed(speed: dict[str, Any]) -> None:
    print(
        f"\nTokens/s, 2 processes, b={speed['micro_batch']} per rank, s={speed['seq_len']}, medians of "
        f"{speed['rounds']} alternated rounds of {speed['steps']} steps (CPU, gloo: says little about GPUs)"
    )
    for label, value in speed["tokens_per_s"].items():
        print(f"{label:<5} {value:>10,.0f}")
    paired = speed["paired_ratio"]
    print(PairedRatio.of("ep=2/ep=1", paired["ratios"], paired["ci_level"]).describe())


def print_gemm(gemm: list[dict[str, Any]], repeats: int) -> None:
    print(f"\nGroupedExperts forward + backward, one process, fp32, median of {repeats}")
    print(
        f"{'E':>3} {'rows':>6} {'dim':>4} {'hidden':>6} {'counts':>9} {'grouped ms':>10} {'loop ms':>8} "
        f"{'loop/grouped':>12} {'max |diff| out':>14} {'grads':>8} {'equal':>5}"
    )
    for r in gemm:
        counts = f"{r['min_count']}-{r['max_count']}"
        print(
            f"{r['experts']:>3} {r['rows']:>6} {r['dim']:>4} {r['hidden']:>6} {counts:>9} {r['grouped_mm_ms']:>10.2f} "
            f"{r['loop_ms']:>8.2f} {r['loop_over_grouped']:>12.2f} {r['max_abs_diff_output']:>14.1e} "
            f"{r['max_abs_diff_grads']:>8.1e} {'yes' if r['equal_within_tolerance'] else 'NO':>5}"
        )


def print_balancing(bal: dict[str, Any]) -> None:
    opt = bal["optimizer"]
    print(
        f"\nLoad imbalance: max/mean tokens per expert, worst of {len(MODEL.moe_blocks())} MoE blocks, each step;"
        f" router skewed towards\nexperts {bal['skew_experts']} (strength {bal['skew']}); {bal['steps']} steps of"
        f" AdamW lr {opt['lr']:g} (cosine to {opt['min_lr_ratio']:g} x, no warm-up), b={bal['micro_batch']} x"
        f" s={bal['seq_len']} = {bal['tokens_per_step']} tokens a step, one process"
    )
    print(
        f"{'method':<18} {'aux coeff':>9} {'bias rate':>9} {'step 0':>6} {'first <1.3':>10} {'stays <1.3':>10} "
        f"{'strictly':>8} {'<1.3 after':>10} {'max after':>9} {'final mean':>10} {'CE last 20':>10}"
    )
    for r in bal["methods"]:
        frac, peak = r["fraction_below_after"], r["max_after"]
        print(
            f"{r['method']:<18} {r['aux_loss_coeff']:>9g} {r['bias_update_rate']:>9g} {r['step0']:>6.2f} "
            f"{_step(r['first_below']):>10} {_step(r['stays_below_from']):>10} "
            f"{_step(r['per_step_stays_below_from']):>8} {'-' if frac is None else f'{frac:.0%}':>10} "
            f"{'-' if peak is None else f'{peak:.2f}':>9} {r['final_trailing_mean']:>10.3f} "
            f"{r['ce_loss_last_20_mean']:>10.3f}"
        )
    every = max(1, bal["steps"] // 20)
    print(f"\nmax/mean, mean over steps s-{WINDOW - 1}..s, at s = {WINDOW - 1}, {WINDOW - 1 + every}, ...")
    for r in bal["methods"]:
        print(f"{r['method']:<18} " + " ".join(f"{v:.2f}" for v in r["trailing_mean"][WINDOW - 1 :: every]))
    print(
        f"(stays <1.3: the first step from which the mean of the last {WINDOW} per-step values is below 1.3 at every"
        "\n later step; strictly: the same for the per-step value itself; <1.3 after / max after: the per-step"
        "\n values from the 'stays' step on. aux_loss: sequence-wise, no bias update; aux_free_bias: no aux loss;"
        f"\n moe_tiny_defaults: sequence aux {MOE.aux_loss_coeff:g} and bias rate {MOE.bias_update_rate:g} together."
        "\n CE: the cross-entropy alone, mean of the last 20 steps)"
    )


# ----------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="ep=2 only, a few steps, one GEMM shape, one balancing method (smoke test)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    quick = args.quick
    eps = (2,) if quick else (2, 4)
    comm_seq, comm_batch = (32, 2) if quick else (128, 4)
    steps, speed_seq, speed_batch = (4, 32, 2) if quick else (20, 128, 8)
    rounds = {"min_rounds": 1, "max_rounds": 1} if quick else {"min_rounds": 6, "max_rounds": 30, "max_seconds": 360}
    gemm_shapes = (
        [(8, 512, 64, 64)]
        if quick
        else [(8, 2048, 64, 64), (8, 8192, 128, 256), (32, 8192, 128, 128), (64, 16384, 256, 256)]
    )
    gemm_repeats = 1 if quick else 7
    bal_steps, bal_seq, bal_batch = (WINDOW, 16, 4) if quick else (400, 64, 32)
    aux_coeff, bias_rate = (0.1, 0.01) if quick else (0.1, 0.003)

    comm, params = measure_bytes(eps, comm_seq, comm_batch)
    speed = measure_speed(steps, rounds, speed_seq, speed_batch)
    gemm = run_workers(gemm_worker, 1, gemm_shapes, gemm_repeats, timeout_s=900)[0]
    balancing = measure_balancing(quick, bal_steps, bal_seq, bal_batch, aux_coeff, bias_rate)
    print_comm(comm)
    print_params(params)
    print_speed(speed)
    print_gemm(gemm, gemm_repeats)
    print_balancing(balancing)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "expert",
        "quick": quick,
        "device": "CPU, gloo",
        "torch": torch.__version__,
        "model": dataclasses.asdict(MODEL),
        "comm": comm,
        "params": params,
        "speed": speed,
        "grouped_gemm": gemm,
        "balancing": balancing,
    }
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
