"""Gated delta rule (Gated DeltaNet, Qwen3.5 linear layers) with an initial and a final state.

Per value head, with S a [dk, dv] state, decay a_t = exp(g_t) and write strength beta_t:
    S_t = a_t S_{t-1} + k_t (beta_t (v_t - a_t S_{t-1}^T k_t))^T,      o_t = S_t^T q_t
(q, k L2-normalised, q scaled by dk^-0.5; each key head serves Hv/Hk consecutive value heads.)

`chunk_gated_delta_rule` is the pure-torch chunked form (CPU, tests; differentiable w.r.t. all inputs and the
initial state through autograd). Within a chunk of C tokens starting from S0, with cumulative log-decay G_i:
    delta = (I + A)^-1 (beta v - beta e^G K S0),   A_ij = beta_i e^(G_i - G_j) k_i.k_j  (j < i)
    O     = (e^G Q) S0 + [e^(G_i - G_j) q_i.k_j]_(j <= i) delta
    S_C   = e^(G_C) S0 + (e^(G_C - G) K)^T delta
On CUDA with flash-linear-attention installed, `gated_delta_rule` uses its kernels instead, except for a backward
that FLA refuses on this machine (`fla_backward_refused`).
"""

from __future__ import annotations

import functools
import importlib
import sys
import warnings

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def _prepare(q, k, v, g, beta, l2norm: bool):
    """To [B, Hv, T, d] in the accumulation dtype, q/k normalised and grouped to the value heads."""
    acc = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    return [x.transpose(1, 2) for x in (q, k, v, g, beta)]


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    chunk_size: int = 64,
    l2norm: bool = True,
) -> tuple[Tensor, Tensor]:
    """q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv]; initial_state [B, Hv, dk, dv] or None (zeros).

    Returns (o [B, T, Hv, dv] in q's dtype, final state [B, Hv, dk, dv] in fp32, or fp64 for fp64 inputs).
    """
    out_dtype = q.dtype
    b, t = q.shape[:2]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, l2norm)
    h, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    pad = (-t) % chunk_size
    if pad:  # padded steps have g = 0 (no decay) and beta = 0 (no write): the state passes through unchanged
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // chunk_size
    q, k, v = (x.reshape(b, h, n, chunk_size, -1) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk_size), beta.reshape(b, h, n, chunk_size)

    cum = g.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")))
    a = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    # unitriangular: the solver takes the diagonal of (I + A) as ones and reads only the strict lower part
    u = torch.linalg.solve_triangular(a, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(a, (beta * cum.exp())[..., None] * k, upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * torch.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for i in range(n):
        delta = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + qk[:, :, i] @ delta)
        state = chunk_decay[:, :, i] * state + k_to_end[:, :, i].transpose(-1, -2) @ delta
    o = torch.cat(outs, dim=2)[:, :, :t]
    return o.transpose(1, 2).to(out_dtype), state


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, l2norm: bool = True) -> tuple[Tensor, Tensor]:
    """Step-by-step form of the same rule (tests; the single-token decode step). Same arguments and results."""
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, l2norm)
    b, h, t = v.shape[:3]
    state = q.new_zeros(b, h, k.shape[-1], v.shape[-1]) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for i in range(t):
        state = state * g[:, :, i].exp()[..., None, None]
        ki = k[:, :, i]
        delta = beta[:, :, i, None] * (v[:, :, i] - (state * ki[..., None]).sum(-2))
        state = state + ki[..., None] * delta[..., None, :]
        outs.append((state * q[:, :, i, :, None]).sum(-2))
    return torch.stack(outs, dim=2).transpose(1, 2).to(out_dtype), state


def split_gated_delta_rule(q, k, v, g, beta, initial_state, group, order: list[int]) -> tuple[Tensor, Tensor]:
    """The rule over a chunk whose consecutive blocks the ranks of `group` hold (this rank: q..beta of its block,
    batch first; `order`: the ranks in position order; `initial_state`: the chunk's, or None for zeros).

    The rule is linear in its state: over a block, S_end = A S_in + B, and o_t = S_in^T qa_t + ob_t. One pass
    with the values widened by dk zero columns and the initial state [I | 0] gives all of them at once: the
    first dk columns of the state evolve to A and of the outputs to qa, the others to B and ob. The ranks
    all-gather their (A, B), compose them in position order to get each block's S_in and the chunk's final
    state (the same on every rank), and correct their outputs. Twice the recurrence's work on 1/C of the tokens,
    and one all-gather of C states. Returns (o, final state) as `gated_delta_rule`."""
    b, t, hv, dv = v.shape
    dk = k.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    widened = torch.cat([v.new_zeros(b, t, hv, dk), v], dim=-1)
    eye = torch.eye(dk, dtype=acc, device=v.device).expand(b, hv, dk, dk)
    start = torch.cat([eye, eye.new_zeros(b, hv, dk, dv)], dim=-1)
    o, summary = gated_delta_rule(q, k, widened, g, beta, start)
    qa, ob = o.split([dk, dv], dim=-1)
    summaries = group.gather_blocks(summary, [b] * group.size, dim=0, autograd=True)
    state = eye.new_zeros(b, hv, dk, dv) if initial_state is None else initial_state.to(acc)
    mine = state
    for r in order:
        if r == group.rank:
            mine = state
        a, s = summaries[r].split([dk, dv], dim=-1)
        state = a @ state + s
    out = torch.einsum("bthk,bhkv->bthv", qa.to(acc), mine) + ob.to(acc)
    return out.to(q.dtype), state


def _fla_device(x: Tensor) -> bool:
    """Whether flash-linear-attention's kernels serve tensors like `x`: CUDA ones. (tests/ops/fla_interpreter.py
    points this at CPU tensors to run the kernels under Triton's interpreter through this dispatch.)"""
    return x.is_cuda


def _fla_kernel(name: str = "chunk_gated_delta_rule"):
    """flash-linear-attention's `name` from fla.ops.gated_delta_rule (chunk, or fused_recurrent_gated_delta_rule),
    None where it is not installed."""
    try:
        return getattr(importlib.import_module("fla.ops.gated_delta_rule"), name)
    except ImportError:
        return None


@functools.cache
def fla_backward_refused() -> str | None:
    """Why flash-linear-attention's gated chunk backward would raise in this process, None where it would run (or
    FLA is not installed). fla-core 0.6.0's `chunk_bwd_dqkwg` (fla/ops/common/chunk_o.py) raises on Hopper with
    Triton >= 3.4.0 and < 3.7.1, which gives wrong gradients there (FLA issue #640), unless its tilelang backend
    takes the call first. This reads FLA's own flags from that module (they describe GPU 0, for the whole process,
    as FLA decides) and asks that backend whether FLA's dispatch would take it: no GPU name list of ours."""
    try:
        chunk_o = importlib.import_module("fla.ops.common.chunk_o")
    except ImportError:
        return None
    names = ("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0", "TRITON_ABOVE_3_7_1")
    flags = [getattr(chunk_o, name, None) for name in names]
    if None in flags:  # an FLA without this check (older, or fixed): nothing refused that we know of
        return None
    hopper, triton_3_4_0, triton_3_7_1 = flags
    if not (hopper and triton_3_4_0 and not triton_3_7_1) or (why_not_tilelang := _fla_tilelang_unused()) is None:
        return None
    fla_version, triton_version = (getattr(sys.modules.get(m), "__version__", "?") for m in ("fla", "triton"))
    return (f"flash-linear-attention {fla_version} refuses its gated chunk backward on Hopper with Triton "
            f"{triton_version} (wrong gradients from Triton >= 3.4.0, < 3.7.1: FLA issue #640) without its tilelang "
            f"backend, and {why_not_tilelang}; fix: Triton >= 3.7.1, or `pip install tilelang` (with nvcc)")


def _fla_tilelang_unused() -> str | None:
    """Why FLA's dispatch would not hand `chunk_bwd_dqkwg` to its tilelang backend; None where it would."""
    try:
        backends = importlib.import_module("fla.backends")
        tilelang = importlib.import_module("fla.ops.common.backends.tilelang").CommonTileLangBackend
    except (ImportError, AttributeError):
        return "this FLA has no tilelang backend"
    if getattr(backends, "_DISPATCH_DISABLED", False):
        return "FLA_DISABLE_BACKEND_DISPATCH=1 bypasses its backends"
    if not tilelang.is_available():
        return "tilelang is not available (not installed, or no nvcc for its JIT)"
    if not tilelang().is_enabled():
        return "its tilelang backend is disabled (FLA_TILELANG=0)"
    return None


_warned_fla_backward = False


def _fla_backward_refused_here(*inputs: Tensor | None) -> bool:
    """Whether autograd will record this call and FLA would refuse its backward; the first time, a warning."""
    global _warned_fla_backward
    if not torch.is_grad_enabled() or not any(x is not None and x.requires_grad for x in inputs):
        return False
    if (reason := fla_backward_refused()) is None:
        return False
    if not _warned_fla_backward:  # once per process: every replay and prompt backward would repeat it
        _warned_fla_backward = True
        warnings.warn(f"Gated DeltaNet takes the torch chunked rule (correct, slower) wherever a gradient is wanted: "
                      f"{reason}", RuntimeWarning, stacklevel=3)
    return True


def gated_delta_rule(q, k, v, g, beta, initial_state=None) -> tuple[Tensor, Tensor]:
    """Dispatch. One token (a decode step) takes the recurrent step: the chunked form would pad it to a whole
    chunk, 64x the work and two triangular solves. On CUDA that step is flash-linear-attention's fused recurrent
    kernel when no gradient is wanted (the kernel has no backward); with autograd, or under torch.compile (which
    fuses the torch step into its own kernel instead of breaking the graph at FLA's), the torch step. Longer
    segments take flash-linear-attention's chunk kernel on CUDA when installed (the `gpu` extra), else the torch
    chunked form; also where autograd will want a backward that FLA refuses on this machine (`fla_backward_refused`:
    it would raise in the backward), which warns once. The capture's forward, without autograd, keeps FLA's."""
    if q.shape[1] == 1:
        if (_fla_device(q) and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and (fla := _fla_kernel("fused_recurrent_gated_delta_rule")) is not None):
            init = None if initial_state is None else initial_state.float()
            return fla(q, k, v, g=g.float(), beta=beta, initial_state=init, output_final_state=True,
                       use_qk_l2norm_in_kernel=True)  # grouped value heads natively, as the torch rule
        return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state)
    if _fla_device(q) and (fla := _fla_kernel()) is not None and not _fla_backward_refused_here(
            q, k, v, g, beta, initial_state):
        # q, k stay at the key heads: FLA's grouped value heads have value head j read key head j // (Hv/Hk), as
        # the torch rule, and its backward sums dq, dk back to the key heads (checked: tests/ops/fla_interpreter.py)
        init = None if initial_state is None else initial_state.float()
        return fla(q, k, v, g=g.float(), beta=beta, initial_state=init, output_final_state=True,
                   use_qk_l2norm_in_kernel=True)
    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state)
