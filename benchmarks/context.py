"""Context parallelism: activation bytes per rank, attention traffic per layer, causal load balance, longest sequence.

Prints tables and writes ``benchmarks/results/context.json``, for llama_tiny (4 heads, 2 kv heads,
fp32, batch 1) on cp = 1, 2, 4 forked gloo processes, each running one forward and backward of
``ContextParallel(cp, method).apply(model, layout)`` (default ring kernel) on its ``shard_batch`` part of each
sequence:

1. Activation bytes per rank: the distinct storages autograd saves for backward during the forward
   (model and cross-entropy loss; ``saved_tensors_hooks``, parameters excluded), split into what
   the attention function saves, what the loss saves and the rest. Everything outside attention
   is per token, so it divides by cp; ring attention saves its local q, k, v, fp32 out and LSE
   (also S/cp; never the S^2 scores), Ulysses' local SDPA saves h/cp heads of the whole sequence.
2. Bytes each rank sends per attention layer, counted by wrapping ``RingExchange.start`` and
   ``context/comms.py: _all_to_all`` (the chunks that leave the rank), against the playbook's volumes
   with KV = the local block's K+V bytes (kv heads only):
   ring forward (cp-1) KV; backward (cp-1) KV + cp fp32 (dK+dV) accumulators; Ulysses 4 all-to-alls
   of the local q, k, v, out forward and 4 backward, each sending (cp-1)/cp of its bytes (k and v at
   the kv heads when cp divides them, else expanded to every query head first, as the code does).
3. Causal load balance: attention score pairs each rank computes in one forward
   (``context/attention.py: FLOPS``), max / mean over ranks; the sum over ranks must be the causal
   triangle's S(S+1)/2 per head and layer.
4. Longest sequence whose activations (the fitted bytes-per-token line of 1) plus model state
   (16 B per parameter: fp32 weights, gradients and AdamW moments, replicated over cp) fit a
   per-rank budget, rounded down to a multiple of 2 cp.

5. Packed documents (``data.documents=mask``) on a corpus of short documents (lengths drawn from
   an exponential law of mean 64 tokens, one seed): tokens/s of one forward and backward with
   and without the mask, side by side in the same workers (alternating, median of the repeats),
   with the busiest rank's score pairs and the K/V blocks and accumulators it sends. The ring
   skips blocks that share no document; the mask itself costs what the kernel makes it cost.

Sections 1-4 are byte counts: 4 processes on 2 cores say little about speed. Section 5 reports
tokens/s because the point of skipping is time; read its ratios, not its absolute numbers.

    python benchmarks/context.py            # ~15 s on 2 CPU cores
    python benchmarks/context.py --quick    # a smoke run for the test suite: cp=1 and zigzag_ring cp=2, S=32, 64
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any
from unittest import mock

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
import torch.distributed.tensor  # noqa: E402  (imported before forking: testing/spawn.py)
from torch import Tensor  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from lightning_ultrascale import ContextParallel, build_model, get_model_config  # noqa: E402
from lightning_ultrascale.data.datasets import document_positions  # noqa: E402
from lightning_ultrascale.parallel.context import attention as context_attention  # noqa: E402
from lightning_ultrascale.parallel.context import comms as context_comm  # noqa: E402
from lightning_ultrascale.parallel.context.attention import FlopCounter  # noqa: E402
from lightning_ultrascale.parallel.dims import ParallelDims  # noqa: E402
from lightning_ultrascale.parallel.layout import Layout  # noqa: E402
from lightning_ultrascale.parallel.mesh import build_mesh  # noqa: E402
from lightning_ultrascale.parallel.plugin import apply_all  # noqa: E402
from lightning_ultrascale.testing import run_workers  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "context.json"
MODEL = get_model_config("llama_tiny")
BATCH = 1
FP32 = 4
PARTS = ("attention", "loss", "other")
#: (cp, method); cp=1 is the plain model (the plugin leaves it untouched).
LAYOUTS = [(1, "none"), *((cp, m) for cp in (2, 4) for m in context_attention.METHODS)]
BUDGET_BYTES = 64 * 2**20
DOC_MEAN = 64  # mean document length of section 5's corpus
DOC_LAYOUTS = [(1, "none"), (2, "ring"), (2, "zigzag_ring"), (2, "all_to_all"), (4, "zigzag_ring")]
QUICK_LAYOUTS = [(1, "none"), (2, "zigzag_ring")]  # --quick, sections 1-5
STATE_BYTES_PER_PARAM = 16


# ----------------------------------------------------------------------------- meters (in the workers)
def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class SavedForBackward:
    """Bytes of the distinct storages autograd saves while active, by part; parameters excluded."""

    def __init__(self, exclude: list[Tensor]) -> None:
        self.excluded = {p.untyped_storage().data_ptr() for p in exclude}
        self.storages: dict[int, tuple[int, str]] = {}
        self.part = "other"
        # The saved tensors stay alive until backward, so no storage address is reused meanwhile.
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: Tensor) -> Tensor:
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in self.excluded:
            self.storages.setdefault(s.data_ptr(), (s.nbytes(), self.part))
        return t

    @contextlib.contextmanager
    def within(self, part: str) -> Any:
        outer, self.part = self.part, part
        try:
            yield
        finally:
            self.part = outer

    def __enter__(self) -> SavedForBackward:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    def by_part(self) -> dict[str, int]:
        out = dict.fromkeys(PARTS, 0)
        for nbytes, part in self.storages.values():
            out[part] += nbytes
        return out


class SentBytes:
    """Bytes and calls this rank sends through context parallelism's two primitives."""

    def __init__(self) -> None:
        self.calls = self.bytes = 0

    def take(self) -> dict[str, int]:
        out = {"calls": self.calls, "bytes": self.bytes}
        self.calls = self.bytes = 0
        return out

    def patches(self) -> contextlib.ExitStack:
        start, all_to_all = context_comm.RingExchange.start, context_comm._all_to_all
        send_home = context_attention._send_home

        def counted_start(ring: context_comm.RingExchange, *tensors: Tensor, send: bool, recv: bool) -> list[Tensor]:
            self.calls += 1
            self.bytes += sum(_nbytes(t) for t in tensors) if send else 0  # all to the next rank
            return start(ring, *tensors, send=send, recv=recv)

        def counted_send_home(done: dict[int, Any], plan: Any, rank: int, *args: Any) -> Any:
            away = [grads for src, grads in done.items() if src != rank]  # the accumulators that go home
            self.calls += bool(away)
            self.bytes += sum(_nbytes(t) for grads in away for t in grads)  # fp32 here: the compute dtype
            return send_home(done, plan, rank, *args)

        def counted_all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> Tensor:
            chunks = x.chunk(dist.get_world_size(group), dim=scatter_dim)
            self.calls += 1
            self.bytes += sum(_nbytes(c) for i, c in enumerate(chunks) if i != dist.get_rank(group))  # own chunk stays
            return all_to_all(x, scatter_dim, gather_dim, group)

        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(context_comm.RingExchange, "start", counted_start))
        stack.enter_context(mock.patch.object(context_comm, "_all_to_all", counted_all_to_all))
        stack.enter_context(mock.patch.object(context_attention, "_send_home", counted_send_home))
        return stack


def cp_worker(cp: int, method: str, seq_lens: tuple[int, ...]) -> list[dict[str, Any]]:
    """One forward + backward per sequence length; what this rank saved, sent and computed."""
    model = build_model(dataclasses.replace(MODEL, max_seq_len=max(seq_lens)), seed=0)
    plugin = ContextParallel(cp, "zigzag_ring" if method == "none" else method)
    dims = ParallelDims(cp=cp)
    apply_all([plugin], model, Layout(dims, build_mesh(dims, "cpu")))
    saved = SavedForBackward(list(model.parameters()))
    for module in model.modules():
        if hasattr(module, "attention_fn"):
            module.attention_fn = _within(saved, "attention", module.attention_fn)
    sent = SentBytes()
    rows = []
    with sent.patches():
        for seq_len in seq_lens:
            seed = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, MODEL.vocab_size, (BATCH, seq_len + 1), generator=seed)
            batch = plugin.shard_batch({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
            saved.storages.clear()
            context_attention.FLOPS = FlopCounter()
            with saved:
                logits = model(batch["input_ids"], batch.get("position_ids"))
                with saved.within("loss"):
                    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
            forward, pairs = sent.take(), context_attention.FLOPS.pairs
            context_attention.FLOPS = None
            loss.backward()
            model.zero_grad(set_to_none=True)
            rows.append(
                {"seq_len": seq_len, "saved": saved.by_part(), "forward": forward, "backward": sent.take(),
                 "score_pairs": pairs}
            )  # fmt: skip
    return rows


def _within(saved: SavedForBackward, part: str, fn: Any) -> Any:
    def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with saved.within(part):
            return fn(q, k, v)

    return attention


# ----------------------------------------------------------------------------- packed documents
def short_documents(seq_len: int, batch: int) -> tuple[Tensor, Tensor]:
    """``(document_ids, position_ids)`` ``[batch, seq_len]`` of windows packed with short documents."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(batch):
        lengths = torch.empty(seq_len).exponential_(1 / DOC_MEAN, generator=gen).long() + 1
        starts = lengths.cumsum(0).numpy()
        rows.append(document_positions(starts[starts < seq_len], seq_len))  # what the data gives a window
    return torch.stack([r["document_ids"] for r in rows]), torch.stack([r["position_ids"] for r in rows])


def documents_worker(cp: int, method: str, seq_len: int, repeats: int) -> dict[str, Any]:
    """Seconds per forward + backward with and without the document mask; this rank's pairs and sends."""
    model = build_model(dataclasses.replace(MODEL, max_seq_len=seq_len), seed=0)
    plugin = ContextParallel(cp, "zigzag_ring" if method == "none" else method)
    if cp > 1:
        dims = ParallelDims(cp=cp)
        plugin.apply(model, Layout(dims, build_mesh(dims, "cpu")))
    tokens = torch.randint(0, MODEL.vocab_size, (BATCH, seq_len + 1), generator=torch.Generator().manual_seed(0))
    docs, positions = short_documents(seq_len, BATCH)
    plain = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    batches = {"plain": plain, "mask": {**plain, "position_ids": positions, "document_ids": docs}}
    batches = {k: plugin.shard_batch(b) if cp > 1 else b for k, b in batches.items()}
    seconds: dict[str, list[float]] = {"plain": [], "mask": []}
    counts: dict[str, dict[str, int]] = {}
    for repeat in range(repeats + 1):  # the first is a warm-up
        for name in ("plain", "mask") if repeat % 2 else ("mask", "plain"):
            b = batches[name]
            context_attention.FLOPS = FlopCounter()
            if cp > 1:
                dist.barrier()
            start = time.perf_counter()
            logits = model(b["input_ids"], b.get("position_ids"), document_ids=b.get("document_ids"))
            F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten()).backward()
            if cp > 1:
                dist.barrier()
            if repeat:
                seconds[name].append(time.perf_counter() - start)
            counts[name] = {"pairs": context_attention.FLOPS.pairs, "sends": context_attention.FLOPS.sends}
            context_attention.FLOPS = None
            model.zero_grad(set_to_none=True)
    return {"seconds": {k: statistics.median(v) for k, v in seconds.items()}, "counts": counts}


def documents(layouts: list[tuple[int, str]], seq_len: int, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for cp, method in layouts:
        ranks = run_workers(documents_worker, cp, cp, method, seq_len, repeats, timeout_s=600)
        row: dict[str, Any] = {"cp": cp, "method": method, "seq_len": seq_len, "batch": BATCH}
        for name in ("plain", "mask"):
            busiest = max(ranks, key=lambda r: r["counts"][name]["pairs"])
            row[name] = {
                "tokens_per_s": BATCH * seq_len / max(r["seconds"][name] for r in ranks),
                "score_pairs_busiest_rank": busiest["counts"][name]["pairs"],
                "sends_per_rank": [r["counts"][name]["sends"] for r in ranks],
            }
        row["mask_over_plain"] = row["mask"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
        rows.append(row)
    return rows


def print_documents(rows: list[dict[str, Any]]) -> None:
    seq_len = rows[0]["seq_len"]
    print(f"\nPacked short documents (mean {DOC_MEAN} tokens), S={seq_len}, b={BATCH}: one forward + backward")
    print(f"{'layout':<19} {'tokens/s plain':>14} {'masked':>9} {'x':>6} {'pairs plain':>12} {'masked':>10} "
          f"{'sends plain':>14} {'masked':>14}")  # fmt: skip
    for r in rows:
        p, m = r["plain"], r["mask"]
        print(
            f"{_label(r['cp'], r['method']):<19} {p['tokens_per_s']:>14,.0f} {m['tokens_per_s']:>9,.0f} "
            f"{r['mask_over_plain']:>6.2f} {p['score_pairs_busiest_rank']:>12,} {m['score_pairs_busiest_rank']:>10,} "
            f"{p['sends_per_rank']!s:>14} {m['sends_per_rank']!s:>14}"
        )
    print(
        "(pairs: score pairs the busiest rank computes in the ring's blocks (cp=1 and all_to_all run SDPA tile by"
        "\n tile: not counted); sends: K/V blocks and dK/dV accumulators each rank sends, all layers. Masked, attention"
        "\n runs in tiles cut at document starts and the ring drops or shrinks blocks that share no document)"
    )


# ----------------------------------------------------------------------------- formulas (pure)
def expected_sent_per_layer(method: str, cp: int, seq_len: int, rank: int = 0) -> dict[str, int]:
    """The playbook's bytes ``rank`` sends per attention layer, forward and backward.

    Zig-zag: every rank needs every block, so each goes round the whole ring (the playbook's
    volume). Contiguous ring: rank ``r``'s block is needed by ranks ``r+1 .. cp-1`` only, so it
    travels no further: rank ``r < cp-1`` passes ``r + 1`` blocks on (and their accumulators in
    backward), the last rank none, and it sends the ``cp - 1`` finished accumulators home.
    """
    local = BATCH * (seq_len // cp) * MODEL.head_dim * FP32  # one head of the local block
    if method == "all_to_all":
        kv_heads = MODEL.n_kv_heads if MODEL.n_kv_heads % cp == 0 else MODEL.n_heads
        tensors = (2 * MODEL.n_heads + 2 * kv_heads) * local  # q, out, k, v
        each_way = tensors * (cp - 1) // cp
        return {"forward": each_way, "backward": each_way}
    kv = 2 * MODEL.n_kv_heads * local
    if method == "ring":
        passed = rank + 1 if rank < cp - 1 else 0
        home = cp - 1 if rank == cp - 1 else 0
        return {"forward": passed * kv, "backward": passed * 2 * kv + home * kv}
    # Backward: the K/V blocks go round again, and the fp32 dK/dV accumulators a full circle home.
    return {"forward": (cp - 1) * kv, "backward": (cp - 1) * kv + cp * kv}


def fit_line(xs: list[int], ys: list[int]) -> tuple[float, float, float]:
    """Least-squares ``y = a + b x``: ``(a, b, largest relative residual)``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return a, b, max(abs(a + b * x - y) / y for x, y in zip(xs, ys))


# ----------------------------------------------------------------------------- measure + report
def _label(cp: int, method: str) -> str:
    return "cp=1" if cp == 1 else f"{method} cp={cp}"


def measure(
    layouts: list[tuple[int, str]], seq_lens: tuple[int, ...]
) -> dict[tuple[int, str], list[list[dict[str, Any]]]]:
    """``{(cp, method): [rank][seq] rows}``."""
    return {(cp, m): run_workers(cp_worker, cp, cp, m, seq_lens, timeout_s=300) for cp, m in layouts}


def _layouts(rows: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """The (cp, method) pairs measured, in the order measured (cp=1 first)."""
    return list(dict.fromkeys((r["cp"], r["method"]) for r in rows))


def activations(runs: dict[tuple[int, str], Any], seq_lens: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for (cp, method), ranks in runs.items():
        for i, seq_len in enumerate(seq_lens):
            per_rank = [sum(r[i]["saved"].values()) for r in ranks]
            worst = max(range(cp), key=per_rank.__getitem__)
            rows.append(
                {"cp": cp, "method": method, "seq_len": seq_len, "bytes": per_rank[worst],
                 "by_part": ranks[worst][i]["saved"], "per_rank": per_rank}
            )  # fmt: skip
    base = {r["seq_len"]: r for r in rows if r["cp"] == 1}
    for r in rows:
        one = base[r["seq_len"]]
        r["ratio_to_cp1"] = r["bytes"] / one["bytes"]
        r["part_ratio_to_cp1"] = {p: r["by_part"][p] / one["by_part"][p] for p in PARTS}
    return rows


def comm(runs: dict[tuple[int, str], Any], seq_lens: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for (cp, method), ranks in runs.items():
        if cp == 1:
            continue
        for i, seq_len in enumerate(seq_lens):
            expected = [expected_sent_per_layer(method, cp, seq_len, r) for r in range(cp)]
            row: dict[str, Any] = {"cp": cp, "method": method, "seq_len": seq_len}
            for phase in ("forward", "backward"):
                sent = [r[i][phase]["bytes"] for r in ranks]
                assert all(b % MODEL.n_layers == 0 for b in sent), f"{method} cp={cp} {phase}: {sent} B"
                per_rank = [b // MODEL.n_layers for b in sent]
                wanted = [e[phase] for e in expected]
                worst = max(range(cp), key=per_rank.__getitem__)  # the rank that sends most
                row[phase] = {
                    "calls_per_layer": ranks[worst][i][phase]["calls"] / MODEL.n_layers,
                    "bytes_per_layer": per_rank[worst],
                    "expected_bytes_per_layer": wanted[worst],
                    "per_rank_bytes_per_layer": per_rank,
                    "expected_per_rank": wanted,
                    # 1 exactly when every rank sends what its formula says.
                    "ratio": 1.0 if per_rank == wanted else sum(per_rank) / max(sum(wanted), 1) + 1e-3,
                }
            rows.append(row)
    return rows


def load_balance(runs: dict[tuple[int, str], Any], seq_len_index: int, seq_len: int) -> list[dict[str, Any]]:
    causal = BATCH * MODEL.n_heads * MODEL.n_layers * seq_len * (seq_len + 1) // 2
    rows = []
    for (cp, method), ranks in runs.items():
        if method in ("ring", "zigzag_ring"):
            pairs = [r[seq_len_index]["score_pairs"] for r in ranks]
            rows.append(
                {"cp": cp, "method": method, "seq_len": seq_len, "score_pairs_per_rank": pairs,
                 "max_over_mean": max(pairs) * cp / sum(pairs), "sum_over_causal": sum(pairs) / causal}
            )  # fmt: skip
    return rows


def longest_sequences(acts: list[dict[str, Any]]) -> dict[str, Any]:
    state = STATE_BYTES_PER_PARAM * MODEL.num_params()
    rows = []
    for cp, method in _layouts(acts):
        if method == "ring":
            continue  # the same bytes as zigzag_ring
        points = [r for r in acts if (r["cp"], r["method"]) == (cp, method)]
        a, b, residual = fit_line([r["seq_len"] for r in points], [r["bytes"] for r in points])
        longest = int((BUDGET_BYTES - state - a) / b) // (2 * cp) * (2 * cp)
        rows.append(
            {"cp": cp, "method": method, "bytes_per_token": b, "intercept_bytes": a, "fit_max_rel_residual": residual,
             "longest_seq_len": longest}
        )  # fmt: skip
    for r in rows:
        r["ratio_to_cp1"] = r["longest_seq_len"] / rows[0]["longest_seq_len"]
    return {"budget_bytes": BUDGET_BYTES, "model_state_bytes": state, "rows": rows}


def print_tables(acts: Any, sent: Any, balance: Any, longest: Any, seq_lens: tuple[int, ...]) -> None:
    top = seq_lens[-1]
    print(f"Activation bytes per rank saved for backward in one forward ({MODEL.name}, fp32, b={BATCH}, loss included)")
    print(f"{'layout':<19}" + "".join(f"{f'S={s}':>14} {'x cp=1':>6}" for s in seq_lens))
    for cp, method in _layouts(acts):
        cells = [r for r in acts if (r["cp"], r["method"]) == (cp, method)]
        print(f"{_label(cp, method):<19}" + "".join(f"{r['bytes']:>14,} {r['ratio_to_cp1']:>6.3f}" for r in cells))
    print(f"\nThe same at S={top} by part (bytes, x cp=1)")
    print(f"{'layout':<19}" + "".join(f"{p:>12} {'x cp=1':>6}" for p in PARTS))
    for r in acts:
        if r["seq_len"] == top:
            cells = "".join(f"{r['by_part'][p]:>12,} {r['part_ratio_to_cp1'][p]:>6.3f}" for p in PARTS)
            print(f"{_label(r['cp'], r['method']):<19}{cells}")
    print(
        "(attention: what attention_fn saves; loss: cross-entropy's log-softmax; other: the rest, wo's input included."
        f"\n cp=1: SDPA saves k, v expanded to {MODEL.n_heads} heads, and its out, laid out [b, s, h, d], is wo's input"
        f"\n too. ring: k, v at {MODEL.n_kv_heads} kv heads (below 1/cp), fp32 out (laid out [b, s, h, d]: also wo's"
        "\n input) and LSE. all_to_all: SDPA's expanded k, v, and a copy of its out for wo)"
    )

    print(f"\nBytes the busiest rank sends per attention layer, S={top} (measured; every rank checked)")
    print(f"{'layout':<19} {'calls f+b':>9} {'forward':>10} {'expected':>10} {'backward':>10} {'expected':>10} "
          f"{'ratio (all S)':>13}")  # fmt: skip
    for cp, method in _layouts(sent):
        cells = [r for r in sent if (r["cp"], r["method"]) == (cp, method)]
        ratios = [r[p]["ratio"] for r in cells for p in ("forward", "backward")]
        f, b = cells[-1]["forward"], cells[-1]["backward"]
        calls = f"{f['calls_per_layer']:g}+{b['calls_per_layer']:g}"
        print(
            f"{_label(cp, method):<19} {calls:>9} {f['bytes_per_layer']:>10,} {f['expected_bytes_per_layer']:>10,} "
            f"{b['bytes_per_layer']:>10,} {b['expected_bytes_per_layer']:>10,} "
            f"{f'{min(ratios):.3f}-{max(ratios):.3f}':>13}"
        )
    print(
        "(zigzag_ring: forward (cp-1) KV, backward (cp-1) KV + cp fp32 dK+dV; ring: a block goes only as far as a"
        "\n rank needs it, so rank r < cp-1 passes r+1 blocks and the last rank sends cp-1 dK+dV home;"
        "\n all_to_all: q, k, v, out each (cp-1)/cp,"
        f"\n k and v at {MODEL.n_kv_heads} kv heads where cp divides them, else expanded to {MODEL.n_heads} heads)"
    )

    print(f"\nCausal attention score pairs per rank in one forward, S={top}")
    print(f"{'layout':<19} {'pairs per rank':<40} {'max/mean':>8} {'sum/causal':>10}")
    for r in balance:
        pairs = ", ".join(f"{p:,}" for p in r["score_pairs_per_rank"])
        print(
            f"{_label(r['cp'], r['method']):<19} {pairs:<40} {r['max_over_mean']:>8.3f} {r['sum_over_causal']:>10.3f}"
        )

    print(
        f"\nLongest sequence for a per-rank budget of {longest['budget_bytes'] / 2**20:.0f} MiB: activations (line "
        f"fitted over S={', '.join(map(str, seq_lens))})\n + model state {longest['model_state_bytes']:,} B "
        f"({STATE_BYTES_PER_PARAM} B x {MODEL.num_params():,} parameters), rounded down to a multiple of 2 cp"
    )
    print(f"{'layout':<19} {'B/token':>9} {'fit residual':>12} {'longest S':>10} {'x cp=1':>6}")
    for r in longest["rows"]:
        print(
            f"{_label(r['cp'], r['method']):<19} {r['bytes_per_token']:>9,.1f} {r['fit_max_rel_residual']:>12.1e} "
            f"{r['longest_seq_len']:>10,} {r['ratio_to_cp1']:>6.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="cp=1 and zigzag_ring cp=2 only, short sequences (smoke test)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    seq_lens = (32, 64) if args.quick else (256, 512, 1024)

    runs = measure(QUICK_LAYOUTS if args.quick else LAYOUTS, seq_lens)
    acts = activations(runs, seq_lens)
    sent = comm(runs, seq_lens)
    balance = load_balance(runs, len(seq_lens) - 1, seq_lens[-1])
    longest = longest_sequences(acts)
    print_tables(acts, sent, balance, longest, seq_lens)
    docs = documents(QUICK_LAYOUTS if args.quick else DOC_LAYOUTS, 128 if args.quick else 4096, 1 if args.quick else 5)
    print_documents(docs)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "context",
        "quick": args.quick,
        "device": "CPU, gloo",
        "torch": torch.__version__,
        "model": dataclasses.asdict(MODEL),
        "ring_kernel": ContextParallel(2).kernel,
        "micro_batch": BATCH,
        "seq_lens": list(seq_lens),
        "activations": acts,
        "comm": sent,
        "load_balance": balance,
        "longest_seq_len": longest,
        "documents": docs,
    }
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
