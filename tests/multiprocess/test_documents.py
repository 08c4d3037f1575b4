"""Packed documents stay apart: positions restart, attention never crosses a document, in every attention path."""

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from llama_runs import DEEPSEEK_V3_TINY, MOE_TINY, SGD, run_tiny_llama

from lightning_ultrascale import ContextParallel, ExpertParallel, PipelineParallel, Recompute, TensorParallel, ZeRO
from lightning_ultrascale.models import build_model
from lightning_ultrascale.models.common import documents
from lightning_ultrascale.models.common.documents import document_attention, document_mask, document_tiles, memo
from lightning_ultrascale.parallel.context import attention as context_attention
from lightning_ultrascale.parallel.context import parallel as parallel_module
from lightning_ultrascale.parallel.context.attention import FlopCounter, attention_fn, local_positions, ring_plan
from lightning_ultrascale.testing import run_pooled, run_workers
from lightning_ultrascale.testing.parity import assert_parity

LENGTHS = [[5, 9, 1, 17, 3, 13], [48]]  # two windows of 48 tokens: six documents, and one


def _documents(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])


def _positions(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


@pytest.fixture(params=[None, 4], ids=["whole", "tiles-of-4"])
def tiles(request, monkeypatch):
    """The default tile (the tests' windows fit in one), and tiles of 4 rows: many kernel calls per window."""
    if request.param is not None:
        monkeypatch.setattr(documents, "MIN_TILE", request.param)
    return request.param


# ----------------------------------------------------------------------------- one process
@pytest.mark.parametrize("model", ["llama_tiny", "moe_tiny", DEEPSEEK_V3_TINY], ids=["llama", "moe", "mla"])
def test_a_packed_window_gives_each_document_the_losses_it_has_alone(model, tiles):
    net = build_model(model, seed=0)
    tokens = torch.randint(0, net.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    logits = net(tokens, _positions(LENGTHS), document_ids=_documents(LENGTHS))
    packed = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none").view(2, -1)
    worst = 0.0
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for n in lengths:
            alone = net(tokens[row : row + 1, start : start + n])
            losses = F.cross_entropy(alone[0, :-1], tokens[row, start + 1 : start + n], reduction="none")
            if n > 1:
                mine = packed[row, start : start + n - 1]
                worst = max(worst, ((mine - losses).abs() / losses.abs()).max().item())
            start += n
    # The same float32 arithmetic on other shapes: measured 2.4e-7 relative.
    assert worst < 1e-5
    # And it is not what the plain causal window computes: the mask changes every later document.
    plain = net(tokens, _positions(LENGTHS))
    assert not torch.allclose(plain[0, 5:], logits[0, 5:], atol=1e-3)


def test_the_mask_is_causal_and_within_documents():
    docs = torch.tensor([[0, 0, 1, 1, 1, 2]])
    mask = document_mask(docs, docs, causal=True)[0, 0]
    expected = torch.tensor(
        [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0],
         [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    )  # fmt: skip
    assert torch.equal(mask.int(), expected)


def test_tiles_cut_at_document_starts_and_start_their_keys_at_their_first_document():
    docs = _documents([[3, 5, 2, 6], [8, 8]])  # starts at 3, 8, 10 (row 0) and 8 (row 1)
    assert document_tiles(docs, min_rows=1) == [(0, 3, 0), (3, 8, 0), (8, 10, 8), (10, 16, 8)]
    # Row 1's document 0 runs to 8: the tile from 3 needs keys from 0. From 8 on, rows agree.
    assert document_tiles(docs, min_rows=4) == [(0, 8, 0), (8, 16, 8)]
    assert document_tiles(docs, min_rows=100) == [(0, 16, 0)]


def test_host_values_are_computed_once_per_tensor_and_never_reused_for_another():
    calls = []
    a = torch.tensor([[0, 0, 1]])
    assert memo(a, "k", lambda t: calls.append(1) or t.sum().item()) == 1
    assert memo(a, "k", lambda t: calls.append(1) or -1) == 1
    assert len(calls) == 1
    del a
    b = torch.tensor([[0, 1, 2]])  # may reuse a's address: a new object, a new value
    assert memo(b, "k", lambda t: t.sum().item()) == 3


# ----------------------------------------------------------------------------- context parallel
def _cp_attention(method: str, kernel: str, lengths: list[list[int]], v_dim: int) -> tuple[float, int, int]:
    """Max error of this rank's output and q/k/v gradients against one process; its pairs and sends."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    b, seq = len(lengths), sum(lengths[0])
    q = torch.randn(b, 4, seq, 8, generator=gen)
    k = torch.randn(b, 2, seq, 8, generator=gen)
    v = torch.randn(b, 2, seq, v_dim, generator=gen)
    dout = torch.randn(b, 4, seq, v_dim, generator=gen)
    docs = _documents(lengths)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    document_attention(*full, docs).backward(dout)
    index = local_positions("ring" if method == "all_to_all" else method, seq, cp, rank)
    mine = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    context_attention.FLOPS = FlopCounter()
    try:
        out = attention_fn(method, dist.group.WORLD, kernel)(*mine, docs)
        out.backward(dout[:, :, index])
        counted = context_attention.FLOPS
    finally:
        context_attention.FLOPS = None
    expected = document_attention(*(t.detach() for t in full), docs)[:, :, index]
    errors = [(out - expected).abs().max()] + [(m.grad - f.grad[:, :, index]).abs().max() for m, f in zip(mine, full)]
    return max(e.item() for e in errors), counted.pairs, counted.sends


# Every attention path, and MLA's value heads (6) narrower than its query/key heads, in one set of workers per
# (tile, cp): Ulysses always runs torch's SDPA on whole sequences, so it has no kernel of its own.
PATHS = [("ring", "flash"), ("ring", "reference"), ("zigzag_ring", "flash"), ("zigzag_ring", "reference"),
         ("all_to_all", "flash")]  # fmt: skip


def _every_path(lengths: list[list[int]]) -> dict[tuple[str, str, int], float]:
    return {(m, k, v): _cp_attention(m, k, lengths, v)[0] for m, k in PATHS for v in (8, 6)}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("tile", [None, 4], ids=["whole", "tiles-of-4"])
def test_context_parallel_attention_keeps_documents_apart(tile, cp, monkeypatch):
    if tile is not None:
        monkeypatch.setattr(documents, "MIN_TILE", tile)  # the forked ranks inherit it
    ranks = run_pooled(_every_path, cp, [[5, 9, 1, 17, 3, 13, 16], [30, 34]])
    worst = {path: max(rank[path] for rank in ranks) for path in ranks[0]}
    # fp32 against one process's SDPA: measured 1.9e-6 absolute on values of order 1.
    assert len(worst) == 2 * len(PATHS) and max(worst.values()) < 1e-5, worst


def test_a_ring_step_between_blocks_that_share_no_document_sends_and_computes_nothing():
    # Each rank's quarter of both windows is its own documents: no rank needs another's keys.
    aligned = [[16, 16, 16, 16], [8, 8, 16, 16, 16]]
    plan = ring_plan("ring", 4, 16, _documents(aligned))
    assert plan.last == (0, 0, 0, 0)
    assert all(not plan.blocks[r][s] for r in range(4) for s in range(4) if r != s)
    results = run_pooled(_cp_attention, 4, "ring", "flash", aligned, 8)
    assert max(e for e, _, _ in results) < 1e-5
    # Only the causal diagonal block is computed (forward pairs: 4 heads x 2 windows x 16 x 17 / 2),
    # and nothing is sent, forward or backward.
    assert [(p, s) for _, p, s in results] == [(4 * 2 * 16 * 17 // 2, 0)] * 4
    # One document across the whole window: every rank needs every earlier block, as without documents.
    one = ring_plan("ring", 4, 16, _documents([[64], [64]]))
    assert one == ring_plan("ring", 4, 16) and one.last == (3, 2, 1, 0)


def test_zigzag_skips_the_blocks_of_other_documents():
    # Zig-zag rank r holds chunks r and 7 - r of 8: with documents of one chunk (8 tokens) each,
    # a rank needs no other rank's keys.
    chunked = [[8] * 8]
    plan = ring_plan("zigzag_ring", 4, 16, _documents(chunked))
    assert plan.last == (0, 0, 0, 0)
    results = run_pooled(_cp_attention, 4, "zigzag_ring", "flash", chunked, 8)
    assert max(e for e, _, _ in results) < 1e-5 and all(s == 0 for _, _, s in results)

    # Documents of two chunks (16 tokens): rank r's first chunk shares one with its neighbour only.
    def pairs(plan):
        return sum((b.q.stop - b.q.start) * (b.k.stop - b.k.start) for row in plan.blocks for bs in row for b in bs)

    paired = ring_plan("zigzag_ring", 4, 16, _documents([[16] * 4]))
    assert pairs(paired) <= pairs(ring_plan("zigzag_ring", 4, 16)) / 2


def test_a_block_shrinks_to_the_rows_and_keys_of_the_document_it_shares():
    # Ring cp2 over 32 tokens: one document of 6 tokens spans the boundary at 16 (10..21).
    docs = _documents([[10, 12, 10]])
    plan = ring_plan("ring", 2, 16, docs)
    (block,) = plan.blocks[1][0]
    # Rank 1's rows 0..5 (tokens 16..21) against rank 0's keys 10..15: 6 x 6 instead of 16 x 16.
    assert (block.q, block.k) == (slice(0, 6), slice(10, 16))
    results = run_pooled(_cp_attention, 2, "ring", "flash", [[10, 12, 10]], 8)
    assert max(e for e, _, _ in results) < 1e-5


# ----------------------------------------------------------------------------- training parity
# (short_documents: tests/conftest.py)


def _masked(source: str) -> dict[str, Any]:
    return {"source": source, "documents": "mask", "mask_eos_loss": True, "val_fraction": 0.0}


@pytest.fixture(scope="module")
def masked_references(short_documents):
    runs = {}
    for name, model in (("llama", "llama_tiny"), ("mla", DEEPSEEK_V3_TINY), ("moe", MOE_TINY)):
        runs[name] = run_tiny_llama(SGD, steps=3, model=model, data_kwargs=_masked(short_documents))
    return runs


MASKED_LAYOUTS = {
    "tp2": ("llama", lambda: [TensorParallel(2)], 2),
    # (pp2 1f1b: test_accumulated_steps_average_every_labelled_token_once[pp2-acc2], with accumulation.)
    "recompute": ("llama", lambda: [Recompute("full")], 1),
    "cp2-ring": ("llama", lambda: [ContextParallel(2, "ring")], 2),
    "cp2-zigzag": ("llama", lambda: [ContextParallel(2, "zigzag_ring"), Recompute("selective_op")], 2),
    "cp2-all-to-all": ("llama", lambda: [ContextParallel(2, "all_to_all")], 2),
    "mla-cp2": ("mla", lambda: [ContextParallel(2, "zigzag_ring")], 2),
    "ep2xcp2": ("moe", lambda: [ExpertParallel(2), ContextParallel(2)], 2),
    # The ids through compositions: full windows beside sharded heads, microbatched V-schedules.
    "cp2xtp2": ("llama", lambda: [ContextParallel(2), TensorParallel(2)], 4),
    "cp2xpp2": ("llama", lambda: [ContextParallel(2), PipelineParallel(2, "1f1b", 2)], 4),
    "pp2-zbv": ("llama", lambda: [PipelineParallel(2, "zbv", 4)], 2),
    "pp2-dualpipev": ("llama", lambda: [PipelineParallel(2, "dualpipev", 4)], 2),
}
# Gradient accumulation with ignored separator labels: micro-batches hold unequal labelled tokens,
# so only a normaliser over the whole step (not a mean of micro-batch means) matches one process.
ACCUMULATING_LAYOUTS = {
    "one-device-acc2": (lambda: [], 1, 1),
    "dp2-zero1-acc2": (lambda: [ZeRO(stage=1)], 2, 2),
    "cp2-acc2": (lambda: [ContextParallel(2)], 2, 1),
    "pp2-acc2": (lambda: [PipelineParallel(2, "1f1b", 2)], 2, 1),
}


@pytest.mark.parametrize("layout", list(MASKED_LAYOUTS))
def test_training_on_masked_documents_matches_one_process(masked_references, short_documents, layout):
    model_name, plugins, world_size = MASKED_LAYOUTS[layout]
    model = {"llama": "llama_tiny", "mla": DEEPSEEK_V3_TINY, "moe": MOE_TINY}[model_name]
    run = run_tiny_llama(SGD, plugins, world_size, dp=1, steps=3, model=model, data_kwargs=_masked(short_documents))
    # SGD, 3 steps: the suite's parity bound (measured up to 1e-7 relative on these layouts).
    assert_parity(run, masked_references[model_name], rtol=1e-5)


@pytest.mark.parametrize("layout", list(ACCUMULATING_LAYOUTS))
def test_accumulated_steps_average_every_labelled_token_once(masked_references, short_documents, layout):
    plugins, world_size, dp = ACCUMULATING_LAYOUTS[layout]
    run = run_tiny_llama(SGD, plugins, world_size, accumulate=2, dp=dp, steps=3, data_kwargs=_masked(short_documents))
    assert_parity(run, masked_references["llama"], rtol=1e-5)


def test_the_mask_changes_what_is_trained(masked_references, short_documents):
    # The masked reference is not the plain causal run on the same tokens: the parity above can fail.
    plain = run_tiny_llama(SGD, steps=1, data_kwargs={"source": short_documents, "val_fraction": 0.0})
    masked = masked_references["llama"].losses[0]
    assert abs(plain.losses[0] - masked) > 1e-3 * abs(masked)


@pytest.mark.parametrize("layout", ["one-process", "cp2-ring"])
def test_tiled_attention_trains_as_the_whole_window(masked_references, short_documents, layout, monkeypatch):
    monkeypatch.setattr(documents, "MIN_TILE", 8)  # ~8 tiles per 64-token window, in every rank (forked)
    plugins, world_size = (None, 1) if layout == "one-process" else (lambda: [ContextParallel(2, "ring")], 2)
    run = run_tiny_llama(SGD, plugins, world_size, dp=1, steps=3, data_kwargs=_masked(short_documents))
    assert_parity(run, masked_references["llama"], rtol=1e-5)


def _positions_built(layers: int) -> int:
    """How many times the ring built host positions for ``layers`` attention layers of one micro-batch (fwd + bwd)."""
    built = 0
    real = context_attention.local_positions

    def counted(*args: Any) -> torch.Tensor:
        nonlocal built
        built += 1
        return real(*args)

    context_attention.local_positions = counted  # this worker's module only
    docs = _documents(LENGTHS)
    index = local_positions("zigzag_ring", 48, 2, dist.get_rank())
    x = torch.randn(2, 2, 48, 8)[:, :, index].requires_grad_()
    out = x
    for _ in range(layers):
        out = attention_fn("zigzag_ring", dist.group.WORLD, "flash")(out, out, out, docs)
    out.sum().backward()
    return built


def test_the_ring_builds_its_document_positions_once_per_micro_batch_not_per_layer():
    # Each build is a host tensor copied to the device: a blocking host-to-device copy on a GPU. Before:
    # every ring step of every layer, forward and backward (8 builds for one layer, 26 for four).
    for layers in (1, 4):
        # Both ranks' positions, once (on a GPU twice: for the plan's host copy of the ids, and the device's).
        assert run_workers(_positions_built, 2, layers) == [2, 2]


def test_context_parallel_copies_its_positions_to_the_device_once_not_per_batch(monkeypatch):
    built = []
    monkeypatch.setattr(parallel_module, "local_positions", lambda *a: built.append(a) or local_positions(*a))
    plugin = ContextParallel(2, "zigzag_ring")
    for _ in range(3):
        tokens = torch.zeros(2, 16, dtype=torch.long)
        plugin.shard_batch({"input_ids": tokens, "labels": tokens})
    assert built == [("zigzag_ring", 16, 2, 0)]
