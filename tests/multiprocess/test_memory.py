"""Model-state accounting counts what a rank holds, once, and the ZeRO formulas match the playbook."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_ultrascale.testing import run_workers
from lightning_ultrascale.utils.memory import ModelStateBytes, model_state_bytes, playbook_model_state_bytes

FP32 = 4


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_tied_weights_are_counted_once() -> None:
    model = TiedLM()
    model(torch.arange(4)).sum().backward()
    states = model_state_bytes(model)
    assert states.params == 32 * 8 * FP32
    assert states.grads == 32 * 8 * FP32


def test_grads_that_are_views_into_one_flat_buffer_are_counted_once() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    flat = torch.zeros(n + 3)  # padded, as a bucket aligned for a reduce-scatter would be
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    assert model_state_bytes(model).grads == flat.numel() * FP32
    assert model_state_bytes(model, extra_grad_buffers=[flat]).grads == flat.numel() * FP32


def test_bucket_without_grad_views_is_counted_through_extra_grad_buffers() -> None:
    model = nn.Linear(4, 4)
    bucket = torch.zeros(10)  # a ZeRO-2 rank's reduced shard, with .grad already released
    assert model_state_bytes(model, extra_grad_buffers=[bucket]).grads == 10 * FP32


def test_adam_states_are_twice_the_params_plus_step() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 16)).sum().backward()
    optimizer.step()
    states = model_state_bytes(model, optimizer)
    n_tensors = len(list(model.parameters()))
    step_bytes = optimizer.state[model[0].weight]["step"].element_size()
    assert states.optimizer_states == 2 * states.params + n_tensors * step_bytes
    assert states.total == states.params + states.grads + states.optimizer_states
    assert "optimizer" in states.summary()


def _dtensor_shard_bytes() -> ModelStateBytes:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = nn.Module()
    model.weight = nn.Parameter(distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)]))
    optimizer = torch.optim.Adam(model.parameters())
    # Through to_local the gradient keeps the parameter's Shard(0); a DTensor sum would hand back
    # a Replicate gradient, which really does hold the full tensor on every rank.
    (model.weight.to_local() * 2).sum().backward()
    optimizer.step()
    return model_state_bytes(model, optimizer)


def test_dtensor_params_grads_and_states_count_the_local_shard() -> None:
    half = 8 * 4 * FP32 // 2
    for states in run_workers(_dtensor_shard_bytes, 2):
        assert states.params == half
        assert states.grads == half
        assert states.optimizer_states == 2 * half + FP32  # exp_avg, exp_avg_sq, step


def test_playbook_zero_formulas() -> None:
    psi, n = 10**9, 8  # mixed precision, Adam: 2Ψ params + 2Ψ grads + 12Ψ optimizer
    assert playbook_model_state_bytes(psi, stage=0, dp=n) == ModelStateBytes(2 * psi, 2 * psi, 12 * psi)
    assert playbook_model_state_bytes(psi, stage=1, dp=n) == ModelStateBytes(2 * psi, 2 * psi, 12 * psi // n)
    assert playbook_model_state_bytes(psi, stage=2, dp=n) == ModelStateBytes(2 * psi, 2 * psi // n, 12 * psi // n)
    assert playbook_model_state_bytes(psi, stage=3, dp=n).total == 16 * psi // n
    assert playbook_model_state_bytes(psi, stage=0, dp=n, mixed_precision=False) == ModelStateBytes(
        4 * psi, 4 * psi, 8 * psi
    )
    # The playbook's Llama-3.1-8B example: ~128 GB of model state without ZeRO, 16 B per parameter.
    assert playbook_model_state_bytes(8 * 10**9, stage=0, dp=1).total == 128 * 10**9
