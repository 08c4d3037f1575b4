"""The shared decoder's tensor-parallel plan: which of its modules split over ``tp``, and how (DTensor styles).

The decoder (:mod:`.decoder`) declares it in its ``ModelSpec.tp_plan``; ``TensorParallel`` applies it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_ultrascale.models.common.mla import mla_tp_plan

if TYPE_CHECKING:
    from lightning_ultrascale.models.common.decoder import LlamaConfig

__all__ = ["folded_moe", "gathered_moe", "llama_tp_plan"]


def llama_tp_plan(cfg: LlamaConfig, sequence_parallel: bool) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Tensor-parallel plan ``(top_level, {block name: block plan})`` of DTensor ``ParallelStyle``s (torchtitan's).

    Megatron pairing: wq/wk/wv and w1/w3 split columns (heads / hidden units), wo and w2 split rows
    and reduce. The embedding is vocab-parallel; the output projection keeps logits sharded over
    the vocabulary as a DTensor (``use_local_output=False``) so the loss can run under
    ``torch.distributed.tensor.parallel.loss_parallel()`` without gathering ``[b, s, vocab]``.
    With ``sequence_parallel`` the residual stream between blocks is sharded over the sequence
    (``Shard(1)``): norms run on sequence shards, and the attention/MLP inputs are all-gathered
    (the all-reduces become reduce-scatters after wo/w2).

    An MoE feed-forward's weights are not split over ``tp``, its tokens are (Megatron's MoE parallel
    folding, :func:`folded_moe`): each tp rank routes its sequence shard (under SP the residual
    stream's own shard: no collective; without SP a slice, gathered after) through whole experts,
    which expert parallelism splits over ``dp x cp x tp`` ranks. Splitting each expert over tp
    instead would cut its GEMMs into slivers and add two collectives per MoE layer for weights that
    expert parallelism already divides; keeping the tokens whole would run every expert tp times.

    Example:
        >>> from lightning_ultrascale.models import get_model_config
        >>> top, blocks = llama_tp_plan(get_model_config("llama_tiny"), sequence_parallel=True)
        >>> sorted(top), "attention.wq" in blocks["0"]
        (['norm', 'output', 'tok_embeddings'], True)
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    residual = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    attention = _attention_tp_plan(cfg, residual)
    dense, moe = _feed_forward_tp_plans(residual)
    norms = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()} if sequence_parallel else {}
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    moe_blocks = set(cfg.moe_blocks())
    blocks = {
        str(i): attention | (moe if i in moe_blocks else dense) | norms for i in range(cfg.n_layers + cfg.mtp_depth)
    }
    if sequence_parallel:  # an MTP block's own norms and projection are per token: they run on sequence shards
        mtp = {name: SequenceParallel() for name in ("enorm", "hnorm", "post_norm")}
        mtp["eh_proj"] = SequenceParallel(use_local_output=True)  # the block's input, local as the residual stream
        for i in range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth):
            blocks[str(i)] |= mtp
    return top, blocks


def _attention_tp_plan(cfg: LlamaConfig, residual: Any) -> dict[str, Any]:
    """Heads split over tp: q/k/v column-parallel, wo row-parallel back into the residual layout."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    if cfg.mla is not None:
        return mla_tp_plan(residual, cfg.mla)
    # One conversion of each sub-layer's input, shared by its column-parallel projections: with
    # one per projection (wq, wk, wv; w1, w3) backward all-reduces the input gradient once per
    # projection, 5 all-reduces per block instead of the playbook's 2 (measured by
    # benchmarks/tp.py). With SP this is also the all-gather of the sequence shards.
    plan = {
        "attention": PrepareModuleInput(
            input_layouts=(residual, None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
    }
    if cfg.qk_norm:
        # Per-head norms on the rank's heads ([b, s, heads, head_dim], heads sharded): a replicated weight whose
        # gradient DTensor sums over the tp ranks (each saw its own heads).
        per_head = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan |= {"attention.q_norm": per_head, "attention.k_norm": per_head}
    return plan


def _feed_forward_tp_plans(residual: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The dense SwiGLU's plan (hidden units split over tp) and an MoE's (gathered, not split)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    dense = {
        "feed_forward": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=residual),
    }
    return dense, {"feed_forward": folded_moe(residual)}


def folded_moe(residual: Any) -> Any:
    """An MoE feed-forward's style under MoE parallel folding: it runs on its tp rank's sequence shard (the
    residual's own under SP; without SP a local slice on the way in, all-gathered on the way out), local tensors
    inside; the module must declare :class:`~lightning_ultrascale.models.spec.SharesTokens`."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    return PrepareModuleInputOutput(
        input_layouts=(residual,),
        desired_input_layouts=(Shard(1),),
        use_local_input=True,
        output_layouts=(Shard(1),),
        desired_output_layouts=(residual,),
    )


def gathered_moe(residual: Any) -> Any:
    """An MoE feed-forward's style: its input gathered (every tp rank routes the same tokens), its output
    handed back in the residual layout; the experts themselves are not split over tp."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    return PrepareModuleInputOutput(
        input_layouts=(residual,),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Replicate(),),
        desired_output_layouts=(residual,),
    )
