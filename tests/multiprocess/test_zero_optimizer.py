"""ZeRO-1/2 sharded optimizer: parity with one process, 1/N memory, overlap, 2Ψ traffic, sharded checkpoints."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.parallel.data import sharded_optimizer
from lightning_ultrascale.parallel.data.sharded_optimizer import ZeroEngine
from lightning_ultrascale.testing import WorkerError, run_pooled, run_workers
from lightning_ultrascale.utils.comm import CommTracer
from lightning_ultrascale.utils.memory import model_state_bytes

GLOBAL_BATCH = 16
LR = 1e-2
CLIP = 0.05  # well below the gradient norms of this model: clipping is active every step
# Small buckets: one per parameter (7 buckets). The 3-element bias and the 6-element unused
# parameter are split unevenly, leaving rank 3 of 4 an empty shard of each.
BUCKET_BYTES = 40


class _MLP(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
        self.unused = nn.Parameter(torch.randn(6))  # never in the graph: its gradient slot is zeros

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _adamw(model: nn.Module, lr: float = LR) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))


def _shard_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _setup(stage: int, bucket_bytes: int = BUCKET_BYTES, seed: int = 0):
    model = _MLP(seed)
    engine = ZeroEngine(list(model.parameters()), _mesh(), stage=stage, bucket_bytes=bucket_bytes, parts=[model])
    optimizer = _adamw(model)
    engine.attach(optimizer)
    return model, engine, optimizer


def _train_step(
    model, engine, optimizer, step: int, accumulate: int = 1, clip: float | None = None, set_to_none: bool = True
):
    """One step on this rank's slice of the global batch, as Lightning runs it. Returns (global loss, norm)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    x, y = _batch(step)
    x, y = x.chunk(n)[rank].chunk(accumulate), y.chunk(n)[rank].chunk(accumulate)
    local_loss = torch.zeros(())
    for micro in range(accumulate):
        loss = nn.functional.mse_loss(model(x[micro]), y[micro]) / accumulate
        with engine.no_sync() if micro < accumulate - 1 else torch.enable_grad():
            loss.backward()
        local_loss += loss.detach()
    norm = None
    if clip is not None:
        # What Lightning's gradient clipping does: clip the optimizer's params (our DTensor shards).
        norm = torch.nn.utils.clip_grad_norm_(_shard_params(optimizer), clip)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    optimizer.step()
    # Lightning sets them to None: the next reduce-scatter must give a fresh gradient. Zeroed in
    # place instead, the next one must accumulate into the zeros.
    optimizer.zero_grad(set_to_none=set_to_none)
    dist.all_reduce(local_loss)
    return local_loss.item() / n, norm


def _train_worker(stage: int, steps: int, accumulate: int, clip: float | None, set_to_none: bool):
    model, engine, optimizer = _setup(stage)
    results = [_train_step(model, engine, optimizer, s, accumulate, clip, set_to_none) for s in range(steps)]
    return [loss for loss, _ in results], [norm for _, norm in results], model.state_dict()


def _reference(steps: int, clip: float | None):
    model = _MLP()
    optimizer = _adamw(model)
    losses, norms = [], []
    for step in range(steps):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms, model.state_dict()


@pytest.mark.parametrize(
    ("stage", "world_size", "accumulate", "clip", "set_to_none"),
    [
        (1, 2, 1, None, True),
        (2, 2, 1, None, True),
        (1, 4, 1, None, True),
        (2, 4, 1, None, True),
        (1, 2, 2, None, True),
        (2, 4, 2, None, True),
        (1, 4, 1, CLIP, True),
        (2, 2, 2, CLIP, True),
        (2, 2, 1, None, False),
    ],
)
def test_zero_matches_one_process_with_adamw(stage, world_size, accumulate, clip, set_to_none):
    steps = 5
    ref_losses, ref_norms, ref_params = _reference(steps, clip)
    args = (stage, steps, accumulate, clip, set_to_none)
    losses, norms, params = run_pooled(_train_worker, world_size, *args)[0]
    # Measured: losses within 1e-7 relative, parameters within 6e-8 absolute; relative differences
    # reach 1.5e-5 only on elements passing near zero, hence atol 1e-7 (~1 float32 ulp at |w| ~ 1).
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    if clip is not None:
        # The global norm over all shards, not this rank's part of it.
        torch.testing.assert_close(torch.stack(norms), torch.stack(ref_norms), rtol=1e-5, atol=0)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.equal(params["unused"], ref_params["unused"]), "an unused, undecayed parameter must not move"


def _memory_worker(stage: int):
    model, engine, optimizer = _setup(stage)
    _train_step(model, engine, optimizer, 0)
    x, y = _batch(1)
    nn.functional.mse_loss(model(x), y).backward()  # measured here: after backward, before the step
    measured = model_state_bytes(model, optimizer, extra_grad_buffers=engine.grad_buffers)
    model_grads = [p.grad for p in model.parameters()]
    return measured, len(engine.buckets), model_grads


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_memory_is_one_nth(stage):
    n = 4
    reference = _MLP()
    unsharded_opt = _adamw(reference)
    nn.functional.mse_loss(reference(_batch(0)[0]), _batch(0)[1]).backward()
    reference.unused.grad = torch.zeros_like(reference.unused)  # so its Adam state exists, as ours does
    unsharded_opt.step()
    unsharded = model_state_bytes(reference, unsharded_opt)
    psi = 4 * sum(p.numel() for p in reference.parameters())  # fp32 bytes of all parameters
    n_params = len(list(reference.parameters()))

    for rank, (measured, n_buckets, model_grads) in enumerate(run_pooled(_memory_worker, n, stage)):
        # Padding: at most N-1 elements per bucket (4 B each), in params, full grads and shards.
        pad = 4 * (n - 1) * n_buckets
        assert psi <= measured.params <= psi + pad, "parameters stay replicated"
        # Adam: exp_avg + exp_avg_sq of this rank's shard (uneven split: within N-1 elements per
        # bucket of 1/N) and one 4-byte step tensor per bucket instead of one per parameter.
        expected_opt = (unsharded.optimizer_states - 4 * n_params) / n + 4 * n_buckets
        assert abs(measured.optimizer_states - expected_opt) <= 2 * pad, (rank, measured, unsharded)
        if stage == 2:
            assert abs(measured.grads - psi / n) <= pad, f"ZeRO-2 grads must be Ψ/N: {measured}"
            assert all(g is None for g in model_grads), "ZeRO-2 frees the full gradient buckets"
        else:
            # The playbook's ZeRO-1: the full gradient buffer (Ψ); the reduced shard is a slice of it.
            assert psi <= measured.grads <= psi + pad, f"ZeRO-1 grads must be Ψ: {measured}"
            assert all(g is not None for g in model_grads), "ZeRO-1 keeps the full gradient buffers"


def _overlap_worker():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    # ~2 layers per bucket: 3 buckets.
    engine = ZeroEngine(list(model.parameters()), _mesh(), stage=2, bucket_bytes=2 * 33 * 32 * 4, parts=[model])
    engine.attach(torch.optim.AdamW(model.parameters()))
    events = []
    model[0].register_full_backward_hook(lambda *a: events.append(("first_layer_backward", len(engine.launch_log))))
    model(torch.randn(4, 32) * (dist.get_rank() + 1)).sum().backward()
    grads = engine.full_grads()
    return len(engine.buckets), engine.launch_log, events, [grads[p] for p in model.parameters()]


def test_zero_reduce_scatters_start_before_backward_finishes():
    for n_buckets, launch_log, events, _ in run_pooled(_overlap_worker, 2):
        assert n_buckets == 3
        assert [i for i, _ in launch_log] == [0, 1, 2], "buckets must launch in index order on every rank"
        # When the first layer's backward ran, the buckets of the last layers were already in flight.
        assert events == [("first_layer_backward", 2)]
        assert [during for _, during in launch_log] == [True, True, True]


def test_zero_gradients_are_the_mean_over_ranks():
    results = run_pooled(_overlap_worker, 2)
    per_rank = []
    for rank in range(2):
        torch.manual_seed(0)  # the worker's model and input, drawn in the same order
        model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
        model(torch.randn(4, 32) * (rank + 1)).sum().backward()
        per_rank.append([p.grad for p in model.parameters()])
    for got0, got1, g0, g1 in zip(results[0][3], results[1][3], *per_rank):
        torch.testing.assert_close(got0, (g0 + g1) / 2, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got1, got0, rtol=0, atol=0)


class _GatherLog:
    """Each all-gather's launch and wait, by the index of the bucket it fills, and each layer's forward."""

    def __init__(self, engine: ZeroEngine, layers: list[nn.Module]) -> None:
        self.engine = engine
        self.events: list[tuple[str, int]] = []
        self._all_gather = sharded_optimizer._all_gather
        sharded_optimizer._all_gather = self._launch  # a fresh worker's module (run_workers): no other test sees it
        for index, layer in enumerate(layers):  # after the engine's own pre-hooks: they run first
            layer.register_forward_pre_hook(lambda *_, i=index: self.events.append(("forward", i)))

    def _launch(self, output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = self._all_gather(output, *args, **kwargs)
        index = next(i for i, b in enumerate(self.engine.buckets) if b.flat_params is output)
        self.events.append(("launch", index))
        log = self.events

        class Logged:
            def wait(self) -> None:
                log.append(("wait", index))
                work.wait()

        return Logged()

    def take(self) -> list[tuple[str, int]]:
        events, self.events[:] = list(self.events), []
        return events


def _six_layers(bucket_layers: int = 2):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    bucket_bytes = bucket_layers * 33 * 32 * 4  # 6 / bucket_layers buckets, the last layers' first
    engine = ZeroEngine(list(model.parameters()), _mesh(), stage=2, bucket_bytes=bucket_bytes, parts=[model])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.attach(optimizer)
    return model, engine, optimizer, _GatherLog(engine, list(model))


def _lazy_gather_worker():
    model, engine, optimizer, log = _six_layers()
    x = torch.randn(4, 32) * (dist.get_rank() + 1)
    model(x).sum().backward()
    log.take()
    with CommTracer() as tracer:
        optimizer.step()
    stepped = log.take()
    model(x).sum().backward()  # the next forward waits; backward (ZeRO-2's reduce-scatters) has nothing to wait for
    forward = log.take()
    model(x)  # a second forward (a recomputation re-runs the pre-hooks): nothing left to wait for
    return len(engine.buckets), tracer.summary(), stepped, forward, log.take()


def test_zero_all_gathers_launch_at_the_step_and_each_waits_for_the_first_layer_needing_it():
    # Fresh processes: _GatherLog patches a module.
    for n_buckets, comms, stepped, forward, again in run_workers(_lazy_gather_worker, 2):
        assert n_buckets == 3  # bucket 0 holds layers 4-5, bucket 2 layers 0-1
        assert comms["world"]["all_gather"]["calls"] == 3
        # Launched by the step in the order the forward needs them, and none waited for there.
        assert stepped == [("launch", 2), ("launch", 1), ("launch", 0)]
        # Layer 0 computes while the gathers of layers 2-5 are still in flight.
        assert forward == [
            ("wait", 2), ("forward", 0), ("forward", 1),
            ("wait", 1), ("forward", 2), ("forward", 3),
            ("wait", 0), ("forward", 4), ("forward", 5),
        ]  # fmt: skip
        assert again == [("forward", i) for i in range(6)]


def _readers_worker():
    model, engine, optimizer, log = _six_layers()
    x = torch.randn(4, 32) * (dist.get_rank() + 1)
    model(x).sum().backward()
    optimizer.step()
    log.take()
    model.state_dict()  # checkpoints: every holder waits for its buckets
    after_state_dict = log.take()
    optimizer.step()
    log.take()
    optimizer.step()  # a second step with no forward: the update must not race the gathers' input
    second_step = log.take()

    def closure() -> torch.Tensor:
        loss = model(x).sum()
        loss.backward()
        return loss

    optimizer.step(closure)  # Lightning's form: forward and backward inside step()
    closure_step = log.take()
    engine.state_dict({p: [n] for n, p in model.named_parameters()})  # the optimizer-state checkpoint
    engine.wait_for_parameters()
    engine.wait_for_parameters()  # idempotent
    return after_state_dict, second_step, closure_step, log.take()


def test_zero_every_reader_of_the_parameters_waits_for_their_gathers():
    # Fresh processes: _GatherLog patches a module.
    for after_state_dict, second_step, closure_step, after_state in run_workers(_readers_worker, 2):
        assert after_state_dict == [("wait", 2), ("wait", 1), ("wait", 0)]
        assert second_step == [("wait", 0), ("wait", 1), ("wait", 2), ("launch", 2), ("launch", 1), ("launch", 0)]
        # Inside step(closure) the forward still waits lazily, and the update after it launches.
        lazy = [("wait", 2), ("forward", 0), ("forward", 1), ("wait", 1), ("forward", 2), ("forward", 3)]
        launch = [("launch", 2), ("launch", 1), ("launch", 0)]
        assert closure_step == [*lazy, ("wait", 0), ("forward", 4), ("forward", 5), *launch]
        # SGD has no state: the checkpoint's state initialisation steps (at lr 0), and waits for what it launched.
        assert after_state == [("wait", 0), ("wait", 1), ("wait", 2), *launch, ("wait", 0), ("wait", 1), ("wait", 2)]


class _ReadsAWeightItDoesNotCall(nn.Module):
    """A tied embedding and head, and a projection whose weight the model reads itself (a fused loss)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(16, 8)
        self.block = nn.Linear(8, 8)
        self.projection = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.block(self.embedding(tokens)))
        return self.head(nn.functional.linear(h, self.projection.weight, self.projection.bias))


def _reads_worker(steps: int, call_forward: bool = False):
    model = _ReadsAWeightItDoesNotCall()
    # One bucket per parameter: the projection's share a bucket with no module that runs.
    engine = ZeroEngine(list(model.parameters()), _mesh(), stage=1, bucket_bytes=4, parts=[model])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine.attach(optimizer)
    for step in range(steps):
        tokens = torch.randint(0, 16, (8, 4), generator=torch.Generator().manual_seed(step)).chunk(2)[dist.get_rank()]
        logits = model.forward(tokens) if call_forward else model(tokens)
        logits.logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def test_zero_waits_at_the_start_of_the_forward_for_a_weight_read_outside_its_module():
    reference = _ReadsAWeightItDoesNotCall()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(3):
        tokens = torch.randint(0, 16, (8, 4), generator=torch.Generator().manual_seed(step))
        # The mean of the two ranks' means: their halves of the batch are the same size.
        sum(reference(t).logsumexp(-1).mean() / 2 for t in tokens.chunk(2)).backward()
        optimizer.step()
        optimizer.zero_grad()
    for params in run_pooled(_reads_worker, 2, 3):
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(params[name], value, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_zero_refuses_a_weight_read_while_its_gather_is_in_flight():
    # model.forward() skips the model's pre-hooks: nothing waits for the projection before it is read.
    with pytest.raises(WorkerError, match=r"took part in a forward while its all-gather was still in flight.*Linear"):
        run_pooled(_reads_worker, 2, 2, call_forward=True)


def _comm_worker(stage: int):
    model, engine, optimizer = _setup(stage)
    padded_psi = sum(b.flat_params.numel() * b.flat_params.element_size() for b in engine.buckets)
    # Untraced first step: creating Adam's DTensor states runs DTensor's sharding propagation on
    # FakeTensors, which a TorchDispatchMode like CommTracer cannot handle.
    _train_step(model, engine, optimizer, 0)
    x, y = _batch(1)
    x, y = x.chunk(dist.get_world_size())[dist.get_rank()], y.chunk(dist.get_world_size())[dist.get_rank()]
    with CommTracer() as no_sync_tracer, engine.no_sync():
        (nn.functional.mse_loss(model(x[:2]), y[:2]) / 2).backward()
    with CommTracer() as tracer:
        (nn.functional.mse_loss(model(x[2:]), y[2:]) / 2).backward()
        optimizer.step()
    return padded_psi, len(engine.buckets), no_sync_tracer.summary(), tracer.summary(), tracer.total(kind="wire")


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_moves_reduce_scatter_plus_all_gather_of_psi(stage):
    n = 4
    for padded_psi, n_buckets, no_sync, summary, wire in run_pooled(_comm_worker, n, stage):
        assert no_sync == {}, "no communication inside no_sync"
        (ops,) = summary.values()
        assert set(ops) == {"reduce_scatter", "all_gather"}
        assert ops["reduce_scatter"]["payload_bytes"] == padded_psi
        assert ops["all_gather"]["payload_bytes"] == padded_psi
        assert ops["reduce_scatter"]["calls"] == ops["all_gather"]["calls"] == n_buckets
        # 2Ψ(N-1)/N per rank: the same as one all-reduce of the gradients.
        assert wire == 2 * padded_psi * (n - 1) // n


def _checkpoint_worker(path: str, stage: int):
    model, engine, optimizer = _setup(stage)
    for step in range(5):
        _train_step(model, engine, optimizer, step)
    uninterrupted = model.state_dict()

    model, engine, optimizer = _setup(stage)
    for step in range(3):
        _train_step(model, engine, optimizer, step)
    dcp.save({"model": model.state_dict(), "optim": engine.state_dict(_names(model))}, checkpoint_id=path)
    saved_states = _full_states(engine)

    # Another initialisation and another lr: everything must come from the checkpoint.
    model, engine, optimizer = _setup(stage, seed=1)
    optimizer.param_groups[0]["lr"] = 1.0
    state = {"model": model.state_dict(), "optim": engine.state_dict(_names(model))}
    dcp.load(state, checkpoint_id=path)
    engine.load_state_dict(state["optim"], _names(model))
    for step in range(3, 5):
        _train_step(model, engine, optimizer, step)
    return uninterrupted, model.state_dict(), saved_states


def _load_elsewhere_worker(path: str, stage: int):
    model, engine, _ = _setup(stage, seed=1)
    state = {"model": model.state_dict(), "optim": engine.state_dict(_names(model))}
    dcp.load(state, checkpoint_id=path)
    engine.load_state_dict(state["optim"], _names(model))
    return _full_states(engine)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_dcp_checkpoint_resumes_exactly(tmp_path, stage):
    path = str(tmp_path / "ckpt")
    results = run_pooled(_checkpoint_worker, 2, path, stage)
    for uninterrupted, resumed, _ in results:
        for name, value in uninterrupted.items():
            assert torch.equal(resumed[name], value), f"{name} differs after resuming"
    # The checkpoint does not depend on N: 4 ranks load the Adam states 2 ranks saved.
    saved = results[0][2]
    for loaded in run_pooled(_load_elsewhere_worker, 4, path, stage):
        assert loaded.keys() == saved.keys()
        for bucket, tensors in saved.items():
            for name, value in tensors.items():
                assert torch.equal(loaded[bucket][name], value), f"{bucket}.{name} differs when loaded on 4 ranks"


def _names(model: nn.Module) -> dict[nn.Parameter, list[str]]:
    return {p: [name] for name, p in model.named_parameters()}


def _full_states(engine: ZeroEngine) -> dict[str, dict[str, torch.Tensor]]:
    assert engine.optimizer is not None
    return {
        f"bucket{i}": {k: v.full_tensor() for k, v in engine.optimizer.state[b.shard].items() if isinstance(v, DTensor)}
        for i, b in enumerate(engine.buckets)
    }


def test_zero_config_errors_name_the_option():
    with pytest.raises(ConfigError, match=r"ZeRO\(stage=3\)"):
        ZeroEngine([], None, stage=3, bucket_bytes=1, parts=[])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"ZeRO\(bucket_mb="):
        ZeroEngine([], None, stage=2, bucket_bytes=0, parts=[])  # type: ignore[arg-type]
