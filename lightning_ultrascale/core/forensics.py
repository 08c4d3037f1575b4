"""Who a hung collective waits for: every rank's recent collectives, compared group by group.

torch's flight recorder keeps, in every process, a ring buffer of the collectives it issued: op,
process group, sequence number on that group, tensor sizes and dtypes, and whether each has
ended. On gloo (torch 2.13) it is on by default (``TORCH_FR_BUFFER_SIZE``, 2000 entries) and sees
every collective, ours, FSDP2's and DTensor's alike. Reading it is a C++ call under the recorder's
own lock, so a watchdog thread reads it while the main thread is stuck in a collective (which
releases the GIL) or in Python. gloo marks a collective ended when it fails too, so a failed rank's
last collective is taken as where it failed. :func:`snapshot` turns this rank's record into a short
summary (its last collective on each group, those still in flight, the last few that finished);
:func:`diagnose` compares the summaries of all ranks: on a group where the reporting rank is ahead
of some members, the first collective they lack is the hung one, and each member that lacks it
either never arrived (in no collective) or skipped it (it is in another one). All ranks of a group
issue the same collectives in the same order, so equal sequence numbers name the same call on
every rank.

Under NCCL the main thread rarely sees the timeout (NCCL's own watchdog ends the process); there
torch's dumps (``TORCH_NCCL_DUMP_ON_TIMEOUT``, the launch scripts set them) and its ``torchfrtrace``
analyser are the record, and this summary is written only when the failing rank's Python lives on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from lightning_ultrascale.utils.memory import format_bytes

#: The file the reporting rank writes into the run directory.
REPORT_FILE = "collective-hang.json"
_FINISHED, _IN_FLIGHT = "finished", "in flight"
_RECENT = 6  # records a rank reports besides its last per group and those in flight
_SHOWN = 8  # absent ranks the line names (the report file has them all)
_SAME_SIZES = {"all_reduce", "broadcast"}  # ops whose tensors are alike on every rank (all-to-all's splits may not be)
# c10's dtype names, as the flight recorder writes them.
_DTYPES = {
    "Float": torch.float32,
    "BFloat16": torch.bfloat16,
    "Half": torch.float16,
    "Double": torch.float64,
    "Long": torch.int64,
    "Int": torch.int32,
    "Short": torch.int16,
    "Char": torch.int8,
    "Byte": torch.uint8,
    "Bool": torch.bool,
    "Float8_e4m3fn": torch.float8_e4m3fn,
    "Float8_e5m2": torch.float8_e5m2,
}
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def _flight_record() -> list[dict[str, Any]]:
    """Every entry of this process's flight recorders (gloo's; NCCL's in a CUDA build), oldest first."""
    entries: dict[tuple[Any, ...], dict[str, Any]] = {}
    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        dump = getattr(c10d, name, None)  # NCCL's exists in CUDA builds only
        if dump is not None:
            for e in json.loads(dump(True, False)).get("entries", []):
                key = (e["time_created_ns"], e["process_group"][0], e["collective_seq_id"], e["p2p_seq_id"])
                entries[key] = e
    return sorted(entries.values(), key=lambda e: e["time_created_ns"])


def _record(entry: dict[str, Any]) -> dict[str, Any]:
    """One flight-recorder entry in our words: op, group, sequence number, bytes and dtype, state."""
    name, desc = entry["process_group"]
    dtypes = [_DTYPES.get(d) for d in entry["input_dtypes"]]
    numels = [int(torch.Size(s).numel()) for s in entry["input_sizes"]]
    known = all(dtypes)
    finished = entry["retired"] or entry["state"] == "completed"
    return {
        "op": entry["profiling_name"].split(":")[-1],
        "group": name,
        "label": _label(desc),
        "seq": entry["p2p_seq_id"] if entry["is_p2p"] else entry["collective_seq_id"],
        "p2p": entry["is_p2p"],
        "bytes": sum(n * d.itemsize for n, d in zip(numels, dtypes)) if known else None,  # type: ignore[union-attr]
        "dtype": ",".join(sorted({_SHORT.get(d, str(d).removeprefix("torch.")) for d in dtypes if d})),
        "sizes": entry["input_sizes"],
        "state": _FINISHED if finished else _IN_FLIGHT,
    }


def _label(desc: str) -> str:
    """A group's name in the report: the mesh dimension, ``world``, or nothing (a ``new_group``: named by number)."""
    if desc == "default_pg":
        return "world"
    return "" if desc == "undefined" else desc.removeprefix("mesh_")


def _group_ranks() -> dict[str, list[int]]:
    """The global ranks of every live process group this rank belongs to, by group name."""
    return {name: dist.get_process_group_ranks(pg) for pg, name in list(dist.distributed_c10d._world.pg_names.items())}


def snapshot(rank: int, failed: str | None = None, since_ns: int = 0) -> dict[str, Any]:
    """This rank's collectives since ``since_ns`` (wall clock): its last per group, those in flight, the last few.

    ``failed`` is the reason this rank failed, if it did (then its last record is where, whatever its state).
    """
    records = [_record(e) for e in _flight_record() if e["time_created_ns"] >= since_ns]
    last_per_group = {r["group"]: i for i, r in enumerate(records) if not r["p2p"]}
    in_flight = [i for i, r in enumerate(records) if r["state"] == _IN_FLIGHT][:16]
    keep = sorted({*last_per_group.values(), *in_flight, *range(max(0, len(records) - _RECENT), len(records))})
    kept = [records[i] for i in keep]
    ranks = _group_ranks()
    groups = {r["group"]: ranks.get(r["group"], []) for r in kept}
    return {"rank": rank, "failed": failed, "records": kept, "groups": groups}


def describe(record: dict[str, Any], groups: dict[str, list[int]] | None = None) -> str:
    """``all_reduce #42 on dp_shard (ranks 0-3), 4.0 MiB fp32``: the op, its group and what it moves."""
    where = record["label"] or f"group {record['group']}"
    text = f"{record['op']} #{record['seq']} on {where}"
    if groups and groups.get(record["group"]):
        text += f" (ranks {rank_ranges(groups[record['group']])})"
    if record["bytes"] is not None:
        text += f", {format_bytes(record['bytes'])} {record['dtype']}".rstrip()
    return text


def summary(state: dict[str, Any]) -> str:
    """One line: the collective this rank is in (or none) and the last ones it finished."""
    records, groups = state["records"], state["groups"]
    now = _current(state)
    where = f"in {describe(now, groups)}" if now else "in no collective"
    if state["failed"]:
        where = f"failed; last issued: {describe(records[-1], groups)}" if records else "failed"
    done = [describe(r) for r in records if r["state"] == _FINISHED and r is not now][-3:]
    return f"{where}; finished last: {' | '.join(done) or 'none'}"


def _current(state: dict[str, Any]) -> dict[str, Any] | None:
    """The collective a rank is in: its first still in flight (a failed rank: its last one issued)."""
    in_flight = [r for r in state["records"] if r["state"] == _IN_FLIGHT]
    if in_flight:
        return in_flight[0]
    return state["records"][-1] if state["failed"] and state["records"] else None


def _last_on(state: dict[str, Any], group: str) -> dict[str, Any] | None:
    return next((r for r in reversed(state["records"]) if r["group"] == group and not r["p2p"]), None)


def _hung(states: dict[int, dict[str, Any] | None], reporter: int) -> tuple[str, int] | None:
    """(group, sequence number) of the first collective the reporter issued that a member of its group lacks.

    A member with no record on a group at all is left out here: its record may have left the ring buffer.
    """
    mine = states[reporter]
    assert mine is not None
    found: list[tuple[int, str, int]] = []
    for group, members in mine["groups"].items():
        mine_last = _last_on(mine, group)
        lasts = [last["seq"] for r in members if (s := states.get(r)) and (last := _last_on(s, group))]
        if mine_last is None or min(lasts) >= mine_last["seq"]:
            continue
        first_missing = min(lasts) + 1
        at = next(
            i
            for i, r in enumerate(mine["records"])
            if (r["group"], r["p2p"]) == (group, False) and r["seq"] >= first_missing
        )
        found.append((at, group, first_missing))
    return min(found)[1:] if found else None


def diagnose(states: dict[int, dict[str, Any] | None], reporter: int) -> tuple[str, dict[str, Any]] | None:
    """The hung collective and each member that is not in it, or None when every member is (no hang to name).

    ``states`` maps every rank to its :func:`snapshot`, or None where the rank did not answer. The hung
    collective is the first one some member of one of the reporter's groups lacks, else the reporter's
    last one. Returns one line (``all_reduce #42 on dp (ranks 0-3), 4.0 MiB fp32: rank 2 never arrived
    (...)``) and the same as a dict for the report file.
    """
    mine = states[reporter]
    collectives = [r for r in mine["records"] if not r["p2p"]] if mine else []
    if mine is None or not collectives:
        return None
    group, seq = _hung(states, reporter) or (collectives[-1]["group"], collectives[-1]["seq"])
    record = next((r for r in collectives if (r["group"], r["seq"]) == (group, seq)), None)
    if record is None:  # out of the reporter's summary: name it by group and number only
        record = {**collectives[-1], "group": group, "seq": seq, "op": "collective", "bytes": None}
    members = mine["groups"][group] or sorted(states)
    absent = [a for r in members if r != reporter and (a := _absence(r, states.get(r), record))]
    if not absent:
        return None
    shown = "; ".join(a["text"] for a in absent[:_SHOWN])
    more = f"; and {len(absent) - _SHOWN} more ranks" if len(absent) > _SHOWN else ""
    line = f"{describe(record, mine['groups'])}: {shown}{more}"
    return line, {"collective": record, "group_ranks": members, "absent": absent}


def _absence(rank: int, state: dict[str, Any] | None, hung: dict[str, Any]) -> dict[str, Any] | None:
    """Why ``rank`` is not in the ``hung`` collective, or None if it is."""
    if state is None:
        return {"rank": rank, "why": "no answer", "text": f"rank {rank} did not answer (its process is gone or stuck)"}
    last, now = _last_on(state, hung["group"]), _current(state)
    if last is not None and last["seq"] > hung["seq"]:
        return None
    if last is not None and last["seq"] == hung["seq"]:
        sizes_differ = hung["op"] in _SAME_SIZES and last["sizes"] != hung["sizes"]
        if hung["op"] == "collective" or (last["op"] == hung["op"] and not sizes_differ):
            return None
        text = f"rank {rank} called {describe(last)} instead"
        return {"rank": rank, "why": "mismatch", "text": text, "in": last}
    if now is not None:
        return {"rank": rank, "why": "skipped", "text": f"rank {rank} skipped it (it is in {describe(now)})", "in": now}
    finished = [r for r in state["records"] if r["state"] == _FINISHED]
    was = f"its last collective: {describe(finished[-1])}, finished" if finished else "it issued no collective yet"
    return {"rank": rank, "why": "never arrived", "text": f"rank {rank} never arrived ({was})"}


def write_report(path: Path, line: str, found: dict[str, Any], states: dict[int, dict[str, Any] | None]) -> Path:
    """The report as JSON: the line, the hung collective, who is absent and why, every rank's collectives."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ranks = {str(r): s for r, s in sorted(states.items())}
    path.write_text(json.dumps({"error": line, **found, "ranks": ranks}, indent=1) + "\n")
    return path


def timed_out(reason: str) -> bool:
    """Whether a failure's message says a timeout (gloo: "Timed out waiting", NCCL: "Watchdog caught ... timeout")."""
    return re.search(r"time[d ]*out", reason, re.IGNORECASE) is not None


def rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 3, 6]`` as ``0-3, 6``.

    Example:
        >>> rank_ranges([0, 1, 2, 3, 6, 8, 9])
        '0-3, 6, 8-9'
    """
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
