"""Small model configs and full canonical tensors shared by the layout tests."""

from __future__ import annotations

import torch

from weightbus.layouts.families import ModelSpec

NAN = float("nan")


def small_config(model_type: str, kv_heads: int = 2, **extra) -> dict:
    """A small dense config of ``model_type``; ``extra`` overrides or adds keys."""
    config = {
        "model_type": model_type,
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": kv_heads,
    }
    return {**config, **extra}


QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 8,
    "mlp_only_layers": [1],
}


def deepseek_config(num_layers: int = 3) -> dict:
    """A small DeepSeek-V3 config with MLA, shared experts and one dense layer."""
    return {
        "model_type": "deepseek_v3",
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 8,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 16,
        "kv_lora_rank": 8,
        "qk_nope_head_dim": 4,
        "qk_rope_head_dim": 2,
        "v_head_dim": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
    }


def canonical_tensors(model: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in model.tensors}
