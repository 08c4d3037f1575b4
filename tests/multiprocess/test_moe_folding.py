"""MoE parallel folding: under tensor parallelism each tp rank runs its share of the tokens through the MoE
layers, and expert parallelism may span the tp ranks (Megatron's folding); Qwen3's attention (per-head q/k norms,
wide heads) as our decoder runs it. Parity with one process in every folded layout, and what each rank runs."""

from dataclasses import replace

import pytest
import torch
from llama_runs import QWEN3_MOE_TINY, SGD, run_tiny_llama

from lightning_ultrascale import (
    ContextParallel,
    ExpertParallel,
    PipelineParallel,
    TensorParallel,
    UltraScaleStrategy,
    ZeRO,
)
from lightning_ultrascale.errors import ConfigError
from lightning_ultrascale.models import build_model, get_model_config
from lightning_ultrascale.models.common.decoder import Llama
from lightning_ultrascale.models.hf.convert import hf_architecture
from lightning_ultrascale.parallel.dims import DataShape
from lightning_ultrascale.testing import run_pooled
from lightning_ultrascale.testing.parity import QUIET_TRAINER, RunRecord, assert_parity


# ------------------------------------------------------------------------------------ Qwen3's attention
def test_qwen3_blocks_equal_transformers_qwen3_with_the_same_weights():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = replace(QWEN3_MOE_TINY, moe=None, name="qwen3_tiny", ffn_hidden_dim=96)
    hf_cfg = Qwen3Config(
        hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.ffn_hidden_dim,
        vocab_size=cfg.vocab_size, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=False,
        max_position_embeddings=cfg.max_seq_len,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(hf_cfg).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.1)  # (norm weights too: a norm left at 1 would pass unapplied)
    ours = Llama(cfg).eval()
    names = {
        "embed_tokens": "tok_embeddings", "input_layernorm": "attention_norm", "self_attn": "attention",
        "q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "post_attention_layernorm": "ffn_norm",
        "mlp": "feed_forward", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "lm_head": "output",
    }  # fmt: skip
    state = {}
    for key, value in hf.state_dict().items():
        parts = key.removeprefix("model.").split(".")
        state[".".join(names.get(part, part) for part in parts)] = value
    assert ours.load_state_dict(state, strict=True) is not None
    ours.init_buffers()
    tokens = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)


def test_qwen3_presets_have_their_published_sizes_and_convert_to_hugging_face_s_qwen3_moe():
    for name, total, active in (("qwen3_30b_a3b", 30.5e9, 3.3e9), ("qwen3_235b_a22b", 235e9, 22e9)):
        cfg = get_model_config(name)
        assert sum(p.numel() for p in build_model(name, device="meta").parameters()) == cfg.num_params()
        assert cfg.num_params() == pytest.approx(total, rel=5e-3)
        assert cfg.num_params(active=True) == pytest.approx(active, rel=2e-2)  # (Qwen count the embedding)
        assert build_model(name, device="meta").spec.head_dim == 128
    assert hf_architecture(get_model_config("qwen3_30b_a3b")) == ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")
    with pytest.raises(ConfigError, match=r"attention_head_dim\) without per-head query/key norms have no Hugging"):
        hf_architecture(replace(QWEN3_MOE_TINY, qk_norm=False))
    odd = replace(QWEN3_MOE_TINY, attention_head_dim=7)
    with pytest.raises(ConfigError, match=r"model.attention_head_dim=7 must be an even positive integer"):
        odd.validate()


# ------------------------------------------------------------------------------------ folding parity
# Qwen3's balancing loss counts over the micro-batch ("switch"): the same window only where neither data ranks nor
# a pipeline's microbatches split it. There, the per-sequence loss (a window every layout sees whole).
PER_SEQUENCE = replace(QWEN3_MOE_TINY, moe=replace(QWEN3_MOE_TINY.moe, aux_loss="sequence"))
# Half the mean rows per expert and sequence kept, in position order: which tokens drop depends on where each of a
# rank's pieces sits in its sequence (cp's zig-zag chunks, each cut again by tp).
CAPPED = replace(QWEN3_MOE_TINY, name="qwen3_moe_tiny_capped", moe=replace(QWEN3_MOE_TINY.moe, capacity_factor=0.5))


@pytest.fixture(scope="module")
def references() -> dict[str, RunRecord]:
    return {
        cfg.name + cfg.moe.aux_loss: run_tiny_llama(SGD, model=cfg, steps=3)
        for cfg in (QWEN3_MOE_TINY, PER_SEQUENCE, CAPPED)
    }


FOLDED = {
    # tp2 with SP: the MoE layers run the residual's own sequence shard (no collective of their own).
    "tp2": (lambda: [TensorParallel(2)], 2, 1, QWEN3_MOE_TINY),
    # tp2 without SP: a slice in, an all-gather out.
    "tp2-no-sp": (lambda: [TensorParallel(2, sequence_parallel=False)], 2, 1, QWEN3_MOE_TINY),
    # ep2 over the two tp ranks of one data rank (ep > dp x cp: what folding makes expressible).
    "tp2xep2": (lambda: [TensorParallel(2), ExpertParallel(2)], 2, 1, QWEN3_MOE_TINY),
    # ep4 over dp2 x tp2, experts and the router sharded by ZeRO-3 over their own ranks.
    "dp2xtp2xep4-zero3": (lambda: [TensorParallel(2), ExpertParallel(4), ZeRO(stage=3)], 4, 2, PER_SEQUENCE),
    # cp2 (zig-zag) x tp2: each rank holds two eighths of a sequence, the balancing window spans all four ranks,
    # and the capacity counts each rank's pieces after every piece before them (ep over the tp ranks: tp2xep2).
    "cp2xtp2-capacity": (lambda: [ContextParallel(2), TensorParallel(2)], 4, 1, CAPPED),
    # pp2 x tp2 x ep2 (1F1B): the folded statistics of the stage holding them, summed over the stages.
    "pp2xtp2xep2": (lambda: [PipelineParallel(2, "1f1b", 2), TensorParallel(2), ExpertParallel(2)], 4, 1, PER_SEQUENCE),
}


@pytest.mark.parametrize("layout", list(FOLDED))
def test_folded_moe_layouts_match_one_process(layout, references):
    plugins, world, dp, model = FOLDED[layout]
    run = run_tiny_llama(SGD, plugins, world_size=world, dp=dp, model=model, steps=3)
    assert_parity(run, references[model.name + model.moe.aux_loss], rtol=1e-5)


def _tokens_each_moe_runs(tp: int, sequence_parallel: bool) -> list[int]:
    """The tokens each MoE layer's forward received on this rank, and its share."""
    import lightning as L
    from llama_runs import GLOBAL_BATCH, SEQ_LEN

    from lightning_ultrascale import LlamaModule, UltraScaleDataModule

    seen: list[int] = []
    module = LlamaModule(QWEN3_MOE_TINY, optim=SGD)

    class Count(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            for moe in pl_module.model.moe_layers().values():
                moe.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0] * args[0].shape[1]))

    trainer = L.Trainer(
        accelerator="cpu", devices=tp, strategy=UltraScaleStrategy(TensorParallel(tp, sequence_parallel)),
        max_steps=1, callbacks=[Count()], **QUIET_TRAINER,
    )  # fmt: skip
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH, seed=0))
    return seen


def test_each_tp_rank_routes_its_share_of_the_tokens():
    # Without SP (the residual replicated: the MoE layers take a slice); with SP it is the residual's own shard.
    from llama_runs import GLOBAL_BATCH, SEQ_LEN

    for seen in run_pooled(_tokens_each_moe_runs, 2, 2, False):
        assert seen and set(seen) == {GLOBAL_BATCH * SEQ_LEN // 2}


def test_a_sequence_folding_cannot_split_is_refused_before_any_process_group():
    spec = build_model(QWEN3_MOE_TINY, device="meta").spec
    plugin = TensorParallel(2, sequence_parallel=False)
    with pytest.raises(ConfigError, match=r"seq_len=63\) must be divisible by .*size=2\): each tp rank runs its"):
        plugin.validate_sequence(DataShape(seq_len=63, micro_batch_size=1), folds=True)
    plugin.validate_sequence(DataShape(seq_len=63, micro_batch_size=1), folds=False)  # (a dense model: fine)
    assert spec.moe_folds_tp and not torch.distributed.is_initialized()


def _global_loads_on_every_rank(config) -> list[float]:
    """Each rank's agreed tokens-per-expert total after one step of pp2 x tp2 (1F1B)."""
    import lightning as L
    from llama_runs import GLOBAL_BATCH, SEQ_LEN

    from lightning_ultrascale import LlamaModule, UltraScaleDataModule

    module = LlamaModule(config, optim=SGD)
    strategy = UltraScaleStrategy(PipelineParallel(2, "1f1b", 2), TensorParallel(2))
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=1, **QUIET_TRAINER)
    trainer.fit(module, datamodule=UltraScaleDataModule(seq_len=SEQ_LEN, micro_batch_size=GLOBAL_BATCH, seed=0))
    assert module.expert_stats is not None
    return [float(module.expert_stats.loads.sum())]


def test_every_rank_agrees_on_the_folded_loads_also_a_stage_without_moe_blocks():
    # Blocks 0-2 dense (the first stage holds no MoE layer), 3 MoE: the first stage's ranks must still sum the
    # folded statistics over their tp peers too, or they log (rank 0 does) a tp share of the loads.
    from llama_runs import GLOBAL_BATCH, SEQ_LEN

    config = replace(PER_SEQUENCE, moe=replace(PER_SEQUENCE.moe, first_k_dense=3))
    routed = GLOBAL_BATCH * SEQ_LEN * config.moe.top_k * len(config.moe_blocks())
    assert [loads for [loads] in run_pooled(_global_loads_on_every_rank, 4, config)] == [routed] * 4
