"""The Llama family's presets: Llama 3.1 / 3.2 as published, and the tiny CPU models tests and the
default job run (``MODEL_CONFIGS`` in :mod:`lightning_ultrascale.models` gathers every family's)."""

from lightning_ultrascale.models.common.decoder import LlamaConfig, RopeScaling

__all__ = ["CONFIGS"]

# Published Llama 3.1 / 3.2 architectures (the HF config.json of meta-llama/Llama-3.1-8B etc.);
# tests check the parameter counts against Meta's model cards.
_LLAMA31_ROPE = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA32_ROPE = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_VOCAB = 128256
_CONTEXT = 131072

CONFIGS: dict[str, LlamaConfig] = {
    # CPU tests and the default job. The rope scaling is on and its bands are placed so that the
    # head's 8 frequencies fall in all three (kept, interpolated, stretched): tests exercise it.
    "llama_tiny": LlamaConfig(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=320, ffn_hidden_dim=192,
        rope_scaling=RopeScaling(
            factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
        ),
        max_seq_len=256, name="llama_tiny",
    ),
    # llama_tiny widened until every block linear is a multiple of 128 wide, also split over tp=2
    # (FP8 blockwise tiles; so no GQA here: 2 kv heads of 64 would leave wk/wv 64 wide per rank).
    "llama_small": LlamaConfig(
        dim=256, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=320, ffn_hidden_dim=768,
        rope_scaling=RopeScaling(
            factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
        ),
        max_seq_len=256, name="llama_small",
    ),
    "llama3_1b": LlamaConfig(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=_VOCAB, ffn_hidden_dim=8192,
        rope_scaling=_LLAMA32_ROPE, max_seq_len=_CONTEXT, tie_embeddings=True, name="llama3_1b",
    ),
    "llama3_3b": LlamaConfig(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=_VOCAB, ffn_hidden_dim=8192,
        rope_scaling=_LLAMA32_ROPE, max_seq_len=_CONTEXT, tie_embeddings=True, name="llama3_3b",
    ),
    "llama3_8b": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=_VOCAB, ffn_hidden_dim=14336,
        rope_scaling=_LLAMA31_ROPE, max_seq_len=_CONTEXT, name="llama3_8b",
    ),
    "llama3_70b": LlamaConfig(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=_VOCAB, ffn_hidden_dim=28672,
        rope_scaling=_LLAMA31_ROPE, max_seq_len=_CONTEXT, name="llama3_70b",
    ),
    "llama3_405b": LlamaConfig(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=_VOCAB, ffn_hidden_dim=53248,
        rope_scaling=_LLAMA31_ROPE, max_seq_len=_CONTEXT, name="llama3_405b",
    ),
}  # fmt: skip
