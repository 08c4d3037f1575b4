"""Catch, on a CPU, the collective that would fail on the first GPU run: a tensor built without a device.

NCCL serves CUDA tensors only; gloo serves both. ``torch.zeros(n)`` handed to ``all_reduce`` works
in every CPU test and crashes every multi-GPU job ("No backend type associated with device type
cpu"). :class:`CollectiveDeviceCheck` makes that visible without a GPU:

- a ``TorchFunctionMode`` notes every tensor that a package module (``lightning_ultrascale``, not
  its ``testing`` helpers) builds with a factory (``torch.zeros``, ``torch.tensor``, ...) and no
  ``device`` (or ``device=None``): on a GPU run it would be on the CPU;
- a ``TorchDispatchMode`` sees every collective (``c10d`` and functional ops, from any caller,
  gradient hooks included) and fails when one is handed such a tensor (or a view of one), or a
  tensor on another device than the one the test declares.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from lightning_ultrascale.utils.comm import _COLLECTIVES, _is_subclass_needing_dispatch

_PACKAGE = Path(__file__).resolve().parents[1]
_EXEMPT = Path(__file__).resolve().parent  # the testing helpers build tensors for the test's own use


class CollectiveDeviceError(RuntimeError):
    """A collective was handed a tensor that would live on the wrong device on a GPU run."""


def _package_caller() -> str | None:
    """``file:line`` of the nearest package frame calling into torch, or None if the caller is not ours."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if _PACKAGE in path.parents and _EXEMPT not in path.parents:
            return f"{path.relative_to(_PACKAGE.parent)}:{frame.f_lineno}"
        if "torch" not in path.parts:
            return None
        frame = frame.f_back  # type: ignore[assignment]
    return None


class _DevicelessFactories(TorchFunctionMode):
    def __init__(self, built: WeakIdKeyDictionary) -> None:
        super().__init__()
        self.built = built
        self.constructors = _device_constructors()

    def __torch_function__(self, func: Any, types: Sequence[type], args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self.constructors and kwargs.get("device") is None and isinstance(out, torch.Tensor):
            where = _package_caller()
            if where is not None:
                self.built[out] = where
        return out


class _CheckedCollectives(TorchDispatchMode):
    def __init__(self, built: WeakIdKeyDictionary, device: torch.device) -> None:
        super().__init__()
        self.built = built
        self.device = device
        self.checked = 0

    def __torch_dispatch__(self, func: Any, types: Sequence[type], args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(_is_subclass_needing_dispatch(t) for t in types):
            return NotImplemented
        if func._overloadpacket in _COLLECTIVES:
            self.checked += 1
            for tensor in _tensors((args, kwargs)):
                self._check(func, tensor)
        return func(*args, **kwargs)

    def _check(self, func: Any, tensor: torch.Tensor) -> None:
        op = str(func._overloadpacket).removeprefix("_ops.")
        for t in (tensor, tensor._base):
            if t is not None and t in self.built:
                raise CollectiveDeviceError(
                    f"{op} was handed a tensor built without a device at {self.built[t]}: on a GPU run it is a CPU "
                    "tensor and NCCL refuses it; build it on lightning_ultrascale.utils.comm.collective_device()"
                )
        if tensor.device.type != self.device.type:
            raise CollectiveDeviceError(
                f"{op} was handed a tensor on {tensor.device}; this run's device is {self.device}"
            )


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


class CollectiveDeviceCheck:
    """Fail any collective handed a tensor that a package module built without a device, or one off ``device``.

    Args:
        device: the device every collective's tensors must be on (the strategy's root device).

    Modes are per thread (autograd's backward threads inherit them): enter it on the thread that trains.

    Example:
        >>> with CollectiveDeviceCheck(torch.device("cpu")) as check:  # doctest: +SKIP
        ...     trainer.fit(module, datamodule=data)
        >>> check.checked > 0  # doctest: +SKIP
        True
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.built: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._factories = _DevicelessFactories(self.built)
        self._collectives = _CheckedCollectives(self.built, torch.device(device))

    @property
    def checked(self) -> int:
        """How many collectives were checked."""
        return self._collectives.checked

    def __enter__(self) -> CollectiveDeviceCheck:
        self._factories.__enter__()
        self._collectives.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._collectives.__exit__(*exc)
        self._factories.__exit__(*exc)
