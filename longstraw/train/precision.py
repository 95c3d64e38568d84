"""What the optimizer keeps per parameter, where: the bytes the planner counts for a precision, an offload target
and a ZeRO stage (`optimizer_bytes`).

Precisions (`precision_of(cfg)` names a run's):
    "fp32"        fp32 weights, gradients, AdamW moments (dtype: float32)
    "bf16"        bf16 weights, gradients and moments (dtype: bfloat16 without optim.mixed_precision: pure bf16)
    "bf16-mixed"  bf16 weights and compute, fp32 master weights and moments (optim.mixed_precision: true)
"""

from __future__ import annotations

from typing import Literal

Precision = Literal["fp32", "bf16", "bf16-mixed"]
Offload = Literal["none", "cpu", "nvme"]
PRECISIONS = ("fp32", "bf16", "bf16-mixed")


def precision_of(dtype: str, mixed_precision: bool) -> Precision:
    """The precision of a run from its `dtype` and `optim.mixed_precision` (fp16 and fp64 runs have none here)."""
    if mixed_precision:
        return "bf16-mixed"
    if dtype in ("float32", "fp32"):
        return "fp32"
    if dtype in ("bfloat16", "bf16"):
        return "bf16"
    raise ValueError(f"no optimizer precision for dtype {dtype!r}: use float32, bfloat16, or bfloat16 with "
                     "optim.mixed_precision")


def optimizer_bytes(params: int, precision: Precision, offload: Offload = "none", zero: int = 0,
                    ranks: int = 1) -> dict[str, float]:
    """Bytes one rank keeps for `params` trainable parameters between steps, by where: {"device", "host", "nvme"}
    (and "per_param": the same divided by `params`), as `build_optimizer` / `optimizer_step` keep them.

    Counted, per parameter (N = `ranks`; a share of 1/N where ZeRO shards it):
      weights      the model's parameters: 4 (fp32) or 2 (bf16, bf16-mixed) bytes; under ZeRO-2/3 sharded (1/N)
      gradients    `param.grad` in the parameters' dtype, like the weights (ZeRO-0/1: whole on every rank)
      moments      AdamW's exp_avg and exp_avg_sq: 8 bytes fp32 (4 in pure bf16), 1/N from ZeRO-1 on
      master       bf16-mixed, and any offload: an fp32 copy of the weights, 4 bytes, 1/N from ZeRO-1
      master grad  with a master: the fp32 gradient the step reads, 4 bytes, 1/N from ZeRO-1; each parameter's
                   `grad` is freed as it is cast into it, so on the device the larger of gradients and master
                   grads is counted, not both
    Offload moves moments, master and master grad to "host" (cpu) or "nvme" (memory-mapped files: the master and
    moments; the master grad stays in host memory); weights and gradients stay on the device.
    E.g. bf16-mixed, ZeRO-0: 2 weights + 8 moments + 4 master + max(2 gradient, 4 master grad) = 18 device
    bytes (2+2+12 = 16 during the backward; 18 at the step, the bf16 gradient turned into an fp32 one).
    Not counted: the bf16 copy of a gathered FSDP unit and its unsharded gradient during a forward/backward
    (transients the planner counts per layer), allocator slack, DeepSpeed's own buffers.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
    if offload not in ("none", "cpu", "nvme"):
        raise ValueError(f"offload {offload!r}: one of none, cpu, nvme")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero stage {zero}: one of 0, 1, 2, 3")
    if ranks < 1:
        raise ValueError(f"ranks {ranks}: at least 1")
    share = 1.0 / ranks
    mixed = precision == "bf16-mixed"
    weight = 4.0 if precision == "fp32" else 2.0
    sharded_weights = zero >= 2
    weights = weight * (share if sharded_weights else 1.0)
    grads = weight * (share if sharded_weights else 1.0)
    opt_share = share if zero >= 1 else 1.0
    moments = (4.0 if precision == "bf16" else 8.0) * opt_share
    has_master = mixed or offload != "none"
    if offload != "none":
        moments = 8.0 * opt_share  # DeepSpeed's CPU Adam keeps fp32 moments
    master = 4.0 * opt_share if has_master else 0.0
    master_grad = 4.0 * opt_share if has_master else 0.0
    per = {"device": weights, "host": 0.0, "nvme": 0.0}
    if offload == "none":
        per["device"] += moments + master + max(grads, master_grad)
    else:
        per["device"] += grads
        per["nvme" if offload == "nvme" else "host"] += moments + master
        per["host"] += master_grad
    return {**{k: v * params for k, v in per.items()}, "per_param": per}
