"""Model-state memory: what this rank actually holds, and what the playbook's ZeRO formulas predict.

The playbook ("ZeRO: Zero Redundancy Optimizer") counts model state in multiples of the parameter
count Ψ. With bf16 mixed precision and Adam every parameter costs 2 bytes (bf16 weights) + 2 bytes
(bf16 gradients) + k = 12 bytes (fp32 master weights, fp32 Adam momentum and variance); ZeRO-1
shards the k Ψ optimizer part over the N data-parallel ranks, ZeRO-2 also the gradients, ZeRO-3
also the parameters:

    stage 0:  2Ψ + 2Ψ + kΨ
    stage 1:  2Ψ + 2Ψ + kΨ/N
    stage 2:  2Ψ + (2Ψ + kΨ)/N
    stage 3:  (2Ψ + 2Ψ + kΨ)/N

In plain fp32 training the same parts are 4Ψ parameters, 4Ψ gradients and 8Ψ Adam states (the
parameters are their own master copy), sharded the same way.

:func:`model_state_bytes` measures the first column of that table on a live model, so a test can
check that, e.g., ZeRO-2 gradient bytes really are one N-th.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_ultrascale.utils.tensors import local_tensor

__all__ = [
    "ModelStateBytes",
    "format_bytes",
    "layout_model_state_bytes",
    "model_state_bytes",
    "peak_bytes",
    "playbook_model_state_bytes",
    "process_peak_bytes",
]


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB, whichever keeps the number below 1024.

    Example:
        >>> format_bytes(16), format_bytes(2048), format_bytes(3 * 2**20), format_bytes(1.5 * 2**30)
        ('16 B', '2.0 KiB', '3.0 MiB', '1.50 GiB')
    """
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n:.0f} B"


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model state held by one rank (or predicted for one rank)."""

    params: int
    grads: int
    optimizer_states: int
    total: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.params + self.grads + self.optimizer_states)

    def summary(self) -> str:
        """One line for a log.

        Example:
            >>> ModelStateBytes(2**20, 2**20, 2 * 2**20).summary()
            'model state 4.0 MiB = params 1.0 MiB + grads 1.0 MiB + optimizer 2.0 MiB'
        """
        return (
            f"model state {format_bytes(self.total)} = params {format_bytes(self.params)}"
            f" + grads {format_bytes(self.grads)} + optimizer {format_bytes(self.optimizer_states)}"
        )


class _StorageCounter:
    """Sums bytes of tensors, counting each underlying storage once.

    Tied weights share a storage, and a data-parallel engine may keep gradients as views into one
    flat bucket: keying by (storage pointer, storage size) counts such memory once, and counting
    the whole storage (not the view) charges a flat buffer's padding to it.
    """

    def __init__(self) -> None:
        self._seen: set[tuple[str, int, int]] = set()

    def __call__(self, tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        with torch.no_grad():
            for t in tensors:
                local = local_tensor(t)
                storage = local.untyped_storage()
                nbytes = storage.nbytes()
                # Meta storages have no address; the storage object's identity still ties them.
                ptr = storage.data_ptr() or storage._cdata
                key = (str(local.device), ptr, nbytes)
                if nbytes == 0 or key in self._seen:
                    continue
                self._seen.add(key)
                total += nbytes
        return total


def _optimizer_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value


def model_state_bytes(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
    extra_grad_buffers: Iterable[torch.Tensor] = (),
) -> ModelStateBytes:
    """Bytes of parameters, gradients and optimizer states that this rank holds.

    DTensors (FSDP2 and tensor-parallel parameters, their gradients and Adam states) count their
    local shard. Tensors sharing a storage count once, in any category where they appear first:
    parameters (the model's, then the optimizer's: one in storage no model parameter holds is the
    fp32 master copy of bf16 weights and counts as optimizer state, as the playbook counts it),
    then ``extra_grad_buffers`` (flat gradient buckets of a data-parallel engine), then ``.grad``,
    then every tensor in ``optimizer.state`` (``exp_avg``, ``exp_avg_sq``, ``step`` when it is a
    tensor, ...) of ``optimizer``, which may
    also be a list of optimizers (``trainer.optimizers``).

    Example:
        >>> model = nn.Linear(4, 4, bias=False)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> model(torch.ones(1, 4)).sum().backward(); opt.step()
        >>> model_state_bytes(model, opt)  # fp32: 64 B weights, 64 B grads, 2 x 64 B + 4 B step
        ModelStateBytes(params=64, grads=64, optimizer_states=132, total=260)
    """
    if optimizer is None:
        optimizers: list[torch.optim.Optimizer] = []
    elif isinstance(optimizer, torch.optim.Optimizer):
        optimizers = [optimizer]
    else:
        optimizers = list(optimizer)
    count = _StorageCounter()
    model_params = list(model.parameters())
    # The optimizer's own parameters too: a sharded optimizer (ZeRO-1/2) updates flat shards that
    # view the model's parameter buffers (counted once) and holds the reduced gradients on them.
    # One in storage of its own is a master copy (fp32 weights under bf16 ones): optimizer state.
    optimizer_params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    param_bytes = count(model_params)
    master_bytes = count(optimizer_params)
    params = [*model_params, *optimizer_params]
    grad_bytes = count(extra_grad_buffers) + count(p.grad for p in params if p.grad is not None)
    opt_bytes = master_bytes + count(_optimizer_tensors(optimizers))
    return ModelStateBytes(params=param_bytes, grads=grad_bytes, optimizer_states=opt_bytes)


def playbook_model_state_bytes(
    n_params: int,
    stage: int,
    dp: int,
    k_optimizer: int | None = None,
    mixed_precision: bool = True,
    grad_bytes: int | None = None,
    weight_bytes: int | None = None,
) -> ModelStateBytes:
    """The playbook's per-rank model-state memory for ZeRO ``stage`` on ``dp`` ranks.

    ``mixed_precision=True``: bf16 params and grads (2Ψ each) and ``k_optimizer``Ψ of fp32 state
    (default 12: master weights, Adam m and v); ``False``: fp32 params and grads (4Ψ each) and
    ``k_optimizer``Ψ of state (default 8: Adam m and v; 4 for SGD with momentum). ``grad_bytes``
    and ``weight_bytes`` override the bytes per parameter of the gradients (4: an fp32 gradient
    buffer under bf16 weights) and of the weights. Stage 1 divides the optimizer part by ``dp``,
    stage 2 also the gradients, stage 3 also the parameters (module docstring has the table);
    a divided part is rounded up (a rank holds whole elements).

    Example:
        >>> playbook_model_state_bytes(10**9, stage=0, dp=8).total     # 16 bytes per parameter
        16000000000
        >>> playbook_model_state_bytes(10**9, stage=3, dp=8).total     # all of it / 8
        2000000000
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage} must be 0, 1, 2 or 3")
    if dp < 1:
        raise ValueError(f"dp={dp} must be >= 1")
    param_b, grad_b, default_k = (2, 2, 12) if mixed_precision else (4, 4, 8)
    param_b = param_b if weight_bytes is None else weight_bytes
    grad_b = grad_b if grad_bytes is None else grad_bytes
    opt_b = default_k if k_optimizer is None else k_optimizer
    params, grads, opt = param_b * n_params, grad_b * n_params, opt_b * n_params
    return ModelStateBytes(
        params=-(-params // dp) if stage >= 3 else params,
        grads=-(-grads // dp) if stage >= 2 else grads,
        optimizer_states=-(-opt // dp) if stage >= 1 else opt,
    )


#: The precisions whose model state :func:`layout_model_state_bytes` knows (Lightning's names).
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


def reduces_in_fp32(precision: str, reduce_dtype: str) -> bool:
    """Whether the engines reduce gradients in fp32: always in ``32-true``; over bf16 parameters, unless
    ``reduce_dtype="bf16"`` (FSDP2's ``MixedPrecisionPolicy.reduce_dtype``, the ZeRO-0/2 buckets' dtype).

    Example:
        >>> [reduces_in_fp32(p, r) for p, r in (("32-true", "bf16"), ("bf16-mixed", "fp32"), ("bf16-true", "bf16"))]
        [True, True, False]
    """
    return precision not in ("bf16-mixed", "bf16-true") or reduce_dtype == "fp32"


def layout_model_state_bytes(
    n_params: int, stage: int, dp: int, precision: str, reduce_dtype: str = "fp32", k_optimizer: int | None = None
) -> ModelStateBytes:
    """Per-rank model state of ``n_params`` parameters as our ZeRO engines hold them: the one formula.

    The engines' logged expectation, ``benchmarks/zero.py`` and the planner all call this. Bytes
    per parameter before the stage divides them (``ZeRO``'s table), AdamW by default:

    ==================  ==========================  ================  ===========================
    precision           weights                     gradients         optimizer state (default k)
    ==================  ==========================  ================  ===========================
    ``32-true``         4 (their own master)        4                 8: Adam's m and v
    ``bf16-mixed`` 0-2  2 (bf16)                    4 or 2 [1]_       12: fp32 master + m + v
    ``bf16-mixed`` 3    4: FSDP2's sharded fp32     4 [2]_            8: m and v
                        parameter is the master
    ``bf16-true``       2 (no master copy)          2                 4: m and v in bf16
    ==================  ==========================  ================  ===========================

    ``k_optimizer`` overrides the last column (what the optimizer holds per parameter, the
    master included: 8 for SGD with momentum under ``bf16-mixed``).

    .. [1] ``reduce_dtype="fp32"`` (default): the fp32 buffer that accumulates micro-steps, is
       reduced and is the masters' gradient (Megatron's main gradients); ``"bf16"``: bf16 buckets
       (the playbook's 2Ψ), plus, from the end of backward to the end of the optimizer step, the
       fp32 copy the masters step with (4Ψ, divided like the optimizer state): a transient this
       count leaves out, as it leaves out buckets in flight.
    .. [2] FSDP2 keeps sharded gradients in the sharded parameters' dtype, fp32.

    Example:
        >>> layout_model_state_bytes(10**9, stage=1, dp=8, precision="bf16-mixed", reduce_dtype="bf16")
        ModelStateBytes(params=2000000000, grads=2000000000, optimizer_states=1500000000, total=5500000000)
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} has no model-state formula; valid: {', '.join(PRECISIONS)}")
    if precision == "32-true" or (precision == "bf16-mixed" and stage == 3):
        return playbook_model_state_bytes(n_params, stage, dp, k_optimizer=k_optimizer, mixed_precision=False)
    if precision == "bf16-true":
        k = 4 if k_optimizer is None else k_optimizer
        return playbook_model_state_bytes(n_params, stage, dp, k_optimizer=k, mixed_precision=True)
    grad_b = 4 if reduce_dtype == "fp32" else 2
    return playbook_model_state_bytes(n_params, stage, dp, k_optimizer=k_optimizer, grad_bytes=grad_b)


def one_moment_k(precision: str, stage: int) -> int:
    """``k_optimizer`` of an optimizer that keeps one moment (Muon's momentum): AdamW's default less one moment.

    Example:
        >>> one_moment_k("bf16-mixed", stage=1), one_moment_k("bf16-mixed", stage=3), one_moment_k("32-true", 0)
        (8, 4, 4)
    """
    if precision == "bf16-true":
        return 2
    return 8 if precision == "bf16-mixed" and stage < 3 else 4


def peak_bytes(fn: Callable[[], object], *inputs: torch.Tensor) -> int:
    """Peak bytes of the tensors alive on ``inputs[0]``'s device while ``fn()`` runs, ``inputs`` included.

    Counted by torch's ``MemTracker`` (every storage created or tracked, freed ones subtracted), so
    it works on CPU, where no allocator keeps statistics.

    Example:
        >>> x = torch.zeros(1024)
        >>> peak_bytes(lambda: x * 2, x)  # x and its double
        8192
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*inputs)
    with tracker:
        fn()
    return int(tracker.get_tracker_snapshot("peak")[inputs[0].device]["Total"])


def process_peak_bytes(device: torch.device) -> int:
    """This process's memory peak on ``device``: the CUDA caching allocator's ``max_memory_allocated`` on a
    GPU (tensors only, since start or the last ``torch.cuda.reset_peak_memory_stats``), the peak resident
    set on the CPU (everything the process touched: tensors, the interpreter, libraries; it never resets).

    Example:
        >>> process_peak_bytes(torch.device("cpu")) > 0
        True
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource  # Unix only, as our launchers

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux
