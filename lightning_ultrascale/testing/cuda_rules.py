"""What a CUDA kernel refuses, raised where a shim of :mod:`~lightning_ultrascale.testing.cuda_contracts` finds it."""

from __future__ import annotations


class CudaContractError(RuntimeError):
    """A CUDA kernel would refuse this call, or read its input wrongly without a word."""


def require(ok: bool, message: str, source: str) -> None:
    """Raise :class:`CudaContractError` with the kernel's ``message`` and the ``source`` of the check, unless ``ok``."""
    if not ok:
        raise CudaContractError(f"{message} [{source}]")
