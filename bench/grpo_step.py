"""Time and peak memory of one GRPO step (`grpo_backward`) in each mode over a grid of prompt length P and group size G.

Every (mode, P, G) runs in a fresh subprocess (this script in its `--worker` role), so peak RSS of one run never
leaks into the next. The worker builds the model with a fixed seed, makes random prompt/responses/advantages,
then measures exactly one `grpo_backward` call: wall seconds, and peak RSS above the RSS right before the call.

    .venv/bin/python bench/grpo_step.py             # full grid: P in {1024, 4096, 16384}, G in {2, 4, 8, 16}
    .venv/bin/python bench/grpo_step.py --quick     # smoke grid: P in {512, 1024}, G in {2, 4}
    .venv/bin/python bench/grpo_step.py --P 4096 --G 2 16 --modes exact detached
    .venv/bin/python bench/grpo_step.py --P 4096 16384 --G 8 --modes exact exact-lora --lora 8   # LoRA vs full

Absolute times are noise on a shared machine; compare the ratios, which come from the same run.
Cost model (DESIGN.md; forward = 1 unit/token, backward = 2): naive 3G(P+R), detached P+3GR,
exact 3P+3GR (all prompt-chunk graphs kept) .. 4P+3GR (all recomputed).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from archs import ARCHS  # noqa: E402
from worker import report, run_worker  # noqa: E402

MIB = 1024 * 1024

# Benchmark modes -> (library mode, prompt_graph_budget). None = the library default (a quarter of free memory).
MODES = {
    "naive": ("naive", None),
    "detached": ("detached", None),
    "exact": ("exact", None),
    "exact-recompute": ("exact", 0),
    # with LoRA adapters (rank --lora) on every attention and MLP projection, the base frozen
    "detached-lora": ("detached", None),
    "exact-lora": ("exact", None),
    "exact-recompute-lora": ("exact", 0),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULT_MODES = ["naive", "detached", "exact", "exact-recompute"]




# ------------------------------------------------------------------------------------------------------------
# Worker: one measured grpo_backward call, result as one JSON line on stdout.
# ------------------------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(params: dict) -> dict:
    import torch

    import longstraw as ls
    from longstraw.engine import activation_bytes_per_token, chunk_ranges, plan_group
    from longstraw.engine.policy import GRAPH_SHARE
    from longstraw.memory import peak_bytes, release_freed, reset_peak

    torch.set_num_threads(params["threads"])
    p_len, g, r_len = params["P"], params["G"], params["R"]
    lib_mode, budget = MODES[params["mode"]]

    torch.manual_seed(params["seed"])
    hf_cfg = ARCHS[params["arch"]](params["max_pos"])
    model = ls.build_model(hf_cfg, dtype=torch.float32)
    if params["mode"].endswith("-lora"):
        ls.add_lora(model, r=params["lora"], alpha=2.0 * params["lora"],
                    target_modules=[t for t in LORA_TARGETS if any(n.endswith(t) for n, _ in model.named_modules())])
    vocab = hf_cfg["vocab_size"]
    gen = torch.Generator().manual_seed(params["seed"] + 1)
    prompt = torch.randint(0, vocab, (p_len,), generator=gen)
    responses = [torch.randint(0, vocab, (r_len,), generator=gen) for _ in range(g)]
    rewards = torch.rand(g, generator=gen, dtype=torch.float64)
    advantages = ls.group_advantages(rewards)  # zero mean: both signs
    cfg = ls.EngineConfig(prompt_chunk=params["prompt_chunk"], prompt_graph_budget=budget, branch_batch=params["branch_batch"])

    # How many prompt chunks exact mode keeps the graph of (the library's own plan, resolved just before the call).
    chunks = chunk_ranges(p_len - 1, cfg.prompt_chunk)
    plan = plan_group(model, cfg, p_len, exact=True)
    kept = plan.kept_graphs if lib_mode == "exact" else 0
    eff_budget = budget if budget is not None else plan.free_bytes // GRAPH_SHARE  # the library default
    kept_tokens = sum(e - s for s, e in chunks[len(chunks) - kept :]) if kept else 0

    if params.get("warmup", True):
        # one small call of the same mode first, so one-time costs (kernel set-up, first page faults) are not
        # charged to the measured step
        ls.grpo_backward(model, prompt[: min(p_len, 256)], responses[:2], advantages[:2] - advantages[:2].mean(),
                         mode=lib_mode, engine=cfg)
        model.zero_grad(set_to_none=True)
        release_freed()

    gc.collect()
    load_before = os.getloadavg()[0]
    rss_before = _rss_bytes()
    reset_peak()
    c0, t0 = time.process_time(), time.perf_counter()
    stats = ls.grpo_backward(model, prompt, responses, advantages, mode=lib_mode, engine=cfg)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = peak_bytes()

    grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    grad_norm = float(torch.cat(grads).norm()) if grads else 0.0
    return {
        **{k: params[k] for k in ("mode", "P", "G", "R", "arch", "threads", "prompt_chunk", "branch_batch", "seed")},
        "lib_mode": lib_mode,
        "prompt_graph_budget": budget,
        "effective_graph_budget": eff_budget if lib_mode == "exact" else None,
        "chunks": len(chunks),
        "kept_chunks": kept,
        "recomputed_prompt_tokens": (p_len - 1 - kept_tokens) if lib_mode == "exact" else 0,
        "seconds": wall,
        "cpu_seconds": cpu,
        "loadavg_1m_before": load_before,  # other load on the machine makes the seconds noise
        "lib_seconds": stats["seconds"],
        "rss_before_bytes": rss_before,
        "peak_rss_bytes": peak,
        "peak_delta_bytes": peak - rss_before,
        "state_bytes": stats["state_bytes"],
        "peak_state_bytes": stats["peak_state_bytes"],
        "loss": stats["loss"],
        "grad_norm": grad_norm,
        "activation_bytes_per_token": activation_bytes_per_token(model),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


# ------------------------------------------------------------------------------------------------------------
# Driver: grid, subprocesses, table, JSON.
# ------------------------------------------------------------------------------------------------------------


def theory_cost(mode: str, p: int, g: int, r: int, recomputed: int | None = None) -> float:
    if mode == "naive":
        return 3 * g * (p + r)
    if mode == "detached":
        return p + 3 * g * r
    if recomputed is None:  # exact without a measured run: all kept for "exact", all recomputed for the variant
        recomputed = p if mode == "exact-recompute" else 0
    return 3 * p + 3 * g * r + recomputed


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _fmt_mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MIB:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b in (None, 0) else f"{a / b:.2f}"


def summarize(
    runs: list[dict], modes: list[str], ps: list[int], gs: list[int], r: int, clock: str = "wall"
) -> tuple[str, dict]:
    ok = {(x["mode"], x["P"], x["G"]): x for x in runs if "error" not in x}
    lines = []
    head = ["P", "G"]
    for m in modes:
        head += [f"{m} s", f"{m} MiB"]
    has = set(modes)
    exact_key = "exact" if "exact" in has else ("exact-recompute" if "exact-recompute" in has else None)
    if "naive" in has and exact_key:
        head += [f"naive/{exact_key}", "theory"]
    if "naive" in has and "exact-recompute" in has and exact_key != "exact-recompute":
        head += ["naive/exact-rc", "theory"]
    if "naive" in has and "detached" in has:
        head += ["naive/detached", "theory"]
    if "naive" in has:
        head += ["theory naive/exact range"]
    rows = [head]
    ratios = []
    for p in ps:
        for g in gs:
            row = [str(p), str(g)]
            key = "seconds" if clock == "wall" else "cpu_seconds"
            sec = {m: ok[(m, p, g)][key] if (m, p, g) in ok else None for m in modes}
            for m in modes:
                res = ok.get((m, p, g))
                row += [_fmt_s(sec[m]), _fmt_mib(res["peak_delta_bytes"] if res else None)]

            def th(m):
                res = ok.get((m, p, g))
                rec = res["recomputed_prompt_tokens"] if res and m.startswith("exact") else None
                return theory_cost(m, p, g, r, rec)

            entry = {"P": p, "G": g}
            if "naive" in has and exact_key:
                t = th("naive") / th(exact_key)
                row += [_ratio(sec["naive"], sec[exact_key]), f"{t:.2f}"]
                entry[f"naive/{exact_key}"] = {"measured": sec["naive"] / sec[exact_key] if sec["naive"] and sec[exact_key] else None, "theory": t}
            if "naive" in has and "exact-recompute" in has and exact_key != "exact-recompute":
                t = th("naive") / th("exact-recompute")
                row += [_ratio(sec["naive"], sec["exact-recompute"]), f"{t:.2f}"]
                entry["naive/exact-recompute"] = {"measured": sec["naive"] / sec["exact-recompute"] if sec["naive"] and sec["exact-recompute"] else None, "theory": t}
            if "naive" in has and "detached" in has:
                t = th("naive") / th("detached")
                row += [_ratio(sec["naive"], sec["detached"]), f"{t:.2f}"]
                entry["naive/detached"] = {"measured": sec["naive"] / sec["detached"] if sec["naive"] and sec["detached"] else None, "theory": t}
            if "naive" in has:
                lo = 3 * g * (p + r) / (4 * p + 3 * g * r)
                hi = 3 * g * (p + r) / (3 * p + 3 * g * r)
                row += [f"{lo:.2f}..{hi:.2f}"]
                entry["theory naive/exact range"] = [lo, hi]
            rows.append(row)
            ratios.append(entry)
    widths = [max(len(rw[i]) for rw in rows) for i in range(len(head))]
    for i, rw in enumerate(rows):
        lines.append("  ".join(c.rjust(w) for c, w in zip(rw, widths)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(
        f"s: {clock} seconds of one grpo_backward call (--clock); MiB: peak RSS above the RSS right before the call."
    )
    lines.append("theory: cost-model ratio (DESIGN.md), using the number of prompt chunks exact actually recomputed.")

    # Peak-RSS growth from the smallest to the largest G at each P.
    growth = {}
    g_lo, g_hi = min(gs), max(gs)
    lines.append("")
    lines.append(f"peak RSS growth from G={g_lo} to G={g_hi} (MiB; flat in G is the goal for detached/exact):")
    gh = ["P"] + modes + ["1 branch act. (MiB)", "state (MiB)"]
    grows = [gh]
    for p in ps:
        row = [str(p)]
        for m in modes:
            a, b = ok.get((m, p, g_lo)), ok.get((m, p, g_hi))
            d = b["peak_delta_bytes"] - a["peak_delta_bytes"] if a and b else None
            growth.setdefault(m, {})[p] = d
            row.append("-" if d is None else f"{d / MIB:+.1f}")
        any_res = next((x for x in ok.values() if x["P"] == p), None)
        if any_res:
            row.append(f"{any_res['activation_bytes_per_token'] * r / MIB:.1f}")
            st = next((x["state_bytes"] for x in ok.values() if x["P"] == p and x["state_bytes"]), None)
            row.append(_fmt_mib(st))
        else:
            row += ["-", "-"]
        grows.append(row)
    w = [max(len(rw[i]) for rw in grows) for i in range(len(gh))]
    for i, rw in enumerate(grows):
        lines.append("  ".join(c.rjust(x) for c, x in zip(rw, w)))
        if i == 0:
            lines.append("  ".join("-" * x for x in w))

    # Cross-check: exact equals naive, so the gradient norms of the same inputs must agree.
    warn = []
    for (m, p, g), res in ok.items():
        nv = ok.get(("naive", p, g))
        if m.startswith("exact") and nv and nv["grad_norm"] > 0:
            rel = abs(res["grad_norm"] - nv["grad_norm"]) / nv["grad_norm"]
            if rel > 1e-4:
                warn.append(f"WARNING: {m} grad norm differs from naive by {rel:.2e} at P={p} G={g}")
    errors = [f"ERROR {x['mode']} P={x['P']} G={x['G']}: {x['error']}" for x in runs if "error" in x]
    skipped = [f"skipped {x['mode']} P={x['P']} G={x['G']}: {x['skipped']}" for x in runs if "skipped" in x]
    if warn or errors or skipped:
        lines.append("")
        lines += warn + errors + skipped
    return "\n".join(lines), {"ratios": ratios, "peak_growth_bytes": growth}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--P", type=int, nargs="+", default=None, help="prompt lengths (default 1024 4096 16384)")
    ap.add_argument("--G", type=int, nargs="+", default=None, help="group sizes (default 2 4 8 16)")
    ap.add_argument("--R", type=int, default=64, help="response length (every response)")
    ap.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    ap.add_argument("--arch", default="dense", choices=list(ARCHS))
    ap.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: all cores)")
    ap.add_argument("--prompt-chunk", type=int, default=None, help="GRPOConfig.prompt_chunk (default: library's)")
    ap.add_argument("--branch-batch", type=int, default=1, help="GRPOConfig.branch_batch")
    ap.add_argument("--lora", type=int, default=8, metavar="R",
                    help="rank of the adapters of the *-lora modes (e.g. --modes exact exact-lora)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-warmup", action="store_true", help="measure the first (cold) call of each mode")
    ap.add_argument("--quick", action="store_true", help="smoke grid: P in {512, 1024}, G in {2, 4}")
    ap.add_argument("--skip-naive-above", type=int, default=None, metavar="P", help="skip naive runs with prompt > P")
    ap.add_argument(
        "--max-naive-seconds", type=float, default=None,
        help="skip a naive run whose time, extrapolated linearly in G from the last naive run at the same P, exceeds this",
    )
    ap.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall",
        help="seconds in the table: wall time, or process CPU time (less hurt by other load; best with --threads 1)",
    )
    ap.add_argument("--timeout", type=float, default=None, help="kill any single run after this many seconds")
    ap.add_argument("--out", default="bench/out/grpo_step.json", help="JSON results path")
    ap.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.P = args.P or [512, 1024]
        args.G = args.G or [2, 4]
    args.P = sorted(args.P or [1024, 4096, 16384])
    args.G = sorted(args.G or [2, 4, 8, 16])
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        res = worker(json.loads(args.worker))
        report(res)
        return 0

    from longstraw.engine import DEFAULT_CHUNK

    threads = args.threads or len(os.sched_getaffinity(0))
    chunk = args.prompt_chunk or DEFAULT_CHUNK
    need = max(args.P) + args.R
    max_pos = 1 << (need - 1).bit_length()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch

    meta = {
        "arch": args.arch,
        "model_config": ARCHS[args.arch](max_pos),
        "P": args.P, "G": args.G, "R": args.R, "modes": args.modes,
        "threads": threads, "clock": args.clock, "prompt_chunk": chunk, "branch_batch": args.branch_batch, "seed": args.seed,
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "host": platform.node(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "loadavg_start": os.getloadavg(),
    }
    print(f"grpo_step bench: arch={args.arch} R={args.R} threads={threads} prompt_chunk={chunk} -> {out}", flush=True)
    runs: list[dict] = []
    total = len(args.P) * len(args.G) * len(args.modes)
    n = 0
    for p in args.P:
        last_naive: tuple[int, float] | None = None
        for g in args.G:
            for mode in args.modes:
                n += 1
                params = {
                    "mode": mode, "P": p, "G": g, "R": args.R, "arch": args.arch, "threads": threads,
                    "prompt_chunk": chunk, "branch_batch": args.branch_batch, "seed": args.seed, "max_pos": max_pos,
                    "warmup": not args.no_warmup, "lora": args.lora,
                }
                skip = None
                if mode == "naive" and args.skip_naive_above is not None and p > args.skip_naive_above:
                    skip = f"P > --skip-naive-above {args.skip_naive_above}"
                if mode == "naive" and args.max_naive_seconds is not None and last_naive:
                    est = last_naive[1] * g / last_naive[0]
                    if est > args.max_naive_seconds:
                        skip = f"estimated {est:.0f} s > --max-naive-seconds {args.max_naive_seconds:.0f}"
                if skip:
                    res = {**params, "skipped": skip}
                    print(f"[{n}/{total}] {mode:>15} P={p:<6} G={g:<3} skipped ({skip})", flush=True)
                else:
                    res = run_worker(__file__, params, args.timeout)
                    if "error" in res:
                        print(f"[{n}/{total}] {mode:>15} P={p:<6} G={g:<3} ERROR {res['error']}", flush=True)
                    else:
                        if mode == "naive":
                            last_naive = (g, res["seconds"])
                        print(
                            f"[{n}/{total}] {mode:>15} P={p:<6} G={g:<3} {res['seconds']:8.2f} s (cpu {res['cpu_seconds']:7.2f})  "
                            f"peak +{res['peak_delta_bytes'] / MIB:8.1f} MiB (abs {res['peak_rss_bytes'] / MIB:7.1f})  "
                            f"state {res['state_bytes'] / MIB:6.1f} MiB  kept {res['kept_chunks']}/{res['chunks']} chunks  "
                            f"loss {res['loss']:+.5f}  |grad| {res['grad_norm']:.6g}",
                            flush=True,
                        )
                runs.append(res)
                out.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    table, summary = summarize(runs, args.modes, args.P, args.G, args.R, args.clock)
    print("\n" + table, flush=True)
    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    out.write_text(json.dumps({"meta": meta, "runs": runs, "summary": summary}, indent=1))
    print(f"\nresults: {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
