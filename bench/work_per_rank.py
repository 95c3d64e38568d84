"""Work per rank, counted (not timed): the FLOPs and bytes sent of every rank in one exact GRPO step under
sequence parallelism (gloo, CPU), per model family and rank count N. The "before" numbers of issue 23.

For each family's tiny model (bench/archs.py) and each N, torch's launcher (`longstraw.parallel.launch.torchrun`)
starts N ranks of this module in its `--worker` role. Every rank builds the same model and runs the four public
steps of `grpo_backward(mode="exact", parallel=SequenceParallel())` (capture(exact=True), new_dstate, replay,
prompt_backward), each under its own `FlopCounterMode`, and writes what it counted. The parent prints per family:
per-rank FLOPs (busiest / mean / least), busiest / (N = 1 total / N) (issue 23's target: <= 1.15), the sum over
ranks against N = 1 (the work that sequence parallelism repeats), and the bytes each rank sent.

    .venv/bin/python bench/work_per_rank.py                                  # all three families, N 1 2 4, P 16384
    .venv/bin/python bench/work_per_rank.py --P 2048 --ranks 1 2 --archs dense
    .venv/bin/python bench/work_per_rank.py --P 512 --chunk 128 --check-whole  # also grpo_backward itself, compared

What is counted. FLOPs are torch's FlopCounterMode (2 per multiply-add of matrix products; elementwise ops,
norms, softmax, routing and top-k are not counted), plus formulas for four ops it leaves out or miscounts
(`EXTRA_FLOPS`): the CPU flash-attention kernel the engine calls and its backward (not in torch's table; counted
with the causal mask's real pairs, where torch's own SDPA formulas count a causal product as a full square),
`linalg_solve_triangular` (Gated DeltaNet's chunk solves), `_grouped_mm` (the MoE experts) and
`convolution_backward` (torch's formula ignores groups in the weight gradient, so a depthwise conv's backward
counts channels x too much). Any other matrix-like op that runs uncounted is listed in the output.

Bytes, three ways, per rank: `sent` is what the process actually wrote to its sockets (the wchar delta of
/proc/self/io over the phase: gloo sends with write/writev; 0 at N = 1), `model` is the same from the collectives
called (all_reduce 2(N-1)/N x size, as gloo's ring; all_gather (N-1) x size; broadcast (N-1) x size from the
root, 0 elsewhere; all_to_all (N-1)/N x size; the autograd all-gathers of the split schedule's small Gated
DeltaNet summaries and conv halos go through torch's functional collectives and are in `sent` only), and `payload` is `SequenceParallel.bytes_communicated`, what the rank handed to the
sequence-parallel collectives (as bench/dist_step.py reports it: the size of each tensor, whatever N, so a
broadcast's receivers count it too; the small all_reduces of agree_min / check_same are not in it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from archs import ARCHS  # noqa: E402

FAMILIES = ("dense", "qwen3_5", "glm_moe_dsa")
PHASES = ("capture", "replay", "prompt_backward")
# matrix-like op names: such an op running without a FLOP formula is worth a warning (elementwise ones are not)
MATRIX_LIKE = re.compile(r"mm|matmul|conv|attention|solve|einsum|linear|linalg|cholesky|fft|triangular")
GIB = 2**30
MIB = 2**20


# ---------------------------------------------------------------------------------------------------------------
# FLOP formulas for what FlopCounterMode does not count (or miscounts). They take shapes, as torch's formulas do.
# ---------------------------------------------------------------------------------------------------------------


def attention_pairs(s_q: int, s_k: int, causal: bool) -> int:
    """(query, key) pairs a softmax attention computes. Causal is torch's top-left mask: query i sees keys 0..i."""
    if not causal:
        return s_q * s_k
    m = min(s_q, s_k)
    return m * (m + 1) // 2 + (s_q - m) * s_k


def cpu_flash_forward_flops(q: list[int], k: list[int], v: list[int], dropout_p: float = 0.0, is_causal: bool = False,
                            *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """q [B, H, Sq, Dq], k [B, Hkv, Sk, Dq], v [B, Hkv, Sk, Dv]: Q K^T and P V over the pairs the mask keeps."""
    b, h, s_q, d_q = q
    return 2 * b * h * attention_pairs(s_q, k[2], bool(is_causal)) * (d_q + v[3])


def cpu_flash_backward_flops(do: list[int], q: list[int], k: list[int], v: list[int], out: list[int],
                             lse: list[int], dropout_p: float = 0.0, is_causal: bool = False, *args: Any,
                             out_shape: Any = None, **kwargs: Any) -> int:
    """The five products torch's SDPA backward formula counts (scores recomputed, dP, dV, dQ, dK), per kept pair."""
    b, h, s_q, d_q = q
    return 2 * b * h * attention_pairs(s_q, k[2], bool(is_causal)) * (3 * d_q + 2 * v[3])


def solve_triangular_flops(a: list[int], b: list[int], *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """A [..., n, n] triangular, the solution X of B's (broadcast) shape: n^2/2 multiply-adds per right-hand side,
    i.e. n FLOPs per solution entry."""
    return math.prod(out_shape) * a[-1]


def grouped_mm_flops(a: list[int], b: list[int], *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """torch._grouped_mm: each output entry is one dot product of a's last dim, except for 2-D x 2-D, where the
    groups split the contraction (the weight gradient: out [E, M, N], K summed over E groups)."""
    k = a[-1]
    if len(a) == 2 and len(b) == 2:
        return 2 * math.prod(out_shape) * k // out_shape[0]
    return 2 * math.prod(out_shape) * k


def conv_backward_flops(grad_out: list[int], x: list[int], w: list[int], bias: Any, stride: Any, padding: Any,
                        dilation: Any, transposed: bool, output_padding: Any, groups: int, output_mask: list[bool],
                        out_shape: Any = None, **kwargs: Any) -> int:
    """Each gradient (input, weight) takes the forward's multiply-adds again; w [C_out, C_in / groups, *kernel]
    already holds the per-group channels, so groups are accounted for (torch's formula overcounts the weight
    gradient by the group count)."""
    spatial = (x if transposed else grad_out)[2:]
    forward = 2 * x[0] * math.prod(w) * math.prod(spatial)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


def extra_flops() -> dict:
    import torch

    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash_forward_flops,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: cpu_flash_backward_flops,
            aten.linalg_solve_triangular: solve_triangular_flops,
            aten._grouped_mm: grouped_mm_flops,
            aten.convolution_backward: conv_backward_flops}


def op_label(packet: Any, args: tuple, kwargs: dict) -> str:
    """The op's name; the CPU flash kernels also say whether causal (a segment's own tokens) or not (the prefix)."""
    name = str(packet)
    if "flash_attention_for_cpu" in name:
        causal_at = 4 if name.endswith("_for_cpu") else 7
        causal = kwargs.get("is_causal", args[causal_at] if len(args) > causal_at else False)
        name += "[causal]" if causal else "[prefix]"
    return name


def counting_mode():
    """A FlopCounterMode (with `extra_flops`) that also keeps FLOPs per op label and the ops run uncounted."""
    from torch.utils.flop_counter import FlopCounterMode

    class Counting(FlopCounterMode):
        def __init__(self) -> None:
            super().__init__(display=False, custom_mapping=extra_flops())
            self.by_op: Counter = Counter()
            self.uncounted: Counter = Counter()
            self.hooked = False

        # FlopCounterMode's per-op hook (private; if torch renames it, `hooked` stays False and the run says so)
        def _count_flops(self, func_packet, out, args, kwargs):
            self.hooked = True
            if func_packet in self.flop_registry:
                self.by_op[op_label(func_packet, args, kwargs)] += self.flop_registry[func_packet](
                    *args, **kwargs, out_val=out)
            else:
                self.uncounted[str(func_packet)] += 1
            return super()._count_flops(func_packet, out, args, kwargs)

    return Counting()


# ---------------------------------------------------------------------------------------------------------------
# Bytes: the collectives called (with a model of what each sends) and what the process wrote to its sockets.
# ---------------------------------------------------------------------------------------------------------------


class CollectiveLog:
    """Wraps torch.distributed's collectives (the engine calls them as `dist.all_reduce` etc., so the module
    attributes are what it reaches) and adds up, per call kind, the calls and the bytes this rank sends under the
    ring / flat model that gloo's measured traffic follows."""

    KINDS = ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
             "all_to_all_single", "barrier")

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.calls: Counter = Counter()
        self.model_bytes = 0
        for kind in self.KINDS:
            setattr(dist, kind, self._wrap(kind, getattr(dist, kind)))

    def _sent(self, kind: str, args: tuple, kwargs: dict) -> float:
        dist = self.dist
        group = kwargs.get("group")
        n = dist.get_world_size(group)
        if n == 1 or kind == "barrier":
            return 0
        if kind == "all_reduce":
            return 2 * (n - 1) / n * args[0].nbytes
        if kind == "all_gather":
            return (n - 1) * args[1].nbytes
        if kind == "broadcast":
            src = args[1] if len(args) > 1 else kwargs["src"]
            return (n - 1) * args[0].nbytes if dist.get_rank() == src else 0
        if kind == "all_gather_into_tensor":
            return (n - 1) * args[1].nbytes
        if kind == "all_to_all_single":  # (output, input): all but this rank's own part leaves
            return (n - 1) / n * args[1].nbytes
        return (n - 1) / n * args[1].nbytes  # reduce_scatter_tensor(output, input)

    def _wrap(self, kind: str, fn: Callable) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.calls[kind] += 1
            self.model_bytes += self._sent(kind, args, kwargs)
            return fn(*args, **kwargs)

        return wrapped


def written_bytes() -> int | None:
    """Bytes this process has written through write-type syscalls (sockets included); None off Linux."""
    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        return int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------------------------
# One rank.
# ---------------------------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout))
    code = 0
    try:
        result = measure(args)
        Path(args.out_dir, f"rank-{dist.get_rank()}.json").write_text(json.dumps(result))
    except Exception:  # say which rank failed and why; the others then time out or fail on their collective
        traceback.print_exc()
        code = 1
    finally:
        try:
            dist.destroy_process_group()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)  # skip interpreter teardown (gloo's threads, pools): the rank has said what it had


def measure(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    import longstraw as ls

    log = CollectiveLog()
    sp = ls.SequenceParallel()
    torch.manual_seed(0)
    model = ls.build_model(ARCHS[args.arch](args.P + args.R + 8))
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (args.P,), generator=gen)
    responses = [torch.randint(0, vocab, (args.R,), generator=gen) for _ in range(args.G)]
    adv = ls.group_advantages(torch.rand(args.G, generator=gen, dtype=torch.float64))
    engine = ls.EngineConfig(prompt_chunk=args.chunk, prompt_graph_budget=0, boundary_every=args.boundary_every)
    loss = ls.GRPOConfig()

    phases: dict[str, dict] = {}
    uncounted: Counter = Counter()
    hooked = True

    def counted(name: str, fn: Callable[[], Any]) -> Any:
        nonlocal hooked
        dist.barrier()  # no rank's traffic of one phase lands in another's window
        calls0, model0, payload0, wrote0 = Counter(log.calls), log.model_bytes, sp.bytes_communicated, written_bytes()
        t0 = time.perf_counter()
        with counting_mode() as mode:
            out = fn()
        seconds = time.perf_counter() - t0
        wrote1 = written_bytes()
        dist.barrier()
        calls = log.calls - calls0
        calls.pop("barrier", None)
        phases[name] = {"flops": mode.get_total_flops(), "flops_by_op": dict(mode.by_op),
                        "sent_bytes": None if wrote0 is None or wrote1 is None else wrote1 - wrote0,
                        "model_bytes": log.model_bytes - model0, "payload_bytes": sp.bytes_communicated - payload0,
                        "collective_calls": dict(calls), "seconds": seconds}
        if sum(mode.by_op.values()) != phases[name]["flops"]:
            raise RuntimeError(f"{name}: per-op FLOPs {sum(mode.by_op.values())} != total {phases[name]['flops']}")
        uncounted.update(mode.uncounted)
        hooked = hooked and mode.hooked
        return out

    # warm-up, uncounted: the engine measures a model's activation bytes per token once, with two probe chunks
    # (engine/budget.py); that is not per-step work
    warm = min(args.P, 256)
    ls.grpo_backward(model, prompt[:warm], responses[:2], adv[:2] - adv[:2].mean(), config=loss, engine=engine,
                     parallel=sp)
    model.zero_grad(set_to_none=True)

    # grpo_backward's four steps (engine/grpo.py), each under its own counter; the branch check and the branch
    # selection are those grpo_backward makes (one data-parallel group: every branch)
    branches = ls.Branches.group(responses, adv, loss, vocab_size=vocab)
    state = counted("capture", lambda: ls.capture(model, prompt, engine, parallel=sp, exact=True))
    dstate = ls.new_dstate(state)
    counted("replay", lambda: ls.replay(model, state, branches.select(sp.branches(len(branches))), loss, dstate,
                                        engine=engine, parallel=sp))
    counted("prompt_backward", lambda: ls.prompt_backward(model, state, dstate, parallel=sp))
    grad_norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters() if p.grad is not None))
    result = {"rank": sp.rank, "size": sp.size, "phases": phases, "flops": sum(p["flops"] for p in phases.values()),
              "grad_norm": grad_norm, "state_bytes": state.nbytes, "chunks": len(state.chunks),
              "boundary_every": state.boundary_every, "uncounted_ops": dict(uncounted), "hooked": hooked}
    if args.check_whole:  # grpo_backward itself, counted whole: the four steps above must be the same work
        model.zero_grad(set_to_none=True)
        counted("whole", lambda: ls.grpo_backward(model, prompt, responses, adv, mode="exact", config=loss,
                                                  engine=engine, parallel=sp))
        result["whole"] = phases.pop("whole")
    return result


# ---------------------------------------------------------------------------------------------------------------
# The parent: one torchrun job per (family, N), then the tables.
# ---------------------------------------------------------------------------------------------------------------


def run(arch: str, n: int, args: argparse.Namespace) -> list[dict]:
    from longstraw.parallel.launch import torchrun

    with tempfile.TemporaryDirectory() as d:
        worker_args = ["--worker", "--out-dir", d, "--arch", arch, "--P", str(args.P), "--G", str(args.G),
                       "--R", str(args.R), "--chunk", str(args.chunk), "--threads", str(args.threads),
                       "--collective-timeout", str(args.collective_timeout)]
        if args.boundary_every:
            worker_args += ["--boundary-every", str(args.boundary_every)]
        if args.check_whole:
            worker_args.append("--check-whole")
        # run as the module bench.work_per_rank from the repository root (bench/ is a namespace package)
        done = torchrun("bench.work_per_rank", worker_args, n, threads=args.threads, cwd=ROOT, capture_output=True,
                        text=True, timeout=args.timeout)
        files = sorted(Path(d).glob("rank-*.json"), key=lambda f: int(f.stem.split("-")[1]))
        if done.returncode or len(files) != n:
            raise RuntimeError(f"{arch} N={n} failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                               f"{done.stderr[-4000:]}")
        return [json.loads(f.read_text()) for f in files]


def summarise(n: int, ranks: list[dict], base_total: int | None) -> dict:
    flops = [r["flops"] for r in ranks]
    busiest = max(range(n), key=lambda i: flops[i])
    sent = [sum(p["sent_bytes"] or 0 for p in r["phases"].values()) for r in ranks]
    row = {"N": n, "flops_per_rank": flops, "busiest_rank": busiest, "busiest_flops": flops[busiest],
           "mean_flops": sum(flops) / n, "least_flops": min(flops), "sum_flops": sum(flops),
           "sent_bytes_per_rank": sent,
           "model_bytes_per_rank": [sum(p["model_bytes"] for p in r["phases"].values()) for r in ranks],
           "payload_bytes_per_rank": [sum(p["payload_bytes"] for p in r["phases"].values()) for r in ranks],
           "collective_calls_per_rank": [sum(sum(p["collective_calls"].values()) for p in r["phases"].values())
                                         for r in ranks],
           "phase_flops_per_rank": {ph: [r["phases"][ph]["flops"] for r in ranks] for ph in PHASES},
           "grad_norm": ranks[0]["grad_norm"], "seconds": max(sum(p["seconds"] for p in r["phases"].values())
                                                             for r in ranks),
           "ranks": ranks}
    if base_total:
        row["busiest_vs_even_split"] = flops[busiest] / (base_total / n)  # issue 23's target: <= 1.15
        row["sum_vs_1"] = sum(flops) / base_total
    if "whole" in ranks[0]:
        row["whole_flops_per_rank"] = [r["whole"]["flops"] for r in ranks]
    return row


def gf(x: float) -> str:
    return f"{x / 1e9:.2f}"


def print_family(arch: str, rows: list[dict]) -> None:
    head = (f"{'N':>2}  {'GFLOP/rank busiest (rank)':>25}  {'mean':>8}  {'least':>8}  {'busiest/(N=1 total/N)':>21}  "
            f"{'sum/N=1':>7}  {'sent MiB/rank max':>17}  {'model':>7}  {'payload':>8}  {'calls':>6}  "
            f"{'|grad| vs N=1':>13}")
    print(f"\n{arch}\n{head}\n{'-' * len(head)}")
    base_norm = rows[0]["grad_norm"] if rows and rows[0]["N"] == 1 else None
    for row in rows:
        ratio = f"{row['busiest_vs_even_split']:.2f}" if "busiest_vs_even_split" in row else "n/a"
        total = f"{row['sum_vs_1']:.2f}" if "sum_vs_1" in row else "n/a"
        diff = f"{abs(row['grad_norm'] - base_norm) / base_norm:.1e}" if base_norm else "n/a"
        busiest = f"{gf(row['busiest_flops'])} ({row['busiest_rank']})"
        print(f"{row['N']:>2}  {busiest:>25}  {gf(row['mean_flops']):>8}  "
              f"{gf(row['least_flops']):>8}  {ratio:>21}  {total:>7}  {max(row['sent_bytes_per_rank']) / MIB:>17.2f}  "
              f"{max(row['model_bytes_per_rank']) / MIB:>7.2f}  {max(row['payload_bytes_per_rank']) / MIB:>8.2f}  "
              f"{max(row['collective_calls_per_rank']):>6}  {diff:>13}")
    detail = (f"{'N':>2} {'rank':>4}  {'capture':>8}  {'replay':>8}  {'prompt bwd':>10}  {'total':>8}  "
              f"{'attn over prefix':>16}  {'attn causal':>11}  {'bmm':>8}  {'sent MiB':>8}")
    print(f"  per rank, GFLOP (attn: the CPU flash kernels, forward + backward; bmm: batched products, i.e. Gated "
          f"DeltaNet's chunks, MLA and DSA's indexer and sparse attention)\n  {detail}")
    for row in rows:
        for r in row["ranks"]:
            ops = Counter()
            for p in r["phases"].values():
                ops.update(p["flops_by_op"])
            prefix = sum(v for k, v in ops.items() if k.endswith("[prefix]"))
            causal = sum(v for k, v in ops.items() if k.endswith("[causal]"))
            ph = r["phases"]
            print(f"  {row['N']:>2} {r['rank']:>4}  {gf(ph['capture']['flops']):>8}  {gf(ph['replay']['flops']):>8}  "
                  f"{gf(ph['prompt_backward']['flops']):>10}  {gf(r['flops']):>8}  {gf(prefix):>16}  {gf(causal):>11}  "
                  f"{gf(ops['aten.bmm']):>8}  "
                  f"{row['sent_bytes_per_rank'][r['rank']] / MIB:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--P", type=int, default=16384, help="prompt tokens")
    ap.add_argument("--G", type=int, default=4, help="responses")
    ap.add_argument("--R", type=int, default=64, help="tokens per response")
    ap.add_argument("--chunk", type=int, default=2048, help="prompt chunk (EngineConfig.prompt_chunk)")
    ap.add_argument("--boundary-every", type=int, default=None, help="EngineConfig.boundary_every (default: the "
                    "engine's choice, every chunk for these tiny models)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--archs", nargs="+", default=list(FAMILIES), choices=list(ARCHS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--check-whole", action="store_true",
                    help="also count grpo_backward as one call and check it equals the sum of the four steps")
    ap.add_argument("--collective-timeout", type=float, default=600, help="seconds before a collective gives up")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per torchrun job")
    ap.add_argument("--json", default=str(ROOT / "bench" / "out" / "work_per_rank.json"))
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: dense only, N in {1, 2}, P = 256, chunk 64, G = 2, R = 8, --check-whole")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--arch", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.P, args.chunk, args.G, args.R, args.ranks, args.archs = 256, 64, 2, 8, [1, 2], ["dense"]
        args.check_whole = True
    print(f"work_per_rank: P={args.P} G={args.G} R={args.R} chunk={args.chunk} ranks={args.ranks} "
          f"threads/rank={args.threads} (gloo, exact mode, prompt_graph_budget=0: every prompt chunk recomputed)",
          flush=True)
    t_start = time.perf_counter()
    out: dict = {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "out_dir", "arch")},
                 "families": {}}
    problems: list[str] = []
    for arch in args.archs:
        rows: list[dict] = []
        base_total = None
        for n in sorted(args.ranks):
            t0 = time.perf_counter()
            ranks = run(arch, n, args)
            if n == 1:
                base_total = ranks[0]["flops"]
            row = summarise(n, ranks, base_total)
            row["job_seconds"] = time.perf_counter() - t0
            rows.append(row)
            for r in ranks:
                if "whole" in r and r["whole"]["flops"] != r["flops"]:
                    problems.append(f"{arch} N={n} rank {r['rank']}: grpo_backward counted {r['whole']['flops']} "
                                    f"FLOPs, its four steps {r['flops']}")
                if not r["hooked"]:
                    problems.append(f"{arch} N={n}: could not list uncounted ops (FlopCounterMode internals changed)")
            print(f"  {arch} N={n}: {row['job_seconds']:.1f} s", flush=True)
        uncounted = Counter()
        for row in rows:
            for r in row["ranks"]:
                uncounted.update(r["uncounted_ops"])
        matrix_like = sorted(k for k in uncounted if MATRIX_LIKE.search(k))
        out["families"][arch] = {"rows": rows, "uncounted_ops": dict(uncounted), "uncounted_matrix_like": matrix_like}
        print_family(arch, rows)
        print("  matrix-like ops run without a FLOP formula: " + (", ".join(matrix_like) or "none"))
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))  # after each family, so a killed run keeps its part
    out["seconds"] = time.perf_counter() - t_start
    out["problems"] = problems
    Path(args.json).write_text(json.dumps(out, indent=1))
    print("\nGFLOP: FlopCounterMode's count plus this script's formulas (causal pairs only; elementwise ops not "
          "counted).\nbusiest/(N=1 total/N): issue 23's target is <= 1.15. sum/N=1: the work of all ranks "
          "against one process (1.00: nothing repeated).\n|grad| vs N=1: relative difference of rank 0's gradient norm from N = 1's."
          "\nsent: bytes the rank wrote to its sockets (/proc/self/io); model: the ring / flat formula over the "
          "collectives called;\npayload: SequenceParallel.bytes_communicated; calls: collectives per step.")
    print(f"results: {args.json} ({out['seconds']:.0f} s)")
    for p in problems:
        print("PROBLEM: " + p)
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
