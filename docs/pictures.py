"""Draw the documentation's pictures from the library's own functions: ``python docs/pictures.py``.

Nothing is drawn by hand: every picture is computed here from the code it describes, so it changes when
the code does (``tests/e2e/test_docs.py`` redraws them and checks that each is shown on its page).

=================================  ===================================================================
picture                            drawn from
=================================  ===================================================================
``pipeline/<schedule>.png``        the schedule simulator (torch's own action order, p=4, m=8)
``pictures/zero_memory.png``       the playbook's ZeRO formulas (``utils.memory``), Llama 3 8B on 8 ranks
``pictures/cp_assignment.png``     the ring's and zig-zag's token assignment (``local_positions``)
``pictures/ring_steps.png``        the zig-zag ring's work per rank and step, dense and packed (``ring_plan``)
``pictures/planner_heatmap.png``   the planner's search (Llama 3 70B on 512 H100s), ``ultrascale-plan --plot``
``pictures/tp_block.png``          the tensor-parallel plan of one Llama block (``llama_tp_plan``, with SP)
``pictures/fp8_loss.png``          the FP8 benchmark's measured loss curves (``benchmarks/results/fp8.json``)
``pictures/muon_loss.png``         Muon's and AdamW's best measured curves (``benchmarks/results/muon.json``)
``pictures/stragglers.png``        the straggler report of a real 4-process run with one rank slowed (gloo)
=================================  ===================================================================
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: object, out: Path, name: str) -> Path:
    """Write ``fig`` as ``<out>/pictures/<name>.png`` and close it."""
    plt = _pyplot()
    path = out / "pictures" / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight", dpi=110)  # type: ignore[attr-defined]
    plt.close(fig)
    return path


def pipeline(out: Path) -> list[Path]:
    from lightning_ultrascale.parallel.pipeline import SCHEDULES
    from lightning_ultrascale.parallel.pipeline.simulator import simulate

    paths = []
    for name in SCHEDULES:
        path = out / "pipeline" / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        simulate(name, p=4, m=8).render_png(path)
        paths.append(path)
    return paths


def zero_memory(out: Path) -> list[Path]:
    from lightning_ultrascale.models import get_model_config
    from lightning_ultrascale.utils.memory import playbook_model_state_bytes

    plt = _pyplot()
    n = get_model_config("llama3_8b").num_params()
    stages = [playbook_model_state_bytes(n, stage=s, dp=8) for s in range(4)]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    bottom = [0.0] * 4
    for part, colour in (("params", "#5b8def"), ("grads", "#f0a04b"), ("optimizer_states", "#6cc07a")):
        values = [getattr(s, part) / 2**30 for s in stages]
        ax.bar([f"ZeRO-{s}" for s in range(4)], values, bottom=bottom, label=part.replace("_", " "), color=colour)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.1f} GiB", ha="center", va="bottom")
    ax.set_ylabel("model state per rank (GiB)")
    ax.set_title(f"Llama 3 8B ({n / 1e9:.2f}B parameters), bf16 + fp32 Adam, 8 data-parallel ranks")
    ax.legend()
    return [_save(fig, out, "zero_memory")]


def cp_assignment(out: Path) -> list[Path]:
    from lightning_ultrascale.parallel.context.attention import local_positions

    plt = _pyplot()
    seq, cp = 16, 4
    fig, axes = plt.subplots(2, 1, figsize=(7, 2.8), gridspec_kw={"hspace": 0.6})
    for ax, method in zip(axes, ("ring", "zigzag_ring")):
        owner = [0] * seq
        for rank in range(cp):
            for pos in local_positions(method, seq, cp, rank).tolist():
                owner[pos] = rank
        ax.imshow([owner], cmap="tab10", vmin=0, vmax=9, aspect="auto")
        for pos, rank in enumerate(owner):
            ax.text(pos, 0, str(rank), ha="center", va="center", color="white")
        ax.set_yticks([])
        ax.set_xticks(range(seq))
        ax.set_ylabel(method, rotation=0, ha="right", va="center")
    axes[0].set_title(f"which cp rank holds each token (sequence of {seq}, cp={cp}): zig-zag balances causal work")
    axes[1].set_xlabel("token position")
    return [_save(fig, out, "cp_assignment")]


def ring_steps(out: Path) -> list[Path]:
    import torch

    from lightning_ultrascale.parallel.context.attention import ring_plan

    plt = _pyplot()
    cp, local = 4, 16
    lengths = torch.tensor([20, 5, 30, 9])  # one window of 64 tokens packed with four documents
    documents = torch.repeat_interleave(torch.arange(4), lengths)[None]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, (title, docs) in zip(axes, (("dense causal", None), ("packed documents 20+5+30+9", documents))):
        plan = ring_plan("zigzag_ring", cp, local, docs)
        work = [[0.0] * cp for _ in range(cp)]
        for rank in range(cp):
            for step in range(cp):
                blocks = plan.blocks[rank][(rank - step) % cp]
                pairs = sum((b.q.stop - b.q.start) * (b.k.stop - b.k.start) / (2 if b.causal else 1) for b in blocks)
                work[rank][step] = pairs / local**2
        ax.imshow(work, cmap="Blues", vmin=0, vmax=1)
        for rank in range(cp):
            for step in range(cp):
                ax.text(step, rank, "skip" if work[rank][step] == 0 else f"{work[rank][step]:.2f}", ha="center",
                        va="center", fontsize=8)  # fmt: skip
        ax.set_xticks(range(cp), [f"step {t}" for t in range(cp)])
        ax.set_yticks(range(cp), [f"rank {r}" for r in range(cp)])
        ax.set_title(f"zig-zag ring, cp={cp}: {title}", fontsize=9)
    fig.suptitle("share of a full block's query-key pairs each rank computes at each ring step", fontsize=9)
    return [_save(fig, out, "ring_steps")]


def planner_heatmap(out: Path) -> list[Path]:
    from lightning_ultrascale.cli.plan import heatmap
    from lightning_ultrascale.models import get_model_config
    from lightning_ultrascale.plan import Workload
    from lightning_ultrascale.plan.search import search

    workload = Workload(get_model_config("llama3_70b"), seq_len=4096, global_batch_size=1024, precision="bf16-mixed")
    result = search(workload, world_size=512, gpu="h100")
    path = out / "pictures" / "planner_heatmap.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    heatmap(result, str(path))
    return [path]


def _layout(placements: object) -> str:
    """A DTensor placement tuple in words: sequence-sharded, feature-sharded or replicated."""
    first = placements[0] if isinstance(placements, tuple) and placements else placements
    text = repr(first)
    return {"Shard(dim=1)": "seq-sharded", "Shard(dim=-1)": "feature-sharded", "Replicate()": "replicated"}.get(
        text, text
    )


def tp_block(out: Path) -> list[Path]:
    from lightning_ultrascale.models import get_model_config
    from lightning_ultrascale.models.common.tp_plan import llama_tp_plan

    plt = _pyplot()
    _, blocks = llama_tp_plan(get_model_config("llama_tiny"), sequence_parallel=True)
    plan = blocks["0"]
    order = ["attention_norm", "attention.wq", "attention.wk", "attention.wv", "attention.wo",
             "ffn_norm", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"]  # fmt: skip
    colours = {"SequenceParallel": "#9ecae1", "ColwiseParallel": "#fdae6b", "RowwiseParallel": "#a1d99b"}
    fig, ax = plt.subplots(figsize=(13, 3.0))
    for i, name in enumerate(order):
        style = plan[name]
        kind = type(style).__name__
        ax.add_patch(plt.Rectangle((i * 1.4, 0), 1.2, 1.0, color=colours[kind]))
        x, label = i * 1.4 + 0.6, name.split(".")[-1].replace("attention_", "attn_")
        ax.text(x, 0.62, label, ha="center", fontsize=10, weight="bold")
        ax.text(x, 0.35, kind.removesuffix("Parallel").lower(), ha="center", fontsize=9)
        output = getattr(style, "output_layouts", None)
        ax.text(x, -0.35, "out:\n" + (_layout(output) if output else "seq-sharded"), ha="center", fontsize=8)
        parent = name.rsplit(".", 1)[0]
        if "." in name and name.endswith(("wq", "w1")):
            ax.text(i * 1.4, 1.15, f"{parent} input: {_layout(plan[parent].desired_input_layouts)} (all-gather)",
                    fontsize=8)  # fmt: skip
    ax.set_xlim(-0.2, len(order) * 1.4)
    ax.set_ylim(-0.6, 1.5)
    ax.axis("off")
    ax.set_title("One Llama block under tensor + sequence parallelism (llama_tp_plan): colwise splits heads and "
                 "hidden units, rowwise reduce-scatters back to sequence shards", fontsize=9)  # fmt: skip
    return [_save(fig, out, "tp_block")]


def fp8_loss(out: Path) -> list[Path]:
    import json

    plt = _pyplot()
    result = json.loads((DOCS.parent / "benchmarks" / "results" / "fp8.json").read_text())
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for curve in result["curves"]:
        ax.plot(range(1, len(curve["losses"]) + 1), curve["losses"], label=curve["run"], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{result['model']}: bf16 against the FP8 recipes (benchmarks/fp8.py, CPU)")
    ax.legend()
    return [_save(fig, out, "fp8_loss")]


def muon_loss(out: Path) -> list[Path]:
    import json

    plt = _pyplot()
    result = json.loads((DOCS.parent / "benchmarks" / "results" / "muon.json").read_text())
    fig, axes = plt.subplots(1, len(result["curves"]), figsize=(9.6, 3.4))
    for ax, curve in zip(axes, result["curves"]):
        for run in curve["runs"]:
            if curve["best_lr"][run["optimizer"]] == run["lr"]:
                tokens = [(i + 1) * curve["tokens_per_step"] / 1e6 for i in range(len(run["losses"]))]
                ax.plot(tokens, run["losses"], linewidth=1, label=f"{run['optimizer']}, lr {run['lr']:g}")
        ax.set_xlabel("tokens (millions)")
        ax.set_ylabel("training loss")
        ax.set_title(f"{curve['model']}: each optimizer at its best rate", fontsize=9)
        ax.legend()
    return [_save(fig, out, "muon_loss")]


def _slowed_run(slow_rank: int) -> tuple[list[float], str]:
    """One rank of a 4-process ZeRO-0 run of llama_tiny whose rank ``slow_rank`` sleeps 0.3 s in every forward."""
    import time

    import lightning as L

    from lightning_ultrascale import LlamaModule, UltraScaleDataModule, UltraScaleStrategy, ZeRO
    from lightning_ultrascale.testing.parity import QUIET_TRAINER
    from lightning_ultrascale.training.stragglers import StragglerMonitor

    class SlowForward(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if trainer.global_rank == slow_rank:
                pl_module.model.register_forward_hook(lambda *args: time.sleep(0.3))

    monitor = StragglerMonitor(slow_ratio=1.25, min_gap_s=0.1)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=UltraScaleStrategy(ZeRO(stage=0)), max_steps=6,
                        log_every_n_steps=3, callbacks=[monitor, SlowForward()], **QUIET_TRAINER)  # fmt: skip
    trainer.fit(LlamaModule("llama_tiny"), datamodule=UltraScaleDataModule(seq_len=64, micro_batch_size=2))
    figures = monitor.figures
    assert figures is not None
    return list(figures.compute_s), figures.describe(slow_rank)


def stragglers(out: Path) -> list[Path]:
    from lightning_ultrascale.testing import run_workers

    slow = 2
    compute_s, line = run_workers(_slowed_run, 4, slow)[0]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ax.bar(range(4), compute_s, color=["#d62728" if r == slow else "#1f77b4" for r in range(4)])
    ax.axhline(sorted(compute_s)[1], color="k", linestyle="--", linewidth=1, label="median of the ranks")
    ax.set_xticks(range(4), [f"rank {r}" for r in range(4)])
    ax.set_ylabel("compute s per step (waits excluded)")
    ax.set_title("straggler report, 4 CPU processes, rank 2 slowed:\n" + line, fontsize=8)
    ax.legend()
    return [_save(fig, out, "stragglers")]


PICTURES = {"pipeline": pipeline, "zero_memory": zero_memory, "cp_assignment": cp_assignment, "ring_steps": ring_steps,
            "planner_heatmap": planner_heatmap, "tp_block": tp_block, "fp8_loss": fp8_loss,
            "muon_loss": muon_loss, "stragglers": stragglers}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DOCS, help="where to write (default: docs/)")
    parser.add_argument("--only", default=",".join(PICTURES), help="comma-separated; default: all")
    args = parser.parse_args()
    for name in args.only.split(","):
        for path in PICTURES[name](args.out):
            print(path)


if __name__ == "__main__":
    main()
