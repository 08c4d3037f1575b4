"""Shard-local initialisation: each rank draws only its own shard, and every layout gets the same weights.

The value of element ``i`` (row-major index in the FULL parameter) is a pure function of the
parameter's 64-bit key and ``i``: Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy
as 1, 2, 3", SC'11; cuRAND's and PyTorch's CUDA generator) turns counter ``i // 4`` into four
32-bit words, Box-Muller turns those into four standard normals, and element ``i`` takes normal
``i % 4``. A rank therefore computes the values of the indices it holds (rounded out to groups of
four) and no others, whatever the layout cuts: one process, TP, FSDP2 (uneven shards too), HSDP,
expert shards, FSDP over TP.

Philox is counter-based (no state to skip ahead through, unlike mt19937), passes BigCrush, and
needs only 32x32-bit multiplies, which int64 tensors compute exactly (``_mulhilo``): the integer
part runs as plain tensor ops on any device and gives the same words on CPU and CUDA.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "clean_name",
    "fill_normal_",
    "init_by_name",
    "init_parameter",
    "local_indices",
    "normal_at",
    "param_seed",
    "philox4x32",
]

_MASK = 0xFFFFFFFF
# Philox-4x32's multipliers and Weyl key increments (Random123's PHILOX_M4x32_* and PHILOX_W32_*).
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
# Elements per chunk. On a CPU, 2**17 per thread: each thread's share of an op on the chunk's
# counters is one of torch's parallel grains (32768 elements), and the temporaries stay in cache
# (fastest of 2**16..2**19 here, on 1 and 2 threads). An accelerator pays a launch per op instead.
_CPU_CHUNK, _DEVICE_CHUNK = 1 << 17, 1 << 24


def _mulhilo(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """High and low 32 bits of ``a * m`` for ``a, m < 2**32``, without overflowing int64.

    ``a * m`` itself can reach 2**64. Both multipliers are above 2**31, so with ``m' = 2**32 - m``
    (below 2**30): ``a * m = a * 2**32 - q``, ``q = a * m' < 2**62``; borrowing one from the high
    word when ``q``'s low word is not zero gives ``hi = a - ceil(q / 2**32)``, ``lo = -q mod 2**32``.
    """
    q = a * (2**32 - m)
    lo = q.neg().bitwise_and_(_MASK)
    hi = a - q.add_(_MASK).bitwise_right_shift_(32)
    return hi, lo


def philox4x32(counter: Sequence[Tensor], key: int, rounds: int = 10) -> Tensor:
    """Philox-4x32-``rounds`` of the four 32-bit ``counter`` words (int64 tensors): words ``[n, 4]``.

    ``key``: 64 bits, its low word Random123's ``key[0]``. Words are int64 tensors holding uint32.

    Example:
        >>> zero = torch.zeros(1, dtype=torch.int64)
        >>> [hex(w) for w in philox4x32((zero, zero, zero, zero), key=0)[0].tolist()]  # Random123's answer
        ['0x6627e8d5', '0xe169c58d', '0xbc57ac4c', '0x9b00dbd8']
    """
    c0, c1, c2, c3 = (c.clone() for c in counter)
    k0, k1 = key & _MASK, (key >> 32) & _MASK
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1.bitwise_xor_(c1).bitwise_xor_(k0), lo1, hi0.bitwise_xor_(c3).bitwise_xor_(k1), lo0
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return torch.stack((c0, c1, c2, c3), dim=-1)


def _normals(counters: Tensor, key: int) -> Tensor:
    """Normals ``[n, 4]`` of counters ``c``: Philox of the words ``(c mod 2**32, c >> 32, 0, 0)``, then Box-Muller."""
    zero = torch.zeros_like(counters)
    return _box_muller(philox4x32((counters & _MASK, counters >> 32, zero, zero), key))


def _box_muller(words: Tensor) -> Tensor:
    """Four standard normals (float64) per row of four 32-bit words: two (radius, angle) pairs."""
    # (w + 0.5) / 2**32 is exact in float64 and never 0, so the log is finite (tails reach 6.7 sigma).
    u = (words.to(torch.float64) + 0.5).mul_(2.0**-32).view(-1, 2, 2)
    radius = u[..., 0].log().mul_(-2.0).sqrt_()
    angle = u[..., 1].mul(2 * math.pi)
    # The words are exact integers, equal on every device. float64 log/cos/sin are not correctly
    # rounded: CUDA's libm, glibc and Sleef (torch's vectorised CPU loops; a loop's leftover
    # elements take glibc) may differ in the last bit, ~0.1% of values between the last two.
    # Rounding to fp32 hides that unless a value sits on a rounding tie (~1e-11 of elements). The
    # mt19937 draw this replaces ran on the CPU only, so CPU- and GPU-built models were
    # bit-identical; they now are up to such ties.
    return torch.stack((radius * angle.cos(), radius * angle.sin()), dim=-1).view(-1, 4)


def normal_at(key: int, index: Tensor) -> Tensor:
    """Standard normals (float64) of the flat element indices ``index``: a pure function of ``(key, index)``.

    Any slice of the full draw equals the draw of that slice's indices, bit for bit. Sorted indices
    are cheapest: four neighbours share one Philox call.

    Example:
        >>> full = normal_at(7, torch.arange(10))
        >>> torch.equal(normal_at(7, torch.arange(3, 6)), full[3:6])
        True
    """
    counters, inverse = torch.unique_consecutive(index >> 2, return_inverse=True)
    return _normals(counters, key).view(-1)[inverse * 4 + (index & 3)]


def _normal_range(key: int, start: int, stop: int, device: torch.device) -> Tensor:
    """``normal_at(key, arange(start, stop))`` without building the index tensor."""
    first = start >> 2
    counters = torch.arange(first, ((stop - 1) >> 2) + 1, device=device)
    return _normals(counters, key).view(-1)[start - 4 * first : stop - 4 * first]


def local_indices(param: Tensor) -> list[Tensor] | None:
    """Per tensor dim, the global indices this rank's shard of the DTensor ``param`` holds, in its order.

    Every placement that selects along one tensor dim (``Shard``, FSDP2-over-TP's ``_StridedShard``,
    uneven shards included) leaves a shard that is the Cartesian product of these lists. Each list
    comes from ``distribute_tensor`` of that dim's ``arange`` under the same placements, so it
    follows torch's own slicing rules. ``None`` for any other placement (``Partial``).
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    indices = []
    for dim, size in enumerate(param.shape):
        placements: list[Replicate | Shard | _StridedShard] = []
        for p in param.placements:  # type: ignore[attr-defined]
            if isinstance(p, _StridedShard):  # before Shard: a subclass of it in older torch
                placements.append(_StridedShard(0, split_factor=p.split_factor) if p.dim == dim else Replicate())
            elif isinstance(p, Shard):
                placements.append(Shard(0) if p.dim == dim else Replicate())
            elif isinstance(p, Replicate):
                placements.append(Replicate())
            else:
                return None
        line = torch.arange(size, device=param.device)
        indices.append(distribute_tensor(line, param.device_mesh, placements, src_data_rank=None).to_local())  # type: ignore[attr-defined]
    return indices


@torch.no_grad()
def fill_normal_(
    target: Tensor, key: int, std: float, shape: Sequence[int], indices: list[Tensor] | None = None
) -> Tensor:
    """Fill ``target`` with the ``N(0, std)`` values of its elements of a ``shape`` parameter, chunk by chunk.

    ``indices``: the global indices ``target`` holds per dim (:func:`local_indices`); ``None`` for
    the whole parameter. Each value is ``float32(std * normal)``, then cast to ``target``'s dtype;
    memory beyond ``target`` is one chunk's temporaries (at least one row of ``target``).

    Example:
        >>> whole = fill_normal_(torch.empty(4, 6), key=1, std=0.02, shape=(4, 6))
        >>> columns = [torch.arange(4), torch.tensor([1, 4])]
        >>> torch.equal(fill_normal_(torch.empty(4, 2), 1, 0.02, (4, 6), columns), whole[:, [1, 4]])
        True
    """
    out = target if target.is_contiguous() else torch.empty_like(target, memory_format=torch.contiguous_format)
    flat = out.view(-1)
    for offset, normals in _chunks(key, shape, indices, flat.numel(), out.device):
        flat[offset : offset + len(normals)] = normals.mul_(std).to(torch.float32)
    if out is not target:
        target.copy_(out)
    return target


def _chunks(
    key: int, shape: Sequence[int], indices: list[Tensor] | None, numel: int, device: torch.device
) -> Iterator[tuple[int, Tensor]]:
    """(local flat offset, normals) of consecutive pieces of the shard, about a chunk's elements each."""
    chunk = _CPU_CHUNK * torch.get_num_threads() if device.type == "cpu" else _DEVICE_CHUNK
    start = _contiguous_start(indices, shape)
    if start is not None:
        for a in range(0, numel, chunk):
            yield a, _normal_range(key, start + a, start + min(a + chunk, numel), device)
        return
    assert indices is not None
    # Strided shards: whole local rows at a time, each row the last dim's indices after its offset.
    rows, inner = _row_offsets(indices, shape), indices[-1]
    per_chunk = max(1, chunk // len(inner))
    for r in range(0, len(rows), per_chunk):
        yield r * len(inner), normal_at(key, (rows[r : r + per_chunk, None] + inner).view(-1))


def _contiguous_start(indices: list[Tensor] | None, shape: Sequence[int]) -> int | None:
    """The shard's first global flat index if it is one contiguous run (whole tensors, dim-0 boxes), else None."""
    if indices is None or not indices or any(len(i) == 0 for i in indices):
        return 0  # whole, 0-d or empty: the range path draws exactly what is there
    if any(len(i) != n for i, n in zip(indices[1:], shape[1:])):
        return None
    rows = indices[0]
    first = int(rows[0])
    if not torch.equal(rows, torch.arange(first, first + len(rows), device=rows.device)):
        return None
    return first * math.prod(shape[1:])


def _row_offsets(indices: list[Tensor], shape: Sequence[int]) -> Tensor:
    """Global flat index of element 0 of the last dim of every local row, in local row-major order."""
    offsets = torch.zeros(1, dtype=torch.int64, device=indices[-1].device)
    for dim in range(len(shape) - 1):
        offsets = (offsets[:, None] + indices[dim] * math.prod(shape[dim + 1 :])).view(-1)
    return offsets


# ----------------------------------------------------------------------------- per parameter
def param_seed(seed: int, fqn: str) -> int:
    """Key of one parameter's draw: a 64-bit hash of the run seed and the parameter's name.

    Depends on nothing else (rank, device, which other parameters exist), so every layout
    initialises a parameter identically. 64 bits: Philox-4x32's key
    (:mod:`~lightning_ultrascale.models.shard_init`); two of 405B's 1,137 names then share a key
    with probability 3.5e-14 (with 32 bits, 1.5e-4).

    Example:
        >>> param_seed(0, "norm.weight") != param_seed(1, "norm.weight")
        True
    """
    return int.from_bytes(hashlib.blake2b(f"{seed}/{fqn}".encode(), digest_size=8).digest(), "little")


#: Names a wrapper inserts into a parameter's name (activation checkpointing, torch.compile, FSDP1).
WRAPPER_COMPONENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def clean_name(fqn: str) -> str:
    """A parameter's name without the components wrappers insert (:data:`WRAPPER_COMPONENTS`).

    Example:
        >>> clean_name("layers.0._checkpoint_wrapped_module.attention.wq.weight")
        'layers.0.attention.wq.weight'
    """
    return ".".join(c for c in fqn.split(".") if c not in WRAPPER_COMPONENTS)


def init_parameter(param: Tensor, name: str, seed: int, std: float | None) -> None:
    """Fill ``param`` (whole, or a rank's DTensor shard) with N(0, std) drawn from ``(seed, name)`` alone;
    with ``std=None``, with ones (norms).

    Each element is a pure function of :func:`param_seed` and its index in the full parameter,
    so every layout, rank and device gets the same full tensor.
    """
    if param.is_meta:
        return  # nothing to draw into (a model built on meta, partly materialised: only those parameters)
    sharded = torch.distributed.is_available() and isinstance(param, _dtensor())
    local = param.to_local() if sharded else param  # type: ignore[attr-defined]
    if std is None:
        local.fill_(1.0)
        return
    key = param_seed(seed, name)
    indices = local_indices(param) if sharded else None
    if sharded and indices is None:
        # A placement that does not select along tensor dims (none of torch's parallelisms
        # gives a parameter one): draw the whole parameter and let torch cut this rank's part.
        from torch.distributed.tensor import distribute_tensor

        full = fill_normal_(torch.empty(param.shape, device=local.device), key, std, param.shape)
        local.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local())  # type: ignore[attr-defined]
    else:
        fill_normal_(local, key, std, param.shape, indices)


def init_by_name(model: nn.Module, seed: int, std_of: Callable[[str], float | None]) -> None:
    """Initialise every parameter of ``model`` from ``(seed, its name)`` alone: what the model contract's
    ``init_weights(seed)`` asks (the same weights under every layout, each rank drawing only its shard).

    ``std_of(name)``: the standard deviation of a parameter's normal draw, or None for 1 (norms).
    Wrapper components are removed from the names first.

    Example:
        >>> from torch import nn
        >>> a, b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
        >>> for m in (a, b):
        ...     init_by_name(m, seed=0, std_of=lambda name: 0.02)
        >>> torch.equal(a.weight, b.weight)
        True
    """
    with torch.no_grad():
        for fqn, param in model.named_parameters():
            name = clean_name(fqn)
            init_parameter(param, name, seed, std_of(name))


def _dtensor() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor
