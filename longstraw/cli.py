"""Command line: `longstraw step`, `longstraw state-size`, `longstraw plan` (longstraw/tools/), `longstraw export`,
`longstraw sft` (see --help of each); the pipeline's `train`, `resume`, `serve` and `ui` are added by flows/cli.py.
Each command imports what it runs when it runs: the library's commands load neither the pipeline nor the tools
they do not use."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .errors import EXIT_USER, is_user_error, user_line
from .files import write_bytes


def _write_json(path: str | None, obj) -> None:
    if path:
        write_bytes(path, json.dumps(obj, indent=2).encode())


def rope_overrides(args: argparse.Namespace) -> dict:
    """`--rope-scaling TYPE:FACTOR` as a run config override of the model section ({} without it)."""
    from .config import parse_rope_scaling

    return {"model": {"rope_scaling": parse_rope_scaling(args.rope_scaling)}} if args.rope_scaling else {}


def _add_rope_scaling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rope-scaling", metavar="TYPE:FACTOR", help="extend the model's positions by RoPE scaling, "
                   "e.g. yarn:8 (TYPE linear, llama3 or yarn): original_max_position_embeddings (default: the "
                   "config's max_position_embeddings) x FACTOR positions; the config.json is not edited")


def _step(args: argparse.Namespace) -> int:
    from .config import StepConfig, load_config
    from .tools.step import format_table, run_step, run_step_nproc, sharded_worker

    cfg = load_config(args.config, StepConfig, rope_overrides(args))
    if args.zero is not None:
        cfg = cfg.model_copy(update={"zero_stage": args.zero})
    if args.sharded_worker or _world_size() > 1:  # one rank of a torchrun job
        results = sharded_worker(cfg, args.sharded_worker)
        if results is not None and not args.sharded_worker:
            print(format_table(results))
            _write_json(args.json, results)
        # gloo can abort in the interpreter's teardown after a run that succeeded: leave without one
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    g = cfg.responses
    print(
        f"GRPO step: {cfg.model.path or cfg.model.random['model_type'] + ' (random)'}, dtype {cfg.dtype}, "
        f"prompt {cfg.prompt_tokens} tokens, G={g} responses of {cfg.response_tokens[0]}-{cfg.response_tokens[1]} "
        f"tokens, modes {', '.join(cfg.modes)}",
        flush=True,
    )
    if args.nproc > 1:
        extra = ["--rope-scaling", args.rope_scaling] if args.rope_scaling else []
        results = run_step_nproc(cfg, args.config, args.nproc, progress=not args.no_progress, extra_args=extra)
    else:
        results = run_step(cfg, progress=not args.no_progress)
    print(format_table(results))
    _write_json(args.json, results)
    return 0


def _state_size(args: argparse.Namespace) -> int:
    from .models import read_config
    from .tools.state_size import format_state_size, state_size

    report = state_size(read_config(args.config), args.tokens, args.dtype, args.chunk)
    print(format_state_size(report))
    _write_json(args.json, report)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from .config import parse_rope_scaling
    from .models import read_config
    from .tools.activations import activation_profile
    from .tools.plan import Cluster, EngineChoice, Workload, flat_profile, format_plan, plan, smallest_fit
    from .tools.work import format_work, step_time, step_work

    cfg = read_config(args.config)
    rope = parse_rope_scaling(args.rope_scaling) if args.rope_scaling else None
    lora = None if args.lora is None else {"r": args.lora, "target_modules": args.lora_targets}
    profile = flat_profile(cfg, int(args.activation_kb * 1e3)) if args.activation_kb else \
        activation_profile(cfg, lora)
    ckpt = {"auto": None, "on": True, "off": False}[args.checkpoint_layers]
    load = Workload(args.tokens, responses=args.responses, response_tokens=args.response_tokens, lora=lora,
                    rope_scaling=rope, routing_replay=args.routing_replay)
    cluster = Cluster(args.gpus, args.gpu_mem_gb, zero=args.zero, sp=args.sp, precision=args.precision,
                      offload=args.offload,
                      expert_parallel={"auto": None, "on": True, "off": False}[args.expert_parallel])
    engine = EngineChoice(chunk=args.chunk, checkpoint_layers=ckpt, prompt_order=args.prompt_order, profile=profile)
    r = plan(cfg, load, cluster, engine)
    fits = [smallest_fit(cfg, load, cluster, engine, m) for m in ("exact", "detached")]
    work = step_work(cfg, args.tokens, r["sp"], r["chunk"], args.responses, args.response_tokens, dp=r["dp"],
                     zero=args.zero, by_layer=r["prompt_order"] == "layers", expert_parallel=r["expert_parallel"])
    time = step_time(work, args.tflops, args.link_gbps)
    print(format_plan(r, *fits))
    print(format_work(work, time, args.tflops, args.link_gbps))
    if args.rehearse:
        from .tools.rehearse import format_rehearsal, rehearse

        rehearsal = rehearse(cfg, args.tokens, args.gpus, r, responses=args.responses,
                             response_tokens=args.response_tokens, rope_scaling=rope, lora=lora)
        print(format_rehearsal(rehearsal))
    _write_json(args.json, {**r, "smallest_exact": fits[0], "smallest_detached": fits[1], "work": work, "time": time})
    return 0


def _export(args: argparse.Namespace) -> int:
    from .train.checkpoint import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, merge=args.merge)
    what = "merged weights" if args.merge else "weights (and the LoRA adapter, if any, in PEFT's layout)"
    print(f"wrote {what} to {out}: an HF checkpoint directory (transformers' from_pretrained, longstraw's load_model)")
    return 0


def _sft(args: argparse.Namespace) -> int:
    from .config import load_config
    from .train.sft import SFTConfig, run_sft

    cfg = load_config(args.config, SFTConfig)
    overrides = {k: v for k, v in {"task": args.task, "steps": args.steps, "out": args.out}.items() if v is not None}
    cfg = cfg.model_copy(update=overrides)
    tokens, _, options = cfg.settings()
    print(f"SFT warm start: task {cfg.task} {options or ''}, {tokens}-token prompts, {cfg.steps} steps of {cfg.batch}",
          flush=True)
    r = run_sft(cfg, progress=not args.no_progress)
    print(f"reward before {r['reward_before']:.3f} -> after {r['reward_after']:.3f} (final loss {r['final_loss']:.3f}, "
          f"{r['seconds']:.0f} s); checkpoint: {r['checkpoint']}")
    if "call_rate_after" in r:  # an agent's warm start: multi-turn decode with the real tools
        print(f"tool call rate {r['call_rate_before']:.3f} -> {r['call_rate_after']:.3f} (without errors "
              f"{r['clean_call_rate_after']:.3f}), answer accuracy {r['accuracy_before']:.3f} -> "
              f"{r['accuracy_after']:.3f}")
    _write_json(args.json, r)
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The library's commands; the installed `longstraw` script (flows/cli.py) adds the pipeline's."""
    parser = argparse.ArgumentParser(prog="longstraw", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("step", help="one GRPO step per mode on a synthetic group: time, memory, gradient agreement")
    p.add_argument("--config", required=True, help="YAML StepConfig, e.g. configs/tiny.yaml")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--nproc", type=int, default=1, help="also run the step on N local ranks under torchrun, the "
                   "prefix state sharded over them (gloo on CPU, NCCL on GPU), against the one-process gradient")
    p.add_argument("--zero", type=int, choices=(0, 2, 3), help="in the N-rank run, shard the parameters and "
                   "gradients too (ZeRO-2/3 by FSDP2); overrides zero_stage of the config")
    _add_rope_scaling(p)
    p.add_argument("--sharded-worker", help=argparse.SUPPRESS)
    p.set_defaults(func=_step)
    p = sub.add_parser("state-size", help="prefix-state bytes per token and fixed bytes, from config.json alone")
    p.add_argument("--config", required=True, help="config.json (or its directory) of any supported model_type")
    p.add_argument("--tokens", type=int, required=True, help="prompt length in tokens")
    p.add_argument("--dtype", default="bf16", help="state dtype: bf16 (default), fp16, fp32")
    p.add_argument("--chunk", type=int, default=2048, help="prompt chunk size (exact-mode boundary states)")
    p.add_argument("--json", help="also write the report to this JSON file")
    p.set_defaults(func=_state_size)
    p = sub.add_parser("plan", help="per-rank memory of one GRPO step on N GPUs, and the smallest N that fits")
    p.add_argument("--config", required=True, help="config.json (or its directory)")
    p.add_argument("--tokens", type=int, required=True, help="prompt length in tokens")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu-mem-gb", type=float, required=True)
    p.add_argument("--zero", type=int, default=1, help="ZeRO stage 0-3 (default 1)")
    p.add_argument("--sp", type=int, help="sequence-parallel group size (default: all GPUs)")
    p.add_argument("--chunk", type=int, help="prompt chunk (default: the largest that fits, searched)")
    p.add_argument("--checkpoint-layers", choices=("auto", "on", "off"), default="auto",
                   help="per-layer activation checkpointing (default auto: off if that fits, searched)")
    p.add_argument("--precision", choices=("bf16-mixed", "bf16", "fp32"), default="bf16-mixed",
                   help="bf16-mixed: bf16 weights and compute, fp32 master weights and moments "
                   "(optim.mixed_precision, default); bf16; fp32")
    p.add_argument("--offload", choices=("none", "cpu", "nvme"), default="none",
                   help="optimizer offload: master weights and moments on the host (DeepSpeed's CPU Adam)")
    p.add_argument("--prompt-order", choices=("auto", "chunks", "layers"), default="auto",
                   help="engine.prompt_order: the prompt chunk by chunk or (ZeRO-3) layer by layer; auto: layers "
                   "when its checkpoints fit a quarter of the GPU")
    p.add_argument("--expert-parallel", choices=("auto", "on", "off"), default="auto",
                   help="MoE under ZeRO-2/3: each rank keeps experts / N whole experts and the tokens travel to them "
                   "(optim.expert_parallel; auto: when the experts split evenly over the GPUs)")
    p.add_argument("--routing-replay", action="store_true",
                   help="MoE routing replay (moe_routing_replay): the prompt's recorded experts kept with the state")
    p.add_argument("--responses", type=int, default=8, help="G")
    p.add_argument("--response-tokens", type=int, default=1024, help="R")
    p.add_argument("--activation-kb", type=float, help="activations per token (KB) instead of measuring them")
    p.add_argument("--lora", type=int, metavar="R", help="LoRA adapters of rank R instead of full fine-tuning")
    p.add_argument("--lora-targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj"],
                   help="the modules the adapters go on (default q_proj k_proj v_proj o_proj)")
    p.add_argument("--tflops", type=float, default=400, help="sustained TFLOP/s per GPU for the time estimate")
    p.add_argument("--link-gbps", type=float, default=100, help="GB/s a GPU sends, for the time estimate")
    _add_rope_scaling(p)
    p.add_argument("--rehearse", action="store_true", help="also run the step's code at full size under fake "
                   "tensors with a fake process group (no memory) and print its peak per rank beside the plan's")
    p.add_argument("--json", help="also write the plan to this JSON file")
    p.set_defaults(func=_plan)
    p = sub.add_parser("export", help="a training checkpoint's weights as an HF checkpoint (--merge: LoRA merged in)")
    p.add_argument("checkpoint", help="a checkpoint directory, e.g. runs/x/checkpoints/update-000008")
    p.add_argument("--out", required=True, help="the directory to write")
    p.add_argument("--merge", action="store_true", help="merge the LoRA adapter into the base weights")
    p.set_defaults(func=_export)
    p = sub.add_parser("sft", help="supervised warm start of a tiny model on a built-in task (reward before/after)")
    p.add_argument("--config", default="configs/sft-tiny.yaml", help="YAML SFTConfig")
    p.add_argument("--task", help="override the config's task (kv-retrieval, multi-hop, needle-count)")
    p.add_argument("--steps", type=int, help="override the number of training steps")
    p.add_argument("--out", help="override the checkpoint directory")
    p.add_argument("--json", help="also write the result to this JSON file")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_sft)
    return parser, sub


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None,
        user_errors: tuple[type[Exception], ...] = ()) -> int:
    """Run the command `argv` names; a user's error (`errors.is_user_error`: input, config, a full or read-only
    disk; and the caller's `user_errors`) prints one line and returns 2."""
    args = parser.parse_args(argv)
    if _world_size() > 1 and args.command not in ("step", "train", "resume"):
        print(f"longstraw {args.command}: error: runs on one process; of the commands `step`, `train` and `resume` "
              f"run on several ranks (WORLD_SIZE={_world_size()})", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except Exception as e:
        if not (isinstance(e, user_errors) or is_user_error(e)):
            raise
        print(f"longstraw {args.command}: error: {user_line(e)}", file=sys.stderr)
        return EXIT_USER


def main(argv: list[str] | None = None) -> int:
    return run(build_parser()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
