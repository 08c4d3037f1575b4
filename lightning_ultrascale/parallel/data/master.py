"""Master weights: bf16 parameters on the device, their fp32 copy in the optimizer (``bf16-mixed``, ZeRO 0-2).

The playbook's mixed precision (and Megatron's, DeepSpeed's): forward and backward read bf16
weights and produce bf16 gradients (2Ψ + 2Ψ), the optimizer updates an fp32 master copy of every
weight (4Ψ, counted with Adam's two fp32 moments as the optimizer's 12Ψ) and the updated masters
are rounded into the bf16 weights after each step. Updates far smaller than a bf16 weight's
rounding step (``lr x update`` below ``2^-8`` of the weight) still accumulate in the master; in
``bf16-true`` (no master) they are lost.

Every trainable parameter becomes bf16: norm weights and the MoE router too, as Megatron and
torchtitan keep them (the router and the norms compute in fp32 from them). Buffers keep their
dtype: rotary frequencies and the MoE ``expert_bias`` (updated outside the optimizer) stay fp32.

ZeRO stage 0 keeps the masters whole beside the parameters (:class:`.buckets.BucketedAllReduce`);
stages 1-2 keep only this rank's 1/N slice of them as the sharded optimizer's shards
(:class:`.sharded_optimizer.ZeroEngine`); stage 3 is FSDP2's mixed precision, whose sharded fp32
parameters are the masters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

#: Lightning's precision under which stages 0-2 keep bf16 weights and fp32 masters.
MASTER_PRECISION = "bf16-mixed"


def to_bf16_with_masters(
    params: Iterable[nn.Parameter], masters: dict[nn.Parameter, nn.Parameter]
) -> dict[nn.Parameter, nn.Parameter]:
    """Cast ``params`` to bf16 in place (same ``Parameter`` objects), their fp32 values kept in ``masters``.

    A parameter already bf16 with a master in ``masters`` (a second setup of the same model)
    keeps it. Returns ``masters``, which maps each parameter to its fp32 copy (a ``Parameter``
    with the same placements when it is a DTensor).

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> masters = to_bf16_with_masters(layer.parameters(), {})
        >>> layer.weight.dtype, masters[layer.weight].dtype
        (torch.bfloat16, torch.float32)
    """
    for p in dict.fromkeys(params):
        if p in masters and p.dtype == torch.bfloat16:
            continue
        masters[p] = nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad)
        cast_parameter_(p, torch.bfloat16)
    return masters


def cast_parameter_(param: nn.Parameter, dtype: torch.dtype) -> None:
    """Change ``param``'s dtype in place: the module keeps the same object (hooks, optimizer references).

    A DTensor parameter's dtype lives in its wrapper: its tensors are swapped, as ``Module.to()``
    does for tensor subclasses.
    """
    if param.dtype == dtype:
        return
    with torch.no_grad():
        if isinstance(param, DTensor):
            torch.utils.swap_tensors(param, nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad))
        else:
            param.data = param.data.to(dtype)
