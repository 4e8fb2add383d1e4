"""Every participant's layout of one side, from a short description (for the CLI and benches).

A description is ``kind`` or ``kind:key=value,key=value``:

``whole[:replicas=R]``
    R participants, each holding every tensor whole under its checkpoint name (a plain
    ``nn.Module`` or a Hugging Face model on one device).
``fsdp:shard=S[,ep=E]``
    FSDP2 over S ranks, optionally times E expert-parallel groups (see
    :mod:`weightbus.layouts.fsdp`); E x S participants, rank ``e * S + s``.
``megatron:tp=T[,pp=P][,ep=E][,dp=D][,fuse_qkv=on]``
    Megatron-style tensor/pipeline/expert parallel, D data-parallel replicas; D x P x E x T
    participants, rank ``((d * P + p) * E + e) * T + t``.
``vllm:tp=T[,dp=D][,ep=on]``
    vLLM-style engines with fused parameters: D replicas of tensor parallel T; with ``ep=on``,
    experts are spread over all D x T ranks (vLLM's expert parallel), else each expert is split
    over all D x T ranks (vLLM's MoE tensor parallel spans the data-parallel ranks).
"""

from __future__ import annotations

from weightbus.layouts.families import ModelSpec
from weightbus.layouts.fsdp import fsdp_layout
from weightbus.layouts.fused import engine_layout
from weightbus.layouts.megatron import megatron_layout
from weightbus.spec import Layout, Participant

__all__ = ["KINDS", "build_layouts", "parse"]

KINDS: dict[str, dict[str, int | str | None]] = {
    "whole": {"replicas": 1},
    "fsdp": {"shard": None, "ep": 1},
    "megatron": {"tp": 1, "pp": 1, "ep": 1, "dp": 1, "fuse_qkv": "off"},
    "vllm": {"tp": 1, "dp": 1, "ep": "off"},
}
"""Layout kinds of a description (``kind:key=value,...``) and each key's default."""


def parse(description: str) -> tuple[str, dict]:
    """``"fsdp:shard=8,ep=32"`` -> ``("fsdp", {"shard": 8, "ep": 32})``, defaults filled in."""
    kind, _, rest = description.strip().partition(":")
    if kind not in KINDS:
        raise ValueError(f"layout {description!r}: kind {kind!r} is not one of {', '.join(KINDS)}")
    opts = dict(KINDS[kind])
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in opts:
            raise ValueError(
                f"layout {description!r}: {item!r} is not key=value with a key of {sorted(opts)}"
            )
        if isinstance(KINDS[kind][key], str):  # an on/off switch
            if value not in ("on", "off"):
                raise ValueError(f"layout {description!r}: {key} must be on or off, got {value!r}")
            opts[key] = value
        else:
            try:
                number = int(value)
            except ValueError:
                raise ValueError(
                    f"layout {description!r}: {key}={value!r} is not an integer"
                ) from None
            if number < 1:
                raise ValueError(f"layout {description!r}: {key}={number} must be at least 1")
            opts[key] = number
    missing = [k for k, v in opts.items() if v is None]
    if missing:
        raise ValueError(f"layout {description!r}: give {', '.join(f'{k}=N' for k in missing)}")
    return kind, opts


def build_layouts(
    model: ModelSpec, description: str, role: str, *, dtype: str | None = None
) -> list[Layout]:
    """All participants' layouts of one side (``role`` "writer" or "reader"), sorted by rank."""
    kind, o = parse(description)

    def who(rank: int) -> Participant:
        return Participant(role=role, rank=rank)

    if kind == "whole":
        return [
            megatron_layout(model, who(r), vocab_multiple=1, dtype=dtype)
            for r in range(o["replicas"])
        ]
    if kind == "fsdp":
        s, e = o["shard"], o["ep"]
        return [
            fsdp_layout(
                model, who(ep * s + sh), shard=s, shard_rank=sh, ep=e, ep_rank=ep, dtype=dtype
            )
            for ep in range(e)
            for sh in range(s)
        ]
    if kind == "megatron":
        t, p, e, d = o["tp"], o["pp"], o["ep"], o["dp"]
        out = []
        for dp in range(d):
            for pp in range(p):
                for ep in range(e):
                    for tp in range(t):
                        rank = ((dp * p + pp) * e + ep) * t + tp
                        out.append(
                            megatron_layout(
                                model,
                                who(rank),
                                tp=t,
                                tp_rank=tp,
                                pp=p,
                                pp_rank=pp,
                                ep=e,
                                ep_rank=ep,
                                fuse_qkv=o["fuse_qkv"] == "on",
                                dtype=dtype,
                            )
                        )
        return out
    t, d = o["tp"], o["dp"]
    ep = o["ep"] == "on"
    return [
        engine_layout(
            model,
            who(dp * t + tp),
            tp=t,
            tp_rank=tp,
            ep=d * t if ep else 1,
            ep_rank=dp * t + tp if ep else 0,
            # without expert parallel, vLLM splits each expert over all tp x dp ranks
            moe_tp=None if ep else d * t,
            moe_tp_rank=None if ep else dp * t + tp,
            dtype=dtype,
        )
        for dp in range(d)
        for tp in range(t)
    ]
