"""Benchmarks keep running: each script's --quick mode, with its JSON checked for sense (not speed)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quick_run(name: str, tmp_path: Path) -> tuple[dict, str]:
    """Run ``benchmarks/<name>.py --quick``; return its JSON and what it printed."""
    out_file = tmp_path / f"{name}.json"
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--quick", "--out", str(out_file)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out_file.read_text()), out.stdout


def test_dp_benchmark_quick_run_matches_the_ring_formula(tmp_path):
    result, stdout = _quick_run("dp", tmp_path)
    for row in result["comm"]:
        # The traced gradient payload is every parameter's fp32 gradient, once.
        assert row["all_reduce_payload_bytes"] == row["grad_bytes"]
        assert abs(row["ratio"] - 1) < 0.01
    assert result["speed"]["ultrascale_tokens_per_s"] > 0 and result["speed"]["ddp_tokens_per_s"] > 0
    assert "Tokens/s" in stdout


def test_zero_benchmark_quick_run_matches_the_playbook_formulas(tmp_path):
    result, stdout = _quick_run("zero", tmp_path)
    assert "Model state per rank" in stdout and "Tokens/s" in stdout
    rows = result["memory_and_comm"]
    assert {(r["stage"], r["N"]) for r in rows} == {(s, n) for s in range(4) for n in (1, 2, 4)}
    for row in rows:
        where = f"stage {row['stage']} N={row['N']}"
        assert abs(row["memory_ratio"] - 1) < 0.02, f"{where}: model state {row['memory_ratio']:.3f} x formula"
        if row["comm_ratio"] is not None:
            assert abs(row["comm_ratio"] - 1) < 0.01, f"{where}: traffic {row['comm_ratio']:.3f} x formula"
    assert isinstance(result["speed"]["ultrascale_zero3"], float)


def test_tp_benchmark_quick_run_shards_params_and_matches_the_playbook_traffic(tmp_path):
    result, stdout = _quick_run("tp", tmp_path)
    assert "Parameter bytes per rank" in stdout and "Tokens/s" in stdout
    for row in result["params"]:
        assert abs(row["sharded_ratio"] - 1) < 0.01, f"tp={row['tp']}: sharded params {row['sharded_ratio']:.3f} x Ψ/tp"
    activations = {(a["tp"], a["sequence_parallel"]): a["total"] for a in result["activations"]}
    assert activations[2, True] < activations[2, False] < activations[1, False]
    comm = {(r["tp"], r["sequence_parallel"]): r for r in result["comm"]}
    assert abs(comm[2, True]["block_wire_ratio"] - 1) < 0.01, comm[2, True]["block_forward_backward"]
    tp = comm[2, False]
    # Without SP: 2 all-reduces in forward and 2 in backward per block (the playbook's 4).
    assert abs(tp["block_wire_ratio"] - 1) < 0.01, tp["block_forward_backward"]
