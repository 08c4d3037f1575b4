"""Regional compilation: each transformer block through ``torch.compile``, compiled once and reused.

A model repeats one block ``n_layers`` times. Compiling each block's ``forward`` (torchtitan's and
Megatron's "regional compilation") gives dynamo one piece of code to trace: the first block
compiles, every other block of the same kind reuses that graph (its parameters are the graph's
inputs, not constants), so compile time does not grow with depth. Inductor fuses the element-wise
work between the matmuls (RMSNorm, RoPE, SwiGLU, residual adds) and removes the per-op Python and
dispatch overhead of eager mode: C++ on CPU, Triton on GPU.

Where it applies (``APPLY_ORDER``): after tensor and context parallelism and recomputation, which
the compiled forward then contains (DTensor redistributions, ring attention, the checkpoint), and
before data-parallel wrapping, whose hooks (FSDP's all-gathers, gradient buckets) stay outside
the compiled region, on the block module that calls the compiled ``forward``.

What is compiled:

- a dense block: its whole ``forward``;
- a mixture-of-experts block: each child except the MoE, and in the MoE each child except the
  routed ``experts``. Routing reads how many tokens each expert got (expert parallelism's
  all-to-all sizes, the grouped GEMM's offsets): shapes that change every step, which would
  recompile (torchtitan leaves the same part eager).

A region compiles a new graph when a guard fails (a new shape, dtype, or training versus
evaluation): expect one graph per region kind for training and one for validation. Every compile
is logged with its seconds (:attr:`Compile.stats`); a second graph of a region kind in the same mode
(training or evaluation, grad on or off) is warned about (``TORCH_LOGS=recompiles`` names the guard
that failed). A hook that runs inside a region must read the same Python values for every block:
the sharded optimizer (ZeRO-1/2) waits for its gathers on the region, not on its linears.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from lightning_ultrascale.errors import ConfigError, option
from lightning_ultrascale.models.spec import require_spec
from lightning_ultrascale.parallel.layout import Layout
from lightning_ultrascale.parallel.plugin import ParallelPlugin

log = logging.getLogger(__name__)


@dataclass
class CompileStats:
    """What compiling cost in this process: graphs per region kind and the seconds spent in the backend."""

    graphs: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.graphs.values())


class _CountingBackend:
    """The backend dynamo calls once per graph it captures: times it and counts it for ``region``.

    ``mode`` is set by the compiled forward before each call (training or evaluation, grad on or
    off): a second graph in the same mode is a recompilation, warned about at once (a graph per
    block would otherwise pass for the expected two of a four-block model, and past dynamo's cache
    limit the blocks would fall back to eager without a word).
    """

    def __init__(self, backend: str, stats: CompileStats, region: str) -> None:
        self.inner = torch._dynamo.lookup_backend(backend)
        self.stats, self.region = stats, region
        self.mode = (True, True)  # (training, grad enabled) of the call being compiled
        self._per_mode: Counter[tuple[bool, bool]] = Counter()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        start = time.perf_counter()
        compiled = self.inner(gm, example_inputs)
        seconds = time.perf_counter() - start
        self.stats.seconds += seconds
        self.stats.graphs[self.region] += 1
        self._per_mode[self.mode] += 1
        count = self._per_mode[self.mode]
        training, grad = self.mode
        mode = f"{'training' if training else 'evaluation'}, grad {'on' if grad else 'off'}"
        log.info("compiled graph %d of %s (%s) in %.1f s", count, self.region, mode, seconds)
        if count > 1:
            log.warning(
                "%s compiled graph number %d for %s: a recompilation (a guard failed: a shape, a dtype or a Python "
                "value changed between calls, or differs between blocks); TORCH_LOGS=recompiles names the guard",
                self.region,
                count,
                mode,
            )
        return compiled


class _CompiledForward:
    """A module's ``forward`` through ``torch.compile``; a deep copy (SWA, EMA) compiles the copy's own."""

    def __init__(self, forward: Callable[..., Any], **options: Any) -> None:
        self.forward, self.options = forward, options
        self.compiled = torch.compile(forward, **options)
        backend = options.get("backend")
        self.backend = backend if isinstance(backend, _CountingBackend) else None
        self.owner = _owner(forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.backend is not None:  # (what a graph compiled now would be for)
            self.backend.mode = (self.owner is None or self.owner.training, torch.is_grad_enabled())
        return self.compiled(*map(_settled, args), **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _CompiledForward:
        # A bound method deep-copies bound to the copied module (the memo holds it).
        return _CompiledForward(copy.deepcopy(self.forward, memo), **self.options)


class Compile(ParallelPlugin):
    """Compile every transformer block's ``forward`` with ``torch.compile``; owns no mesh dim.

    Args:
        enabled: compile (``False``: the plugin does nothing, as in the default config).
        backend: a ``torch.compile`` backend: ``"inductor"`` (generated code: C++ on CPU, Triton on
            GPU), ``"aot_eager"`` (traced and partitioned like inductor, run by eager kernels: to
            tell a compiler bug from a tracing one) or ``"eager"``.
        fullgraph: refuse a graph break (``False``: run the untraceable part eagerly, slower).

    Example:
        >>> from lightning_ultrascale import UltraScaleStrategy
        >>> from lightning_ultrascale.models import build_model
        >>> model = Compile().apply(build_model("llama_tiny", seed=0))
        >>> type(model.layers["0"].forward).__name__
        '_CompiledForward'
        >>> strategy = UltraScaleStrategy(Compile())
    """

    applies_at = "compile"
    BACKENDS = ("inductor", "aot_eager", "eager")

    def __init__(self, enabled: bool = True, backend: str = "inductor", fullgraph: bool = True) -> None:
        for name, value in (("enabled", enabled), ("fullgraph", fullgraph)):
            if not isinstance(value, bool):
                raise ConfigError(f"{option(self, name, value)} must be true or false")
        if backend not in self.BACKENDS:
            raise ConfigError(f"{option(self, 'backend', backend)} is unknown; valid: {', '.join(self.BACKENDS)}")
        self.enabled, self.backend, self.fullgraph = enabled, backend, fullgraph
        #: Graphs compiled and seconds spent, in this process.
        self.stats = CompileStats()
        self._backends: dict[str, _CountingBackend] = {}

    def mesh_sizes(self) -> dict[str, int | None]:
        return {}

    @property
    def active(self) -> bool:
        return self.enabled

    def validate_with(self, plugins: Sequence[ParallelPlugin]) -> None:
        split = [p for p in plugins if getattr(p, "splits_backward", False)]
        if self.enabled and split:
            # A compiled block's backward is one autograd node: input and weight gradients come out
            # of it together, and its saved buffers are freed (donated) when it runs.
            raise ConfigError(
                f"{option(self, 'enabled', True)} cannot run under {split[0]!r}: the schedule splits each backward "
                "in two (input, then weight gradients), and a compiled block's backward is one op that computes "
                "both (torch issue 161904); valid: a schedule that does not split backward (1f1b, "
                "interleaved_1f1b, afab, looped_bfs), or compile off"
            )

    def apply(self, model: nn.Module, layout: Layout | None = None) -> nn.Module:
        """Compile the regions of every block of ``model`` (in place; returns ``model``).

        Nothing compiles here: each region compiles at its first call, on any device.
        """
        spec = require_spec(model)
        for name, block in model.get_submodule(spec.layers).named_children():
            for region in _regions(block, spec.moe if spec.is_moe_block(int(name)) else None):
                self._compile(region)
        return model

    def _compile(self, module: nn.Module) -> None:
        kind = f"{type(module).__name__}.forward"
        if isinstance(module.forward, functools.partial):  # a wrapper around it (recomputation): its own code
            kind += f" via {module.forward.func.__name__}"
        # One backend object per region kind: dynamo guards on the backend, and a block compiled
        # with a backend of its own would miss the graph of the block before it.
        if kind not in self._backends:
            self._backends[kind] = _CountingBackend(self.backend, self.stats, kind)
        backend = self._backends[kind]
        # dynamic=False: a new shape is a new, counted graph, never a silently slower symbolic one.
        module.forward = _CompiledForward(module.forward, backend=backend, fullgraph=self.fullgraph, dynamic=False)

    def settings(self) -> dict[str, Any]:
        if not self.enabled:
            return {"enabled": False}
        return {"backend": repr(self.backend), **({} if self.fullgraph else {"fullgraph": False})}


def _owner(forward: Callable[..., Any]) -> nn.Module | None:
    """The module whose forward ``forward`` is (through a ``functools.partial`` wrapper too)."""
    while isinstance(forward, functools.partial):
        forward = forward.args[0] if forward.args else forward.func
    owner = getattr(forward, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def is_compiled(module: nn.Module) -> bool:
    """Whether :class:`Compile` compiled ``module``'s forward: a region whose inside dynamo traces.

    A forward pre-hook registered inside a region runs in its graph, and every Python value it
    reads is guarded: one that differs between blocks (a dict keyed by the module) makes each block
    a graph of its own. Hooks that do bookkeeping belong on the region itself.
    """
    return isinstance(module.__dict__.get("forward"), _CompiledForward)


def _settled(x: Any) -> Any:
    """``x``, or a plain copy of an ``AsyncCollectiveTensor``: a collective's output not yet waited for
    (the first block's input under tensor parallelism) is another type, a graph of its own (one
    recompilation) and, as a traced input, loses its gradient's DTensor wrapper. ``clone`` waits and
    stays differentiable (``wait()`` would drop the autograd history)."""
    return x.clone() if isinstance(x, AsyncCollectiveTensor) else x


def _regions(block: nn.Module, moe: str | None) -> list[nn.Module]:
    """What to compile in ``block``: itself, or for an MoE block (``moe``: its MoE's name) each child
    but the MoE, and the MoE's children but its routed ``experts``."""
    if moe is None:
        return [block]
    outer = [child for name, child in block.named_children() if name != moe]
    inner = [child for name, child in block.get_submodule(moe).named_children() if name != "experts"]
    return outer + inner
