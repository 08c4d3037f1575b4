"""ContextParallel: the playbook's context parallelism, long sequences split over the ``cp`` mesh dim.

Every rank of a ``cp`` group reads the same samples (the sampler shards by data-parallel
coordinates only); the step runner passes each batch through this plugin's transform (the
Layout's ``batch_transforms``), which keeps this rank's part of the sequence: tokens, labels and
their positions (RoPE follows the tokens, so a zig-zag chunk at the end of the sequence is
rotated as the end). Everything in the model is per token except
attention, which is swapped for ring, zig-zag ring or all-to-all attention
(``attention.py``). The loss on a rank is the mean over its tokens; every rank has the
same number with packed data, so the gradient average over ``dp x cp`` (the data-parallel plugin
reduces over the ``dp_cp`` mesh, FSDP shards over ``dp_shard x cp``) is the mean over the whole
sequence; with ignored labels the strategy weights each rank by its tokens (``utils/loss.py``).

=================  ==========================================  ===================================
method             traffic per attention layer and rank         constraint
=================  ==========================================  ===================================
``ring``           (cp-1) K/V blocks forward, 2x backward        sequence divisible by cp; rank
                   (+ dK/dV in fp32)                             cp-1 computes cp x rank 0's work
``zigzag_ring``    the same                                      sequence divisible by 2 cp; balanced
``all_to_all``     4 all-to-alls forward (q, k, v, out), 4 back  heads (per tp rank) divisible by cp
=================  ==========================================  ===================================
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_ultrascale.errors import ConfigError, divisors, nearby_multiples, option, require_positive_int
from lightning_ultrascale.models.common.decoder import MTP_KEYS, mtp_targets
from lightning_ultrascale.models.contract import check_batch
from lightning_ultrascale.models.spec import (
    ModelSpec,
    SequenceSplit,
    SequenceStatistics,
    SwappableAttention,
    declares,
    require_spec,
)
from lightning_ultrascale.parallel.context.attention import KERNELS, METHODS, attention_fn, local_positions
from lightning_ultrascale.parallel.context.positions import PositionProbe
from lightning_ultrascale.parallel.dims import DataShape, ParallelDims
from lightning_ultrascale.parallel.layout import Layout
from lightning_ultrascale.parallel.plugin import ParallelPlugin
from lightning_ultrascale.parallel.pricing import (
    CostTerms,
    PlanAxis,
    RankView,
    SearchContext,
    SearchPoint,
    powers_of_two,
)

#: Batch entries cut along the sequence (dim 1). ``document_ids`` stay whole: ring and all-to-all
#: attention read every rank's documents from them (see ``attention.py``: the ring's plan).
SEQUENCE_KEYS = ("input_ids", "labels", "position_ids")


class ContextParallel(ParallelPlugin):
    """Context parallelism: each of ``size`` ranks holds ``1/size`` of every sequence.

    Args:
        size: context-parallel ranks (``cp``).
        method: ``"zigzag_ring"`` (default: ring attention with the load-balanced zig-zag split),
            ``"ring"`` (contiguous split: simplest, causal work unbalanced) or ``"all_to_all"``
            (Ulysses: heads scattered, sequence gathered around attention).
        kernel: the ring's local attention kernel: ``"flash"`` (default: torch's fused attention
            for the device, with its LSE: O(block) memory) or ``"reference"`` (exact fp32 matmuls,
            O(block^2) memory: for tests).

    Example:
        >>> from lightning_ultrascale import ContextParallel, UltraScaleStrategy, ZeRO
        >>> strategy = UltraScaleStrategy(ContextParallel(4, "zigzag_ring"), ZeRO(stage=3))
    """

    applies_at = "context"
    plan_order = 30
    plan_names = ("cp", "cp_method")
    #: the shortest sequence chunk the planner gives a context-parallel rank
    plan_min_chunk = 1024

    def __init__(self, size: int, method: str = "zigzag_ring", kernel: str = "flash") -> None:
        require_positive_int(self, "size", size)
        if method not in METHODS:
            raise ConfigError(f"{option(self, 'method', method)} is unknown; valid: {', '.join(METHODS)}")
        if kernel not in KERNELS:
            raise ConfigError(f"{option(self, 'kernel', kernel)} is unknown; valid: {', '.join(KERNELS)}")
        self.size = size
        self.method = method
        self.kernel = kernel
        self._tp = 1
        self._mtp_depth = 0  # the model's multi-token prediction: its shifted tokens are cut like the tokens
        self._rank = 0
        self._probe: PositionProbe | None = None  # the first batch's positions: did the model read them?
        self._probed = False
        self._index: dict[tuple[int, torch.device], torch.Tensor] = {}

    @property
    def active(self) -> bool:
        return self.size > 1

    def mesh_sizes(self) -> dict[str, int | None]:
        return {"cp": self.size}

    def settings(self) -> dict[str, Any]:
        return {"method": self.method, "kernel": self.kernel}

    def validate(self, dims: ParallelDims, spec: ModelSpec, data: DataShape | None) -> None:
        if self.size > 1 and self.method == "all_to_all":
            heads = spec.n_heads // dims.tp
            if heads % self.size:
                raise ConfigError(
                    f"{option(self, 'size', self.size)} with {option(self, 'method', self.method)} must divide the "
                    f"heads per tensor-parallel rank, n_heads / tp = {spec.n_heads} / {dims.tp} = {heads}; valid cp: "
                    f"{', '.join(map(str, divisors(heads)))} (or {option(self, 'method', 'zigzag_ring')})"
                )
        if data is not None:
            self.validate_sequence(data, dims.tp)

    def validate_sequence(self, data: DataShape, tp: int) -> None:
        """The sequence must split into this method's chunks, each split over ``tp`` once more under SP."""
        if self.size == 1:
            return
        chunks = 2 * self.size if self.method == "zigzag_ring" else self.size
        multiple = chunks * tp
        if data.seq_len % multiple:
            why = f"2 x cp = {chunks} zig-zag chunks" if self.method == "zigzag_ring" else f"cp = {chunks} parts"
            if tp > 1:
                why += f", each split over tp = {tp}"
            raise ConfigError(
                f"{data.option('seq_len')} must be divisible by {multiple} for {option(self, 'size', self.size)} "
                f"with {option(self, 'method', self.method)} ({why}); valid nearby: "
                f"{nearby_multiples(data.seq_len, multiple)}"
            )

    @classmethod
    def plan_axes(cls, context: SearchContext) -> tuple[PlanAxis, ...]:
        """Powers of two up to 8 that leave each rank at least :attr:`plan_min_chunk` tokens."""
        seq_len = context.workload.seq_len
        sizes = tuple(c for c in powers_of_two(8) if c == 1 or seq_len // c >= cls.plan_min_chunk)
        return (PlanAxis("cp", sizes, splits_world=True),)

    @classmethod
    def plan_plugin(cls, point: SearchPoint) -> ContextParallel | None:
        size = point.get("cp", 1)
        return cls(size, method=point.get("cp_method", "zigzag_ring")) if size > 1 else None

    def plan_label(self, dims: ParallelDims) -> str:
        return f"cp{self.size}({self.method})" if self.size > 1 else ""

    def plan_facts(self, dims: ParallelDims) -> dict[str, Any]:
        return {"cp": self.size, "cp_method": self.method}

    def plan_cost(self, rank: RankView) -> CostTerms:
        """The all-to-all of q, k, v and the output, or the ring's K/V (and dK/dV) sends, every attention.

        In the step (each microbatch waits for its attention). Ring attention overlaps each K/V exchange
        with the attention of the block the rank holds, and only with it: the q/k/v projections run
        before the ring starts, the output projection and the MLP after it ends (``hidden_by_attention``;
        it was priced as hidden behind half the step's compute, which at 8k tokens is about five times
        the attention's). The all-to-all's exchanges wait before and after the attention: nothing hides them.
        """
        terms = CostTerms(host="context")
        s, e, t = rank.widths, rank.element_bytes, rank.tokens
        layers, m = len(rank.layers), rank.forwards
        if self.method == "all_to_all":
            # q and the output at every head, k and v at their own heads (repeated after the exchange)
            q_k_v_o = t * (s.heads * (s.head_dim + s.v_head_dim) + s.kv_heads * (s.head_dim + s.v_head_dim)) / s.tp * e
            # (forward: q, k, v and the output, a call each; backward their reverses)
            terms.add("cp", "all_to_all", 2 * q_k_v_o * layers * m, calls=8 * layers * m)
            return terms
        terms.hidden_by_attention = 1.0
        kv = t * s.kv_heads / s.tp * (s.head_dim + s.v_head_dim)
        # forward: K/V to the next rank cp-1 times; backward: K/V again, and the dK/dV accumulators cp times, in fp32.
        sends = (2 * (self.size - 1) * e + self.size * 4) * kv * layers * m
        calls = (2 * (self.size - 1) + self.size) * layers * m  # (K and V in one launch, dK and dV in another)
        terms.add("cp", "send", sends, calls=calls)
        terms.add("cp", "recv", sends, calls=calls)
        return terms

    def apply(self, model: nn.Module, layout: Layout) -> nn.Module:
        spec = require_spec(model)
        cp_mesh = layout.mesh["cp"]
        self._rank = cp_mesh.get_local_rank()
        self._index = {}
        self._tp = layout.dims.tp
        self._mtp_depth = spec.mtp_depth
        fn = self._noting_forwards(attention_fn(self.method, cp_mesh.get_group(), self.kernel))
        for block in model.get_submodule(spec.layers).values():
            attention = block.get_submodule(spec.attention)
            if not declares(attention, SwappableAttention):
                raise TypeError(
                    f"{type(attention).__name__} has no attention_fn(q, k, v) to replace; context parallelism "
                    "swaps it for ring / all-to-all attention (see models/common/decoder.py Attention)"
                )
            attention.attention_fn = fn
        # Modules with per-sequence statistics (MoE balancing counts and capacity) count them over
        # the whole sequence, whichever of its chunks they hold.
        split = self.sequence_split(cp_mesh.get_group(), self._rank)
        for module in model.modules():
            if declares(module, SequenceStatistics):
                module.sequence_split = split
        layout.batch_transforms.append(self.shard_batch)
        return model

    def sequence_split(self, group: Any, rank: int) -> SequenceSplit:
        """The chunks each ``cp`` rank holds (all-to-all holds the ring's contiguous split outside attention)."""
        if self.method == "zigzag_ring":
            held = tuple((r, 2 * self.size - 1 - r) for r in range(self.size))
            return SequenceSplit(group, rank, 2 * self.size, held)
        return SequenceSplit(group, rank, self.size, tuple((r,) for r in range(self.size)))

    def shard_batch(self, batch: Any) -> Any:
        """This rank's tokens, labels and positions of a batch every rank of its ``cp`` group received."""
        if self.size == 1:
            return batch
        check_batch(batch, repr(self))  # a batch it cannot split would train unsplit, silently wrong
        tokens = batch["input_ids"]
        seq_len = tokens.shape[1]
        # Checked per batch too: a DataModule that declares no shape is only known here.
        self.validate_sequence(DataShape(seq_len, tokens.shape[0], owner="batch"), self._tp)
        index = self._positions(seq_len, tokens.device)
        out = dict(batch)
        if "position_ids" not in out:
            out["position_ids"] = torch.arange(seq_len, device=tokens.device).expand(tokens.shape[0], -1)
        if self._mtp_depth:  # the tokens and labels k ahead of each position, taken before the cut
            out |= mtp_targets(tokens, batch["labels"], self._mtp_depth)
        for key in SEQUENCE_KEYS + MTP_KEYS:
            if key in out:
                out[key] = out[key].index_select(1, index)
        return self._handshake(out)

    def _positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """This rank's positions on ``device``: built on the host and copied once per length, not per batch."""
        key = (seq_len, device)
        if key not in self._index:
            layout = "ring" if self.method == "all_to_all" else self.method
            self._index[key] = local_positions(layout, seq_len, self.size, self._rank).to(device)
        return self._index[key]

    def _handshake(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Watch the first batch's positions; at a batch after a forward has run (the attention
        reports it), refuse a model that never read them."""
        if self._probed:
            return batch
        if self._probe is None:
            self._probe = PositionProbe()
            return batch | {"position_ids": self._probe.watch(batch["position_ids"])}
        if self._probe.forward_seen:
            self._probe.check(repr(self))
            self._probed = True
        return batch

    def _noting_forwards(self, fn: Any) -> Any:
        """``fn``, telling the position handshake that a forward ran (its RoPE came before)."""

        def attention(*args: Any, **kwargs: Any) -> Any:
            # No read of ``_probed``: it flips after the first step, and inside a compiled block
            # a Python value that changes is a guard that fails (a recompilation).
            if self._probe is not None:
                self._probe.forward_seen = True
            return fn(*args, **kwargs)

        return attention
