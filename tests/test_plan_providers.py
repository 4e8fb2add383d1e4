"""Planner + reference executor on real layout providers, random models and parallelisms.

Writers: FSDP2-style (x expert parallel) or Megatron-style tensor/pipeline/expert parallel with
data-parallel replicas (optionally Megatron's interleaved fused qkv). Readers: vLLM-style engines
(fused qkv with and without KV-head replication, gate_up, stacked experts w13/w2, padded vocab),
or whole models. Reader tensors start poisoned; after the plan runs every reader tensor must
equal its expected slices bit for bit, with every element written exactly once.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.oracle import check_plan
from weightbus.layouts.describe import build_layouts
from weightbus.layouts.families import model_spec
from weightbus.plan import PlanOptions, make_plan


def _config(family: str, kv_heads: int, experts: int, tie: bool) -> dict:
    base = {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": kv_heads,
        "vocab_size": 100,
        "tie_word_embeddings": tie,
        "torch_dtype": "float32",
    }
    if family == "llama":
        return {"model_type": "llama", **base}
    if family == "qwen3_moe":
        return {
            "model_type": "qwen3_moe",
            **base,
            "head_dim": 4,
            "num_experts": experts,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0],
        }
    return {
        "model_type": "mixtral",
        **base,
        "num_local_experts": experts,
        "num_experts_per_tok": 2,
    }


def _divisors(n: int, at_most: int) -> list[int]:
    return [d for d in range(1, at_most + 1) if n % d == 0]


@st.composite
def setups(draw):
    family = draw(st.sampled_from(["llama", "qwen3_moe", "mixtral"]))
    kv = draw(st.sampled_from([1, 2, 4]))
    experts = draw(st.sampled_from([4, 8]))
    tie = draw(st.booleans())
    model = model_spec(_config(family, kv, experts, tie))
    moe = family != "llama"
    ep_choices = _divisors(experts, 4) if moe else [1]
    kind = draw(st.sampled_from(["fsdp", "megatron", "whole"]))
    if kind == "fsdp":
        writers = f"fsdp:shard={draw(st.integers(1, 3))},ep={draw(st.sampled_from(ep_choices))}"
    elif kind == "megatron":
        tp = draw(st.sampled_from(_divisors(kv, 4)))  # Megatron splits KV heads, never replicates
        pp = draw(st.sampled_from([1, 2, 3]))
        ep = draw(st.sampled_from(ep_choices))
        dp = draw(st.sampled_from([1, 2]))
        fuse = draw(st.sampled_from(["on", "off"]))
        writers = f"megatron:tp={tp},pp={pp},ep={ep},dp={dp},fuse_qkv={fuse}"
    else:
        writers = f"whole:replicas={draw(st.integers(1, 3))}"
    rkind = draw(st.sampled_from(["vllm", "vllm", "whole"]))
    if rkind == "vllm":
        tp = draw(st.sampled_from([1, 2, 4, 8]))  # tp 8 > kv heads: KV replication
        dp = draw(st.sampled_from([1, 2]))
        ep = draw(st.sampled_from(["on", "off"])) if moe and experts % (tp * dp) == 0 else "off"
        readers = f"vllm:tp={tp},dp={dp},ep={ep}"
    else:
        readers = "whole"
    rdtype = draw(st.sampled_from(["float32", "bfloat16"]))
    bucket = draw(st.sampled_from([4096, 1 << 20]))
    return model, writers, readers, rdtype, bucket


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setups())
def test_provider_layouts_execute_bit_exact(setup):
    model, wdesc, rdesc, rdtype, bucket = setup
    writers = build_layouts(model, wdesc, "writer", dtype="float32")
    readers = build_layouts(model, rdesc, "reader", dtype=rdtype)
    plan = make_plan(writers, readers, PlanOptions(bucket_bytes=bucket, cast={"float32": rdtype}))

    gen = torch.Generator().manual_seed(7)
    canon = {t.name: torch.randn(t.shape, generator=gen) for t in model.tensors}
    check_plan(plan, writers, readers, canon, getattr(torch, rdtype), (wdesc, rdesc))
