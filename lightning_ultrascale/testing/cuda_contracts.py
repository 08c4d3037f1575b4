"""The package's CUDA branches, run on a CPU with every private CUDA op held to its kernel's rules.

Code written without a GPU fails on the first GPU at preconditions the CUDA kernels check in C++, or
computes wrong values where a kernel does not check and misreads. Inside :func:`emulate_cuda`:

- the package takes its CUDA branches with CPU tensors (``kernels.cuda.on_cuda`` says yes, and the
  device reports the emulated GPU's compute capability and multiprocessors);
- a dispatch mode replaces each private CUDA op (the ones ``kernels/cuda.py`` calls) with a shim that
  (a) enforces the preconditions its CUDA kernel checks, each citing torch's source file and check,
  and raises :class:`CudaContractError` where the kernel would refuse the call or read it wrongly, and
  (b) computes the result with a CPU reference (fp32), so a test compares values too;
- Triton launches (``kernels.cuda.launch``) are checked against CUDA's grid limits, recorded (kernel,
  grid, warps, block sizes) and run in Triton's interpreter (``TRITON_INTERPRET=1``, as the suite sets).

Custom ops (the ring's ``ultrascale::ring_attention``, torch's ``varlen_attn``) run their Python body
under the mode, so the private ops inside them are shimmed too. The attention shims live in
``cuda_attention.py``, the GEMM shims in ``cuda_gemms.py``.

Example:
    >>> import torch
    >>> from lightning_ultrascale.kernels import cuda
    >>> q = torch.randn(1, 2, 16, 12, dtype=torch.bfloat16)
    >>> with emulate_cuda("H100") as calls:  # doctest: +ELLIPSIS
    ...     out, lse = cuda.flash_attention(q, q, q, causal=True, scale=0.3)  # the call site pads to 16
    ...     torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, True, False, scale=0.3)
    Traceback (most recent call last):
    ...
    lightning_ultrascale.testing.cuda_rules.CudaContractError: head_size must be a multiple of 8, ...
    >>> out.shape, dict(calls.ops)
    (torch.Size([1, 2, 16, 12]), {'_scaled_dot_product_flash_attention.default': 2})
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ultrascale.kernels import cuda
from lightning_ultrascale.testing import cuda_attention, cuda_gemms
from lightning_ultrascale.testing.cuda_rules import CudaContractError, require

__all__ = ["DEVICES", "CudaContractError", "Launch", "OpCalls", "emulate_cuda", "require"]

#: GPUs the mode can stand in for: compute capability and multiprocessors, as their CUDA properties say.
DEVICES = {
    "A100": cuda.Device("A100", (8, 0), 108),
    "H100": cuda.Device("H100", (9, 0), 132),
    "B200": cuda.Device("B200", (10, 0), 148),
}


@dataclass(frozen=True)
class Launch:
    """One Triton launch: the kernel's name, its grid, warps and compile-time block sizes."""

    kernel: str
    grid: tuple[int, ...]
    num_warps: int
    constexprs: dict[str, int]


@dataclass
class OpCalls:
    """What ran under :func:`emulate_cuda`: private CUDA ops by name, their input shapes, every Triton launch."""

    ops: Counter[str] = field(default_factory=Counter)
    shapes: list[tuple[str, tuple[tuple[int, ...], ...]]] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)


class _Contracts(TorchDispatchMode):
    def __init__(self, calls: OpCalls) -> None:
        super().__init__()
        self.calls = calls
        self.shims = {**cuda_attention.SHIMS, **cuda_gemms.SHIMS}

    def __torch_dispatch__(self, func: Any, types: Sequence[type], args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        shim = self.shims.get(func)
        if shim is not None:
            self.calls.ops[func.__name__] += 1
            self.calls.shapes.append(
                (func.__name__, tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
            )
            return shim(*args, **kwargs)
        opdef = _maybe_get_opdef(func) if isinstance(func, torch._ops.OpOverload) else None
        if opdef is not None:  # a Python custom op: its body runs under the mode, private ops and all
            with self:
                return opdef._init_fn(*args, **kwargs)
        return func(*args, **kwargs)


_MAX_GRID = (2**31 - 1, 2**16 - 1, 2**16 - 1)


def _checked_launch(calls: OpCalls, launch: Callable[..., None]) -> Callable[..., None]:
    def checked(kernel: Any, grid: Sequence[int], *args: Any, **meta: Any) -> None:
        name = getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))
        require(
            1 <= len(grid) <= 3 and all(0 < g <= limit for g, limit in zip(grid, _MAX_GRID)),
            f"{name}: grid {tuple(grid)} outside CUDA's limits (x < 2**31, y and z < 2**16, none empty)",
            "CUDA programming guide, maximum grid dimensions",
        )
        warps = meta.get("num_warps", 4)
        require(warps in (1, 2, 4, 8, 16, 32), f"{name}: num_warps={warps} must be a power of two up to 32", "Triton")
        blocks = {k: v for k, v in meta.items() if k.isupper() and isinstance(v, int)}
        calls.launches.append(Launch(name, tuple(grid), warps, blocks))
        launch(kernel, grid, *args, **meta)

    return checked


@contextlib.contextmanager
def emulate_cuda(device: str = "H100") -> Iterator[OpCalls]:
    """Run the package's CUDA branches on CPU tensors as on ``device`` (a key of :data:`DEVICES`), ops checked."""
    calls = OpCalls()
    launch, previous = cuda.launch, cuda.EMULATED
    cuda.EMULATED, cuda.launch = DEVICES[device], _checked_launch(calls, launch)
    try:
        with _Contracts(calls):
            yield calls
    finally:
        cuda.EMULATED, cuda.launch = previous, launch
