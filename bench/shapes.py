"""Qwen2 shapes the benchmarks build with random weights (published models' sizes; nothing is downloaded)."""

from __future__ import annotations

from typing import Any


def _qwen2(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    tied: bool = True,
    positions: int = 32768,
) -> dict[str, Any]:
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        # the published models' context: vLLM refuses a max_model_len past it
        max_position_embeddings=positions,
    )


SHAPES: dict[str, dict[str, Any]] = {
    "tiny": _qwen2(128, 2, 4, 2, 256, 300, positions=512),
    "qwen2-0.1b": _qwen2(512, 12, 8, 2, 2816, 151936),
    "qwen2.5-0.5b": _qwen2(896, 24, 14, 2, 4864, 151936),
    "qwen2.5-1.5b": _qwen2(1536, 28, 12, 2, 8960, 151936),
    "qwen2.5-7b": _qwen2(3584, 28, 28, 4, 18944, 152064, tied=False),
}
