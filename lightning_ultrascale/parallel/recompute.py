"""Activation recomputation (gradient checkpointing): trade backward compute for activation memory.

The playbook's section on activation recomputation: a forward pass keeps, for every op, what its
backward needs (inputs of matmuls, norm statistics, the SwiGLU gates, ...), and for long sequences
these activations, not the weights, fill the memory. Recomputation drops some of them in forward
and recomputes them in backward from a few tensors that were kept. The modes follow torchtitan's
``activation_checkpoint`` options:

=================  ================================================  ===============================
mode               kept for backward                                 recomputed in backward
=================  ================================================  ===============================
``"none"``         every activation                                  nothing
``"full"``         each block's inputs only                          each block's whole forward
``"selective"``    the inputs of every ``every``-th block, all the   the forward of every
                   activations of the other blocks                   ``every``-th block
``"selective_op"`` in every block: the outputs of the matmuls,       the cheap ops: norms, RoPE,
                   attention and sequence-parallel reduce-scatters   SiLU, products, additions
=================  ================================================  ===============================

Trade-offs: ``"full"`` cuts a block's activations to its input, at the price of one more forward,
i.e. about +33% step time (the playbook: forward is ~1/3 of forward+backward compute).
``"selective"`` scales between ``"none"`` and ``"full"``: 1/``every`` of the saving at 1/``every``
of the cost. ``"selective_op"`` keeps what is expensive to recompute (the matmul FLOPs, attention)
and drops what is large but cheap (element-wise ops and fp32 norm intermediates), at a few per
cent of step time. The playbook's selective figure (~70% of activations saved for ~2.7% compute
on GPT-3 175B) comes from dropping the attention scores; fused attention (SDPA/flash) never stores
them, so op-level selection saves less here. Measured on llama_tiny (fp32, 2 x 64 tokens, bytes
kept for backward; ``tests/multiprocess/test_recompute.py``): none 3.00 MB, selective every 2 1.62 MB,
selective_op 1.69 MB, full 0.24 MB.

Torchtitan's mapping: ``mode="full"`` -> ``Recompute("full")``; ``mode="selective"`` with
``selective_ac_option="2"`` -> ``Recompute("selective", every=2)``; with ``selective_ac_option="op"``
-> ``Recompute("selective_op")`` (torchtitan additionally recomputes every second ``aten.mm``; we
keep them all, so no matmul is ever recomputed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_ultrascale.errors import ConfigError, is_positive_int, option
from lightning_ultrascale.models.spec import ModelSpec, require_spec
from lightning_ultrascale.parallel.dims import DataShape, ParallelDims
from lightning_ultrascale.parallel.layout import Layout
from lightning_ultrascale.parallel.plugin import ParallelPlugin
from lightning_ultrascale.parallel.pricing import CostTerms, PlanAxis, RankView, SearchContext, SearchPoint

MODES: tuple[str, ...] = ("none", "full", "selective", "selective_op")

#: Ops whose outputs ``"selective_op"`` keeps (torchtitan's ``_save_list``): the matmuls, where the
#: FLOPs are (``nn.Linear`` dispatches to ``mm``/``addmm``; ``_scaled_mm`` is the FP8 matmul), the
#: attention kernels of every SDPA backend (whose output and logsumexp their backward needs), and
#: the reduce-scatter of sequence parallelism, so that backward does not repeat a collective.
SAVED_OPS: tuple[torch._ops.OpOverload, ...] = (
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
)
#: Ops of ours kept like those, by name (registered where they are defined): context parallelism's
#: ring attention, one op whose inner per-block kernels and exchanges selective recomputation
#: must neither keep (cp block outputs per layer) nor run again in backward.
SAVED_OP_NAMES = frozenset({"ultrascale::ring_attention"})


def _keep_matmul_outputs(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if func in SAVED_OPS or (isinstance(func, torch._ops.OpOverload) and func.name() in SAVED_OP_NAMES):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# The op-level policy as a module constant: torch.compile traces a checkpoint whose context_fn is
# a global, but may fail on one that reaches it as an argument of the block's forward (torch 2.13,
# seen with noop_context_fn: "checkpoint not implemented for LazyVariableTracker context_fn").
# Each call makes a fresh pair of SAC contexts, which share the cache of kept outputs.
_KEEP_MATMUL_OUTPUTS = functools.partial(create_selective_checkpoint_contexts, _keep_matmul_outputs)


# Non-reentrant checkpointing in both: it supports keyword arguments, inputs that do not require
# grad (cos/sin), FSDP2's pre-backward hooks (they unshard before the recompute runs) and
# torch.compile; torch deprecates the reentrant variant. RNG-state preservation (the default) is
# kept: a block with dropout recomputes the same mask.
def _recompute_block(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _recompute_block_keeping_matmuls(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_KEEP_MATMUL_OUTPUTS, **kwargs)


def never(layer: int) -> bool:
    """No block is recomputed whole (the planner's default, and ``selective_op``'s)."""
    return False


class Recompute(ParallelPlugin):
    """Activation recomputation of the model's transformer blocks; owns no mesh dim.

    Each chosen block's ``forward`` is replaced, on the instance, by a call through
    :func:`torch.utils.checkpoint.checkpoint`. The module tree is untouched, so parameter names
    (checkpoints, per-name initialisation, parity comparisons) are the same as without
    recomputation, and data-parallel wrapping (FSDP2's ``fully_shard``, applied after this
    plugin) shards the same blocks. A ``CheckpointWrapper`` module would instead insert
    ``_checkpoint_wrapped_module`` into every name below it.

    Args:
        mode: ``"none"``, ``"full"``, ``"selective"`` (every ``every``-th block fully recomputed)
            or ``"selective_op"`` (every block, matmul and attention outputs kept); see the
            module docstring for what each keeps and what it costs.
        every: for ``"selective"``: recompute blocks ``every-1, 2*every-1, ...`` (global layer
            indices, as torchtitan counts, so a pipeline stage recomputes the same blocks as a
            single process). ``every=1`` is ``"full"``.

    Example:
        >>> import lightning as L
        >>> from lightning_ultrascale import UltraScaleStrategy
        >>> from lightning_ultrascale.parallel.recompute import Recompute
        >>> strategy = UltraScaleStrategy(Recompute("selective", every=2))
        >>> trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2)  # doctest: +SKIP
        >>> Recompute("selective_op")
        Recompute(mode='selective_op')
    """

    applies_at = "recompute"
    plan_order = 50
    plan_names = ("recompute", "recompute_every")

    def __init__(self, mode: str = "full", every: int = 1) -> None:
        if mode not in MODES:
            raise ConfigError(f"{option(self, 'mode', mode)} is unknown; valid: {', '.join(MODES)}")
        if not is_positive_int(every):
            raise ConfigError(f"{option(self, 'every', every)} must be an integer >= 1")
        if every != 1 and mode != "selective":
            raise ConfigError(
                f"{option(self, 'every', every)} only applies to {option(self, 'mode', 'selective')}, "
                f"not {mode!r}; leave it at 1"
            )
        self.mode = mode
        self.every = every

    def mesh_sizes(self) -> dict[str, int | None]:
        return {}

    def validate(self, dims: ParallelDims, spec: ModelSpec, data: DataShape | None) -> None:
        if self.every > spec.n_layers:
            raise ConfigError(
                f"{option(self, 'every', self.every)} exceeds n_layers={spec.n_layers} of {spec.name}, "
                f"so no block would be recomputed; valid: 1 .. {spec.n_layers}"
            )

    def validate_with(self, plugins: Sequence[ParallelPlugin]) -> None:
        split = [p for p in plugins if getattr(p, "splits_backward", False)]
        if self.mode == "selective_op" and split:
            raise ConfigError(
                f"{option(self, 'mode', 'selective_op')} cannot run under {split[0]!r}: the schedule splits each "
                "backward in two (input, then weight gradients) and torch's selective checkpointing allows one "
                f"backward per region; valid: {option(self, 'mode', 'full')} or 'selective', or a schedule that "
                "does not split backward (1f1b, interleaved_1f1b, afab, looped_bfs)"
            )

    @classmethod
    def plan_axes(cls, context: SearchContext) -> tuple[PlanAxis, ...]:
        """None, the memory-bound ops, or every block: each saves more memory and costs more time."""
        return (PlanAxis("recompute", ("none", "selective_op", "full"), trades_time_for_memory=True),)

    @classmethod
    def plan_plugin(cls, point: SearchPoint) -> Recompute | None:
        mode = point.get("recompute", "none")
        return None if mode == "none" else cls(mode, every=point.get("recompute_every", 1))

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def plan_label(self, dims: ParallelDims) -> str:
        every = f"/{self.every}" if self.mode == "selective" else ""
        return f"ac:{self.mode}{every}"

    def plan_facts(self, dims: ParallelDims) -> dict[str, Any]:
        whole = self.mode in ("full", "selective")  # (selective_op keeps the matmuls: priced apart)
        recomputes = self.recomputes if whole else never
        return {"recompute": self.mode, "recompute_every": self.every, "recomputes": recomputes}

    def plan_cost(self, rank: RankView) -> CostTerms:
        """The forward again in backward: a third of a recomputed block's work (forward of three
        passes); ``selective_op`` re-runs only the memory-bound ops (norms, RoPE, SwiGLU): a third of theirs (and
        of the matmuls the share a published stack's policy re-runs, ``Workload.recomputed_matmuls``)."""
        if self.mode == "selective_op":  # (its policy sees every op)
            matmuls = rank.workload.recomputed_matmuls / 3
            return CostTerms(extra_memory_bound=1 / 3, extra_matmul=matmuls, host="selective_op")
        return CostTerms(extra_compute={"none": 0.0, "full": 1 / 3}.get(self.mode, 1 / (3 * self.every)))

    def recomputes(self, layer: int) -> bool:
        """Whether the block of global index ``layer`` is recomputed in backward.

        Example:
            >>> every_2nd = Recompute("selective", every=2)
            >>> every_2nd.recomputes(0), every_2nd.recomputes(1), every_2nd.recomputes(3)
            (False, True, True)
        """
        if self.mode == "none":
            return False
        return self.mode != "selective" or (layer + 1) % self.every == 0

    def apply(self, model: nn.Module, layout: Layout | None = None) -> nn.Module:
        """Make the chosen blocks of ``model`` recompute in backward (in place; returns ``model``).

        Works on any device (meta included: nothing is allocated) and needs no mesh.
        """
        recompute = _recompute_block_keeping_matmuls if self.mode == "selective_op" else _recompute_block
        layers = model.get_submodule(require_spec(model).layers)
        for name, block in layers.named_children():
            if self.recomputes(int(name)):
                # A partial of a module-level function and the bound method (not a closure), so
                # `copy.deepcopy(model)` rebinds the copy's forward to the copied block.
                block.forward = functools.partial(recompute, block.forward)
        return model

    def settings(self) -> dict[str, Any]:
        return {"mode": repr(self.mode), **({"every": self.every} if self.mode == "selective" else {})}
