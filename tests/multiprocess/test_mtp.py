"""Multi-token prediction (DeepSeek-V3's, ``mtp_depth``): trained under DP, ZeRO, TP/SP, EP, CP and PP as one process
trains it; through Hugging Face with every tensor accounted for; priced."""

import json
from dataclasses import replace

import pytest
import torch
from llama_runs import DEEPSEEK_V3_TINY, SGD, run_tiny_llama

from lightning_ultrascale import (
    ContextParallel,
    ExpertParallel,
    LlamaModule,
    PipelineParallel,
    TensorParallel,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import get_model_config
from lightning_ultrascale.models.common.decoder import TransformerBlock
from lightning_ultrascale.models.llama import Llama
from lightning_ultrascale.testing.parity import assert_parity

DEEPSEEK_MTP = replace(DEEPSEEK_V3_TINY, name="deepseek_v3_tiny_mtp", mtp_depth=1)
LLAMA_MTP2 = replace(get_model_config("llama_tiny"), name="llama_tiny_mtp2", mtp_depth=2, mtp_loss_weight=0.3)

#: name -> (plugins, world size, data-parallel size, model)
LAYOUTS = {
    "ep2": (lambda: [ExpertParallel(2)], 2, 2, DEEPSEEK_MTP),
    "ep2_zero3": (lambda: [ExpertParallel(2), ZeRO(3)], 2, 2, DEEPSEEK_MTP),
    "tp2_sp": (lambda: [TensorParallel(2, sequence_parallel=True, loss_parallel=True)], 2, 1, DEEPSEEK_MTP),
    "zero1_depth2": (lambda: [ZeRO(1)], 2, 2, LLAMA_MTP2),
    "tp2_depth2": (lambda: [TensorParallel(2, sequence_parallel=True, loss_parallel=True)], 2, 1, LLAMA_MTP2),
    # Context parallelism: the tokens and labels ahead are taken on whole sequences, then cut (zig-zag).
    "cp2": (lambda: [ContextParallel(2)], 2, 1, DEEPSEEK_MTP),
    "cp2_depth2": (lambda: [ContextParallel(2)], 2, 1, LLAMA_MTP2),
    # A pipeline: the MTP block runs on the last stage, which keeps a copy of the embedding (1F1B: on the other
    # rank, gradients summed; ZBV: the first and last stage share a rank and one Parameter).
    "pp2_1f1b": (lambda: [PipelineParallel(2, "1f1b", microbatches=2)], 2, 1, DEEPSEEK_MTP),
    "pp2_zbv": (lambda: [PipelineParallel(2, "zbv", microbatches=2)], 2, 1, DEEPSEEK_MTP),
    # Depth 2 under a split backward: the last stage computes its weight gradients with its input gradients.
    "pp2_zbv_depth2": (lambda: [PipelineParallel(2, "zbv", microbatches=2)], 2, 1, LLAMA_MTP2),
    # Vocab-sharded logits on the last stage: the MTP term joins a replicated loss.
    "pp2_tp2": (
        lambda: [PipelineParallel(2, "1f1b", microbatches=2), TensorParallel(2, sequence_parallel=True)],
        4,
        1,
        DEEPSEEK_MTP,
    ),
}


@pytest.fixture(scope="module")
def references():
    return {cfg.name: run_tiny_llama(SGD, model=cfg, steps=3) for cfg in (DEEPSEEK_MTP, LLAMA_MTP2)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mtp_trains_as_one_process_does(layout, references):
    plugins, world_size, dp, model = LAYOUTS[layout]
    run = run_tiny_llama(SGD, plugins, world_size=world_size, dp=dp, model=model, steps=3)
    assert_parity(run, references[model.name], rtol=1e-5)


def test_the_mtp_blocks_learn_and_their_loss_is_weighted(references):
    one = references[DEEPSEEK_MTP.name]
    prefix = f"model.layers.{DEEPSEEK_MTP.n_layers}."  # the blocks, then the MTP block
    mtp = [n for n in one.grads[0] if n.startswith(prefix)]
    assert {f"{prefix}{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "post_norm")} <= set(mtp)
    assert all(one.grads[0][n].abs().sum() > 0 for n in mtp)
    # Weight 0 (a dense model: an MTP block's MoE balancing loss would still reach the main blocks, as every MoE
    # block's does): the main parameters' gradients are those of the model without MTP; the MTP blocks get none.
    plain = run_tiny_llama(SGD, model="llama_tiny", steps=1)
    off = run_tiny_llama(SGD, model=replace(LLAMA_MTP2, mtp_loss_weight=0.0), steps=1)
    for name, grad in plain.grads[0].items():
        torch.testing.assert_close(off.grads[0][name], grad, rtol=1e-6, atol=1e-9)
    extra = set(off.grads[0]) - set(plain.grads[0])
    assert extra and all(off.grads[0][n].abs().sum() == 0 for n in extra)


def test_the_mtp_loss_is_deepseeks_written_out():
    # Depth 1 by hand: the block reads [enorm(embed(t[i+1])); hnorm(main output after its norm)] through eh_proj,
    # its post-normed output predicts t[i+2] through the shared head (the last two positions predict nothing).
    cfg = replace(get_model_config("llama_tiny"), mtp_depth=1, mtp_loss_weight=0.3)
    model = Llama(cfg)
    model.init_weights(seed=0)
    tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.cat((tokens[:, 1:], torch.full((2, 1), -100)), dim=1)
    main = model(tokens, labels=labels)
    got = model.pop_mtp_sums()
    with torch.no_grad():
        h = model.norm(model.forward_stage(tokens, None, ["0", "1", "2", "3"], embed=True, head=False))
        block = model.layers["4"]
        cos, sin = model._rope_angles(torch.arange(16)[None])
        ahead = torch.cat((tokens[:, 1:], torch.zeros(2, 1, dtype=torch.long)), dim=1)
        x = block.eh_proj(torch.cat((block.enorm(model.tok_embeddings(ahead)), block.hnorm(h)), dim=-1))
        out = block.post_norm(TransformerBlock.forward(block, x, cos, sin))
        target = torch.cat((tokens[:, 2:], torch.full((2, 2), -100)), dim=1)
        logits = model.output(out).flatten(0, 1)
        want = torch.nn.functional.cross_entropy(logits, target.flatten(), ignore_index=-100, reduction="sum")
    assert got is not None and got[1] == 2 * 14
    torch.testing.assert_close(got[0].detach(), want, rtol=1e-5, atol=0)
    # The training loss: the main mean plus weight / depth x the MTP sum over the main loss's tokens.
    module = LlamaModule(cfg)
    module.model = model
    loss = module._loss({"input_ids": tokens, "labels": labels})
    torch.testing.assert_close(loss.detach(), (main + 0.3 * want / 30).detach(), rtol=1e-5, atol=0)


def test_mtp_under_a_v_shaped_pipeline_with_zero3_is_refused_by_name():
    # The rank holding the first and the last stage runs the embedding in both, and FSDP2 shards it for one.
    strategy = UltraScaleStrategy(PipelineParallel(2, "zbv", microbatches=2), ZeRO(3))
    message = r"PipelineParallel\(schedule='zbv'\) with model\.mtp_depth=1 and ZeRO\(stage=3"
    with pytest.raises(ConfigError, match=message):
        strategy.validate(LlamaModule(DEEPSEEK_MTP).model_spec, None, world_size=4)
    UltraScaleStrategy(PipelineParallel(2, "1f1b"), ZeRO(3)).validate(LlamaModule(DEEPSEEK_MTP).model_spec, None, 4)


def _hf_directory_with_mtp(directory) -> dict[str, torch.Tensor]:
    """DeepSeek-V3-tiny with an MTP layer as an HF directory laid out as DeepSeek releases it: one tensor per
    expert, and copies of the embedding and head in the MTP layer."""
    from safetensors.torch import save_file

    from lightning_ultrascale.models.hf.convert import hf_config_json, hf_file_tensors

    model = Llama(DEEPSEEK_MTP)
    model.init_weights(seed=3)
    sd = model.state_dict()
    files = hf_file_tensors(DEEPSEEK_MTP)
    hf = {name: (sd[key] if expert is None else sd[key][expert]).clone() for name, (key, expert) in files.items()}
    directory.mkdir()
    save_file(hf, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(hf_config_json(DEEPSEEK_MTP, "float32")))
    return hf


def test_an_hf_deepseek_v3_directory_with_mtp_round_trips_every_tensor(tmp_path):
    from lightning_ultrascale.models.hf.convert import (
        hf_directory_config,
        hf_file_tensors,
        load_hf_weights,
        state_dict_from_hf,
        state_dict_to_hf,
    )

    hf = _hf_directory_with_mtp(tmp_path / "hf")
    n = DEEPSEEK_MTP.n_layers
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "embed_tokens", "shared_head.head"):
        assert f"model.layers.{n}.{name}.weight" in hf
    assert any(k.startswith(f"model.layers.{n}.self_attn.") for k in hf)
    assert any(k.startswith(f"model.layers.{n}.mlp.experts.") for k in hf)
    # Import: the directory's config has the MTP layer, and every file tensor lands in the model.
    cfg = hf_directory_config(tmp_path / "hf")
    assert cfg.mtp_depth == 1 and not cfg.architecture_differences(DEEPSEEK_MTP)
    imported = Llama(cfg)
    load_hf_weights(imported, tmp_path / "hf")
    # Export again: every file tensor, under its name, equal (the copies are the shared embedding and head).
    sd = imported.state_dict()
    files = hf_file_tensors(cfg)
    assert set(files) == set(hf)
    for name, (key, expert) in files.items():
        assert torch.equal(sd[key] if expert is None else sd[key][expert], hf[name]), name
    # In memory too (transformers' fused experts): to HF and back is the identity.
    back = state_dict_from_hf(state_dict_to_hf(sd, cfg), cfg)
    assert set(back) == set(sd) and all(torch.equal(back[k], v) for k, v in sd.items())
    # transformers reads the config's MTP layer count.
    transformers = pytest.importorskip("transformers")
    assert transformers.AutoConfig.from_pretrained(tmp_path / "hf").num_mtp_layers == 1


def test_an_mtp_copy_that_differs_from_the_shared_embedding_is_refused(tmp_path):
    from lightning_ultrascale.models.hf.convert import load_hf_weights, state_dict_from_hf, state_dict_to_hf

    model = Llama(DEEPSEEK_MTP)
    model.init_weights(seed=3)
    hf = state_dict_to_hf(model.state_dict(), DEEPSEEK_MTP)
    name = f"model.layers.{DEEPSEEK_MTP.n_layers}.embed_tokens.weight"
    hf[name] = hf[name] + 1
    with pytest.raises(ConfigError, match=rf"{name} differs from the model's model.embed_tokens.weight"):
        state_dict_from_hf(hf, DEEPSEEK_MTP)
    # From a directory's files as well.
    from safetensors.torch import save_file

    files = _hf_directory_with_mtp(tmp_path / "hf")
    files[name] = files[name] + 1
    save_file(files, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ConfigError, match=rf"{name} differs from the model's model.embed_tokens.weight"):
        load_hf_weights(Llama(DEEPSEEK_MTP), tmp_path / "hf")


def test_the_planner_prices_the_mtp_blocks_and_their_second_head():
    from lightning_ultrascale.plan import Candidate, Workload, estimate, get_hardware

    layout, costs, flops = Candidate.layout(dp=8, zero=3, micro_batch_size=1), {}, {}
    for depth in (0, 1):
        cfg = replace(get_model_config("llama3_8b"), mtp_depth=depth)
        with torch.device("meta"):
            model = Llama(cfg)
        [costs[depth]] = estimate(Workload(cfg, 8192, 64, fused_kernels=True), layout, model, get_hardware("h100"))
        flops[depth] = cfg.flops_per_token(8192)
    # One more block, the [2h -> h] projection and the head again: at least their FLOPs' share of the step
    # (measured 1.124x step time for 1.087x FLOPs: the second head's log-softmax is memory-bound), and the
    # block's weights, gradients and Adam moments in memory.
    slower = costs[0].tokens_per_s / costs[1].tokens_per_s
    assert flops[1] / flops[0] <= slower <= 1.2 * flops[1] / flops[0], (slower, flops)
    assert costs[1].peak - costs[0].peak >= 16 * 251_678_720 / 8  # the MTP block's params x 16 bytes / 8 ranks
    # Its activations: a block's, its norms and eh_proj's input, and a second head's fp32 log-softmax (8192 tokens
    # x 128256 ids) kept for backward: more than a block and those logits, less than a block and twice them.
    extra = costs[1].memory["activations"] - costs[0].memory["activations"]
    block, logits = costs[0].memory["activations"] / 32, 8192 * 4 * 128256
    assert block + logits < extra < block + 2 * logits, (extra, block)


def test_the_mtp_block_computes_what_transformers_mtp_layer_does():
    # transformers' own MtpLayer (what its DeepSeek-V3 speculative decoding runs) on the same weights, embeddings
    # and main-model output: an implementation we did not write.
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_layers import MtpLayer

    from lightning_ultrascale.models.hf.convert import config_to_hf, hf_architecture, state_dict_to_hf

    ours = Llama(DEEPSEEK_MTP)
    ours.init_weights(seed=5)
    config = getattr(transformers, hf_architecture(DEEPSEEK_MTP)[0])(**config_to_hf(DEEPSEEK_MTP))
    config._attn_implementation = "eager"
    main = getattr(transformers, hf_architecture(DEEPSEEK_MTP)[1])(config).eval()
    n = DEEPSEEK_MTP.n_layers
    layer = MtpLayer(config, type(main.model.layers[-1]), type(main.model.norm), n).eval()
    prefix, own = f"model.layers.{n}.", ("enorm.", "hnorm.", "eh_proj.")
    weights = {}
    for name, tensor in state_dict_to_hf(ours.state_dict(), DEEPSEEK_MTP).items():
        if not name.startswith(prefix) or name.endswith(("embed_tokens.weight", "shared_head.head.weight")):
            continue
        rest = name[len(prefix) :]
        rest = "post_norm.weight" if rest == "shared_head.norm.weight" else rest
        weights[rest if rest.startswith((*own, "post_norm.")) else f"mtp_block.{rest}"] = tensor
    assert set(weights) == set(layer.state_dict())
    layer.load_state_dict(weights)
    tokens = torch.randint(0, DEEPSEEK_MTP.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(24)[None].expand(2, -1)
    with torch.no_grad():
        h = ours.norm(ours.forward_stage(tokens, None, [str(i) for i in range(n)], embed=True, head=False))
        embedded = ours.tok_embeddings(torch.roll(tokens, -1, 1))
        cos, sin = ours._rope_angles(positions)
        causal = torch.full((24, 24), float("-inf")).triu(1)[None, None].expand(2, 1, 24, 24)  # (eager's mask)
        want = layer(embedded, h, main.model.rotary_emb(embedded, positions), causal, positions, None)
        got = ours.layers[str(n)](h, embedded, cos, sin)
    assert (got - want).norm() / want.norm() < 1e-5
