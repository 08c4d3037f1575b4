"""What data parallelism (ZeRO 0-3, HSDP) costs one rank: model state, held gradients, traffic.

The same formulas the engines follow (``utils.memory.layout_model_state_bytes`` for the state; the
FSDP re-gather rule of :class:`~lightning_ultrascale.parallel.data.engines.FSDPEngine`), so the
planner and a run agree by construction; ``benchmarks/plan.py`` holds them against traced runs.
"""

from __future__ import annotations

import math
from collections import defaultdict

from lightning_ultrascale.parallel.dims import DATA_DIMS
from lightning_ultrascale.parallel.layout import ShardPlan
from lightning_ultrascale.parallel.muon import muon_matrices
from lightning_ultrascale.parallel.pricing import CostTerms, RankView, dim_name
from lightning_ultrascale.utils.memory import layout_model_state_bytes, one_moment_k, reduces_in_fp32

__all__ = ["data_parallel_cost", "group_numels", "model_state"]

#: Data-parallel traffic overlaps backward, about two thirds of a step's compute.
BACKWARD_SHARE = 2 / 3


def group_numels(plan: ShardPlan) -> dict[tuple[str, ...], list[int]]:
    """Elements of each parameter this rank holds, by the mesh dims its gradient is reduced over."""
    groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for name, shape in plan.shapes.items():
        groups[plan.groups.get(name, DATA_DIMS)].append(math.prod(shape))
    return groups


def model_state(
    plan: ShardPlan,
    zero: int,
    precision: str = "32-true",
    reduce_dtype: str = "fp32",
    groups: dict[tuple[str, ...], list[int]] | None = None,
    muon: dict[str, int] | None = None,
) -> dict[str, int]:
    """Parameters, gradients and optimizer states one rank holds after a step (``model_state_bytes``'s view).

    AdamW's, or with ``muon`` (the parameters Muon takes: name -> logical matrices each) Muon's one
    momentum for those and AdamW's states for the rest (:func:`_model_state_parts` also gives AdamW's share).

    ``plan``: the rank's parameter shards (:func:`~lightning_ultrascale.plan.predict_shards`), so
    tensor, pipeline, expert and ZeRO-3 sharding are already in it; ZeRO 1 and 2 split the flat
    optimizer states (and gradients) of each gradient group over its ranks (rounded up), by the
    engines' formula (``layout_model_state_bytes``: under ``bf16-mixed`` the fp32 master is
    optimizer state). ``groups``: :func:`group_numels` of ``plan`` where the caller has it.
    """
    return _model_state_parts(plan, zero, precision, reduce_dtype, groups, muon)[0]


def _model_state_parts(
    plan: ShardPlan,
    zero: int,
    precision: str,
    reduce_dtype: str,
    groups: dict[tuple[str, ...], list[int]] | None,
    muon: dict[str, int] | None,
) -> tuple[dict[str, int], int]:
    """:func:`model_state`, and the optimizer bytes of AdamW's part of it (its states and step counters)."""
    muon = muon or {}
    params = grads = optimizer = adamw_optimizer = 0
    for dims, numels in (group_numels(plan) if groups is None else groups).items():
        numel = sum(numels)
        mine = [name for name in plan.shapes if plan.groups.get(name, DATA_DIMS) == dims]
        one_moment = sum(math.prod(plan.shapes[name]) for name in mine if name in muon)
        n = math.prod(plan.sizes[d] for d in dims) if zero in (1, 2) else 1  # ZeRO-3's split is in the plan
        for part, k in ((numel - one_moment, None), (one_moment, one_moment_k(precision, zero))):
            if part:
                state = layout_model_state_bytes(part, zero, n, precision, reduce_dtype, k)
                params, grads = params + state.params, grads + state.grads
                optimizer += state.optimizer_states
                adamw_optimizer += state.optimizer_states if k is None else 0
        # AdamW's step counter: one fp32 scalar per tensor it updates (Muon keeps none); ZeRO 1/2
        # update one flat shard per optimizer parameter group (LlamaModule's: matrices decayed, vectors not).
        adamw = [name for name in mine if name not in muon]
        flat = zero in (1, 2) and (n > 1 or precision == "bf16-mixed")
        counters = 4 * (len({len(plan.shapes[name]) >= 2 for name in adamw}) if flat else len(adamw))
        optimizer, adamw_optimizer = optimizer + counters, adamw_optimizer + counters
    return {"params": params, "grads": grads, "optimizer": optimizer}, adamw_optimizer


def unsharded_numel(plan: ShardPlan, zero: int, groups: dict[tuple[str, ...], list[int]] | None = None) -> int:
    """Elements this rank's parameters hold before ZeRO-3 splits them over the data dims."""
    total = 0
    for dims, numels in (group_numels(plan) if groups is None else groups).items():
        n = math.prod(plan.sizes[d] for d in dims if d != "dp_replicate") if zero == 3 else 1
        total += sum(numels) * n
    return total


def data_parallel_cost(rank: RankView, zero: int, reduce_dtype: str, bucket_bytes: int = 25 * 2**20) -> CostTerms:
    """ZeRO ``zero``'s terms on ``rank``: state, held gradients, gathered parameters, traffic (stages 0-2 in
    buckets of ``bucket_bytes``)."""
    w, c, plan = rank.workload, rank.layout, rank.plan
    grad_bytes = 2 if w.precision == "bf16-mixed" and reduce_dtype == "bf16" else 4
    groups = group_numels(plan)  # (once: every term below reads it)
    muon = muon_matrices(plan, rank.spec) if w.optimizer == "muon" else {}
    state, adamw_optimizer = _model_state_parts(plan, zero, w.precision, reduce_dtype, groups, muon)
    unsharded = unsharded_numel(plan, zero, groups)
    fsdp = zero == 3 and math.prod(plan.sizes[d] for d in DATA_DIMS if d != "dp_replicate") > 1
    terms = CostTerms(in_step=False, hidden_by=BACKWARD_SHARE, state=state, host="fsdp" if fsdp else None)
    terms.held_grads = _held_grads(rank, zero, state["grads"], unsharded, grad_bytes)
    compute_b = 2 if w.precision == "bf16-mixed" else 4
    if zero == 3 and c.pp > 1:
        # torch's pipeline stages keep an FSDP module's gathered parameters from its first
        # backward to the step's end (reshard_after_backward=False)
        terms.working = compute_b * unsharded
    elif zero == 3 and rank.layers:  # the gathered parameters of the block running and the next one
        shards = math.prod(plan.sizes[d] for d in DATA_DIMS if d != "dp_replicate")
        per_block = state["params"] // max(1, len(rank.layers)) * shards
        terms.working = 2 * per_block * compute_b // 4  # (gathered in compute_b from fp32 shards)
    # (HSDP all-reduces once a step where FSDP2 holds the micro-steps' sums in fp32: FSDPEngine.no_sync)
    _traffic(terms, rank, zero, grad_bytes, bucket_bytes, reduces_in_fp32(w.precision, reduce_dtype))
    terms.step_bytes = _step_bytes(adamw_optimizer, w.precision, zero)  # (Muon's own passes: muon_cost)
    return terms


def _step_bytes(optimizer_bytes: int, precision: str, zero: int) -> float:
    """Memory traffic of AdamW's step over this rank's ``optimizer_bytes`` of its states.

    Per updated element it reads the weight, gradient and both moments and writes the weight and
    moments (7 fp32 accesses, 28 B per 8 B of moments); with fp32 masters beside bf16 weights
    (``bf16-mixed``, stages 0-2) the master is read and written as the weight, and the bf16
    weight written (30 B per 12 B of master and moments).
    """
    masters = precision == "bf16-mixed" and zero < 3
    return optimizer_bytes * (30 / 12 if masters else 28 / 8)


def _held_grads(rank: RankView, zero: int, grads: int, unsharded: int, grad_bytes: int) -> int:
    """Gradient bytes a rank holds between steps (or micro-steps): static memory, not the backward's."""
    c, accumulation = rank.layout, rank.accumulation
    # ZeRO 0-2 engines keep their gradient buckets between steps (under bf16-mixed on one rank
    # too: the masters' gradients); FSDP2 and a single fp32 rank do not.
    engine = zero < 3 and (c.dp * c.cp > 1 or rank.workload.precision == "bf16-mixed")
    held = grads if engine else 0
    if held == 0 and (accumulation > 1 or c.pp > 1):
        # kept between micro-steps (ZeRO-3: reduce-scattered every micro-step, summed in the shards)
        held = grads
    if c.dp * c.cp > 1 and ((zero == 2 and (accumulation > 1 or c.pp > 1)) or (zero == 3 and c.pp > 1)):
        # Gradients reduced once per step (ZeRO-2 under accumulation, or a pipeline's
        # microbatches) accumulate unsharded until then: ZeRO-2's full buckets; under torch's
        # pipeline stages FSDP2's unsharded fp32 gradients (set_requires_gradient_sync(False)).
        held = (4 if zero == 3 else grad_bytes) * unsharded
    return held


def _traffic(
    terms: CostTerms, rank: RankView, zero: int, grad_bytes: int, bucket_bytes: int, replicas_once: bool = True
) -> None:
    """Gradients and parameters over the data dims (each group its own dims, e.g. experts over edp).

    Reductions overlap backward; parameter all-gathers overlap a forward: ZeRO-1/2's updated
    weights are waited per bucket by the next forward, FSDP prefetches the next block's. Stages 0-2
    make one call per bucket, once a step (gradient accumulation holds the buckets back); FSDP one per
    unit (:func:`_fsdp_units`) and micro-step.
    """
    plan, w = rank.plan, rank.workload
    weight_bytes = 2 if w.precision == "bf16-mixed" else 4
    names: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for name in plan.shapes:
        names[plan.groups.get(name, DATA_DIMS)].append(name)
    for dims, mine in names.items():
        numel = sum(math.prod(plan.shapes[name]) for name in mine)
        live = [d for d in dims if plan.sizes[d] > 1]
        if not live:
            continue
        dim = dim_name(live)
        grad = grad_bytes * numel
        if zero == 3:
            units = _fsdp_units(rank, mine, own=dims != DATA_DIMS)
            _fsdp_traffic(terms, rank, live, numel, grad, units, replicas_once)
            continue
        # (buckets fill with the parameters' own dtype; ZeRO-1/2 key them by the optimizer's param group too)
        decayed = (lambda name: len(plan.shapes[name]) >= 2) if zero else (lambda name: True)
        buckets = _buckets([(math.prod(plan.shapes[n]) * weight_bytes, decayed(n)) for n in mine], bucket_bytes)
        if zero == 0:
            terms.add(dim, "all_reduce", grad, calls=buckets)
        else:
            terms.add(dim, "reduce_scatter", grad, calls=buckets)
            terms.add(dim, "all_gather", weight_bytes * numel, calls=buckets, forward=True)  # the updated weights


def _buckets(params: list[tuple[int, object]], bucket_bytes: int) -> int:
    """How many buckets :func:`~lightning_ultrascale.parallel.data.buckets.plan_buckets` makes of ``params``
    (``(bytes, key)`` in the model's order): walked in reverse, one open bucket per key, closed on overflow.

    Example:
        >>> _buckets([(64, "w"), (16, "b"), (64, "w"), (16, "b"), (64, "w"), (16, "b")], 96)  # (its example)
        4
    """
    closed, open_bytes = 0, {}
    for nbytes, key in reversed(params):
        held = open_bytes.get(key)
        if held is not None and held + nbytes > bucket_bytes:
            closed, held = closed + 1, None
        open_bytes[key] = (held or 0) + nbytes
    return closed + len(open_bytes)


def _fsdp_units(rank: RankView, names: list[str], own: bool) -> int:
    """FSDP units holding ``names`` on ``rank`` (each one gather and one reduction): a group of its own (experts,
    a folded MoE's replicated router and shared experts) one per module holding its parameters directly
    (``engines._owners``); the model's every block, and the root unit of each part holding parameters beside its
    blocks (the embedding's stage, the head's; without a pipeline the model's root)."""
    if own:
        return len({name.rpartition(".")[0] for name in names})
    roots = 1 if rank.layout.pp == 1 else int(rank.first) + int(rank.last)
    return len(rank.layers) + roots


def _fp8_gathered_saving(rank: RankView, live: list[str], numel: int) -> int:
    """Bytes per gather that FP8 all-gather saves: the converted weights travel in 1 byte, not 2 (the workload
    says which: ``Workload.fp8_gathered_numel``, tensorwise FP8 with ``fp8_all_gather``)."""
    if any(d not in DATA_DIMS for d in live):  # a group of its own (experts): not converted
        return 0
    converted = rank.workload.fp8_gathered_numel(rank)
    shards = math.prod(rank.plan.sizes[d] for d in live if d != "dp_replicate")
    return min(converted // shards, numel) * (rank.element_bytes - 1)


def _fsdp_traffic(
    terms: CostTerms, rank: RankView, live: list[str], numel: int, grad: int, units: int, replicas_once: bool
) -> None:
    """FSDP2 gathers every parameter twice (forward, backward; once under a pipeline, which keeps them
    gathered for its microbatches): payload the gathered output; reduce-scatters the unsharded
    gradient (payload its input) every micro-step. (bf16-mixed gathers bf16 copies: FSDP2's
    MixedPrecisionPolicy param_dtype.) HSDP all-reduces the shards' gradients across replicas: once a step
    (``replicas_once``: FSDP2 holds the micro-steps' sums in fp32), else every micro-step.
    The forward's gathers overlap the forward, the backward's (and the reductions) the backward."""
    plan = rank.plan
    shard_dims = [d for d in live if d != "dp_replicate"]
    n = math.prod(plan.sizes[d] for d in shard_dims)
    calls = units * rank.accumulation
    if shard_dims:
        dim = dim_name(shard_dims)
        gathered = (rank.element_bytes * numel - _fp8_gathered_saving(rank, live, numel)) * n * rank.accumulation
        terms.add(dim, "all_gather", gathered, calls=calls, forward=True)
        if rank.layout.pp == 1:
            terms.add(dim, "all_gather", gathered, calls=calls)
        terms.add(dim, "reduce_scatter", grad * n * rank.accumulation, calls=calls)
    if "dp_replicate" in live:
        times = 1 if replicas_once else rank.accumulation
        terms.add("dp_replicate", "all_reduce", grad * times, calls=units * times)
