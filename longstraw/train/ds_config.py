"""A DeepSpeed JSON config read as TrainConfig overrides (`infra/launch.sh --deepspeed ds.json`, which exports
LONGSTRAW_DEEPSPEED_CONFIG; `longstraw train | resume | serve` read it).

LongStraw does not run DeepSpeed's engine (FSDP2 shards, longstraw/parallel/fsdp.py says why); it honours the
fields of a DeepSpeed config that have a meaning here, mapped onto the run's config:

    zero_optimization.stage                          optim.zero_stage
    zero_optimization.offload_optimizer.device       optim.offload (none | cpu | nvme)
    zero_optimization.offload_optimizer.nvme_path    optim.nvme_path
    bf16.enabled                                     true: dtype bfloat16 + optim.mixed_precision (DeepSpeed's bf16
                                                     keeps fp32 master weights too); false: nothing
    optimizer {type: AdamW, params: {lr, betas, eps, weight_decay}}   optim.lr, betas, eps, weight_decay
    gradient_clipping                                optim.grad_clip (0: no clipping, as in DeepSpeed)

Fields that only tune DeepSpeed's own engine (bucket sizes, overlap, prefetch, pinned memory, logging) are accepted
and ignored with a warning: FSDP2 and torch.distributed choose their own. Anything else (fp16, a scheduler, another
optimizer, offload_param, batch sizes other than 1, "auto" values, unknown keys) is refused with the LongStraw
option to use instead: a config whose meaning would silently change is an error, not a guess.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

ENV = "LONGSTRAW_DEEPSPEED_CONFIG"

# tuning of DeepSpeed's engine with no counterpart here: accepted, ignored, named in a warning
_ENGINE_ONLY = {
    "": {"wall_clock_breakdown", "steps_per_print", "prescale_gradients", "communication_data_type", "dump_state",
         "memory_breakdown", "zero_allow_untested_optimizer", "flops_profiler", "comms_logger", "tensorboard",
         "wandb", "csv_monitor"},
    "zero_optimization": {"overlap_comm", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
                          "allgather_partitions", "allgather_bucket_size", "round_robin_gradients",
                          "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                          "stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size",
                          "stage3_gather_16bit_weights_on_model_save", "memory_efficient_linear",
                          "elastic_checkpoint", "load_from_fp32_weights"},
    "zero_optimization.offload_optimizer": {"pin_memory", "buffer_count", "fast_init", "ratio", "pipeline_read",
                                            "pipeline_write"},
    "bf16": {"immediate_grad_update", "check_grad_overflow"},
    "aio": {"block_size", "queue_depth", "thread_count", "single_submit", "overlap_events", "intra_op_parallelism",
            "use_gds"},
}
# batch fields: LongStraw's step is one GRPO step of `groups` x `responses`; DeepSpeed's batch sizes must say 1
_ONE = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}
_INSTEAD = {
    "fp16": "fp16 needs loss scaling, which LongStraw does not do; use bf16 (dtype: bfloat16, optim.mixed_precision)",
    "amp": "use bf16 (dtype: bfloat16, optim.mixed_precision)",
    "scheduler": "set optim.warmup_updates, optim.schedule (constant | linear | cosine) and optim.min_lr_ratio",
    "train_batch_size": "the batch is `groups` prompts x `responses` answers in the run config",
    "zero_optimization.offload_param": "parameter offload is not supported; ZeRO-3 (optim.zero_stage: 3) shards "
                                       "the parameters over the ranks",
    "activation_checkpointing": "use engine.checkpoint_layers in the run config",
    "gradient_predivide_factor": "LongStraw sums gradients exactly (FSDP divides by the sequence-parallel size)",
}


def read_deepspeed_config(source: str | Path | dict) -> tuple[dict, list[str]]:
    """(TrainConfig overrides, the fields ignored) of a DeepSpeed config (a path or a parsed dict). Raises
    ValueError naming the first field it does not honour and what to set instead."""
    where = "DeepSpeed config"
    if not isinstance(source, dict):
        path = Path(source)
        where = f"DeepSpeed config {path}"
        if not path.is_file():
            raise FileNotFoundError(f"{where} not found")
        try:
            source = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{where} is not JSON: {e}") from None
    if not isinstance(source, dict):
        raise ValueError(f"{where}: expected a JSON object")
    cfg = source

    def refuse(field: str, why: str) -> None:
        raise ValueError(f"{where}: `{field}` is not honoured by LongStraw: {why}")

    def check_keys(section: dict, path: str, honoured: set[str]) -> None:
        for key, value in section.items():
            full = f"{path}.{key}" if path else key
            if value == "auto":
                refuse(full, "\"auto\" values are filled by the HF Trainer integration; give a value")
            if key in honoured or key in _ENGINE_ONLY.get(path, ()):
                continue
            if full in _INSTEAD:
                refuse(full, _INSTEAD[full])
            refuse(full, f"unknown to LongStraw (it honours {', '.join(sorted(honoured - {'aio'}))}; see "
                         "longstraw/train/ds_config.py)")

    check_keys(cfg, "", {"zero_optimization", "bf16", "optimizer", "gradient_clipping", "aio", *_ONE})
    ignored: list[str] = []
    optim: dict = {}
    out: dict = {}
    for key in _ONE:
        if key in cfg and cfg[key] != 1:
            refuse(key, f"it is {cfg[key]}; a LongStraw step is one GRPO step of `groups` x `responses` (set those in "
                   "the run config) and this must be 1")
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict):
        refuse("zero_optimization", "expected an object")
    check_keys(zero, "zero_optimization", {"stage", "offload_optimizer"})
    if "stage" in zero:
        if zero["stage"] not in (0, 1, 2, 3):
            refuse("zero_optimization.stage", f"{zero['stage']!r} is not 0, 1, 2 or 3")
        optim["zero_stage"] = zero["stage"]
    off = zero.get("offload_optimizer")
    if off is not None:
        if not isinstance(off, dict):
            refuse("zero_optimization.offload_optimizer", "expected an object")
        check_keys(off, "zero_optimization.offload_optimizer", {"device", "nvme_path"})
        device = off.get("device", "none")
        if device not in ("none", "cpu", "nvme"):
            refuse("zero_optimization.offload_optimizer.device", f"{device!r} is not none, cpu or nvme")
        optim["offload"] = device
        if off.get("nvme_path") is not None and device == "nvme":
            optim["nvme_path"] = str(off["nvme_path"])
    bf16 = cfg.get("bf16")
    if bf16 is not None:
        if not isinstance(bf16, dict):
            refuse("bf16", "expected an object")
        check_keys(bf16, "bf16", {"enabled"})
        if bf16.get("enabled", False) is True:
            out["dtype"] = "bfloat16"
            optim["mixed_precision"] = True
    opt = cfg.get("optimizer")
    if opt is not None:
        if not isinstance(opt, dict):
            refuse("optimizer", "expected an object")
        check_keys(opt, "optimizer", {"type", "params"})
        if str(opt.get("type", "")).lower() != "adamw":
            refuse("optimizer.type", f"{opt.get('type')!r}: LongStraw steps AdamW (decoupled weight decay); set "
                   "type AdamW")
        params = opt.get("params", {})
        check_keys(params, "optimizer.params", {"lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode"})
        if params.get("adam_w_mode", True) is not True:
            refuse("optimizer.params.adam_w_mode", "false means Adam with L2 regularisation; LongStraw steps AdamW")
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key in params:
                optim[key] = params[key]
    if "gradient_clipping" in cfg:
        clip = cfg["gradient_clipping"]
        optim["grad_clip"] = None if not clip else clip
    for path, keys in _ENGINE_ONLY.items():
        section = cfg
        for part in filter(None, path.split(".")):
            section = section.get(part, {}) if isinstance(section, dict) else {}
        if isinstance(section, dict):
            ignored += [f"{path}.{k}" if path else k for k in section if k in keys]
    if "aio" in cfg:
        check_keys(cfg["aio"], "aio", set())
    if optim:
        out["optim"] = optim
    return out, sorted(ignored)


def deepspeed_overrides(path: str | Path | None = None) -> dict:
    """The overrides of the DeepSpeed config at `path`, or at $LONGSTRAW_DEEPSPEED_CONFIG when it is set ({}
    otherwise); warns once about the fields it ignores."""
    path = path or os.environ.get(ENV)
    if not path:
        return {}
    out, ignored = read_deepspeed_config(path)
    if ignored:
        warnings.warn(f"DeepSpeed config {path}: ignored (they tune DeepSpeed's engine, which LongStraw does not "
                      f"run): {', '.join(ignored)}", stacklevel=2)
    return out
