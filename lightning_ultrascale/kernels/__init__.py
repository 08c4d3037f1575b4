"""Fused kernels: one pure-torch reference per op and the fast paths that must match it.

The ops are the memory-bound pieces of a Llama step that eager PyTorch runs as chains of small
kernels (the playbook's "fused kernels"), plus the output head's loss, the largest activation:

=====================  ==========================================================================
``rms_norm``           RMSNorm forward and backward in one pass each
``swiglu``             ``silu(gate) * up`` of the SwiGLU MLP
``rope``               rotary embedding of queries and keys
``linear_cross_entropy``  head matmul + cross-entropy over token chunks, never the full logits
                       (vocabulary-parallel under tensor parallelism)
=====================  ==========================================================================

Kernel sets (``kernels=`` in Hydra, ``LlamaModule(kernels=...)``):

* ``reference``: pure torch, eager; the loss materialises the logits (unless ``fused_cross_entropy``).
* ``compile``: each reference op through ``torch.compile`` (inductor fuses it; CPU and GPU).
* ``triton``: our Triton kernels (``triton_ops.py``); CUDA GPU.
* ``liger``: Liger-Kernel's Triton kernels (``pip install liger-kernel``); CUDA GPU.

Every set but ``reference`` fuses the linear cross-entropy by default. Fast paths run on plain
tensors; a DTensor input (a sequence-parallel norm) runs the reference op, whose sharding DTensor
knows. Triton kernels also run on CPU tensors under ``TRITON_INTERPRET=1`` (slowly: for tests).

Example:
    >>> import torch
    >>> kernels = get_kernels("reference", fused_cross_entropy=True)
    >>> h, w = torch.randn(4, 8), torch.randn(16, 8)
    >>> kernels.linear_cross_entropy(h, w, torch.tensor([1, 2, 3, -100])).shape
    torch.Size([])
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.kernels import reference
from lightning_ultrascale.kernels.cross_entropy import fused_linear_cross_entropy

__all__ = ["KERNEL_SETS", "Kernels", "check_kernels", "fused_linear_cross_entropy", "get_kernels", "reference"]

#: Kernel sets and the package each needs (None: torch alone).
KERNEL_SETS: dict[str, str | None] = {"reference": None, "compile": None, "triton": "triton", "liger": "liger_kernel"}
_INSTALL = {"triton": "pip install triton", "liger_kernel": "pip install liger-kernel"}


@dataclass(frozen=True)
class Kernels:
    """One implementation of each op; the model calls these.

    ``linear_cross_entropy(h, head_weight, labels) -> mean loss`` is None when the loss
    materialises the logits through the head module (then tensor parallelism's ``loss_parallel``
    keeps them vocabulary-sharded).
    """

    name: str
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    swiglu: Callable[[Tensor, Tensor], Tensor]
    rope: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    linear_cross_entropy: Callable[[Tensor, Tensor, Tensor], Tensor] | None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_kernels(name: str, device_type: str | None = None) -> None:
    """Raise :class:`ConfigError` if kernel set ``name`` cannot run here (on ``device_type``).

    Example:
        >>> check_kernels("fastest")
        Traceback (most recent call last):
        ...
        lightning_ultrascale.errors.ConfigError: kernels=fastest is unknown; valid: reference, compile, triton, liger
    """
    if name not in KERNEL_SETS:
        raise ConfigError(f"kernels={name} is unknown; valid: {', '.join(KERNEL_SETS)}")
    package = KERNEL_SETS[name]
    if package is None:
        return
    if importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"kernels={name} needs the {package} package, which is not installed ({_INSTALL[package]}); "
            "fallback: kernels=compile (any device) or kernels=reference"
        )
    _check_device(name, device_type)


def _check_device(name: str, device_type: str | None) -> None:
    if KERNEL_SETS[name] is not None and device_type != "cuda" and not _interpreting():
        where = f"the device is {device_type}" if device_type else "no CUDA GPU is visible"
        raise ConfigError(
            f"kernels={name} runs Triton kernels, which need a CUDA GPU; {where}. "
            "Fallback: kernels=compile or kernels=reference (or TRITON_INTERPRET=1 to run them in "
            "Triton's interpreter, slowly, for tests)"
        )


def _plain_tensors_or(
    reference_op: Callable[..., Tensor], fast_op: Callable[..., Tensor], name: str
) -> Callable[..., Tensor]:
    """``fast_op`` on plain tensors, ``reference_op`` when any input is a DTensor; fast ops check the device."""

    @functools.wraps(fast_op)
    def op(*args: object) -> Tensor:
        tensors = [a for a in args if isinstance(a, Tensor)]
        if any(isinstance(t, DTensor) for t in tensors):
            return reference_op(*args)
        _check_device(name, tensors[0].device.type)
        return fast_op(*args)

    return op


@functools.cache
def get_kernels(name: str = "reference", fused_cross_entropy: bool | None = None) -> Kernels:
    """The kernel set ``name``; ``fused_cross_entropy`` (default: every set but ``reference``) chunks the loss.

    Raises :class:`ConfigError` for an unknown name or a missing package; whether the device
    can run the set is checked by :func:`check_kernels` (and by each fast op on its inputs).

    Example:
        >>> get_kernels("compile").name, get_kernels("reference").linear_cross_entropy is None
        ('compile', True)
    """
    check_kernels(name, "cuda")  # name and package: the device is checked where it is known
    fused = name != "reference" if fused_cross_entropy is None else fused_cross_entropy
    loss = fused_linear_cross_entropy if fused else None
    if name == "reference":
        return Kernels(name, reference.rms_norm, reference.swiglu, reference.rope, loss)
    if name == "compile":
        refs = (reference.rms_norm, reference.swiglu, reference.rope)
        ops = [_plain_tensors_or(ref, torch.compile(ref), name) for ref in refs]
        return Kernels(name, ops[0], ops[1], ops[2], loss)  # type: ignore[arg-type]
    # Imported now, not at the top: Triton decides at import whether kernels run interpreted.
    if name == "triton":
        from lightning_ultrascale.kernels import triton_ops as fast
    else:
        from lightning_ultrascale.kernels import liger as fast  # type: ignore[no-redef]

        if fused:  # Liger's has no vocabulary-parallel form: a DTensor head weight takes ours
            loss = _plain_tensors_or(fused_linear_cross_entropy, fast.linear_cross_entropy, name)
    return Kernels(
        name,
        _plain_tensors_or(reference.rms_norm, fast.rms_norm, name),
        _plain_tensors_or(reference.swiglu, fast.swiglu, name),
        _plain_tensors_or(reference.rope, fast.rope, name),  # type: ignore[arg-type]
        loss,
    )
