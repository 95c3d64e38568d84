"""A CPU stand-in, for the tests only, of the two CUDA attention kernels ops/attention.py calls: FlashAttention-2
(`aten::_scaled_dot_product_flash_attention` and its backward) and the memory-efficient kernel
(`aten::_scaled_dot_product_efficient_attention` and its backward). Those ops have no CPU kernel; `installed()`
registers these under the CPU dispatch key, so the library's `cuda_flash` / `cuda_efficient` branches run unchanged
on CPU tensors. Nothing in longstraw imports this module.

Each op computes from a plain softmax formula in fp64, models the kernel's roundings and returns what the kernel
returns (dtypes, layouts, padding). It asserts the kernel's contracts on its inputs, each stated below with its
source in PyTorch (aten/src/ATen/native/transformers/cuda/: flash_attn/flash_api.cpp, attention.cu,
attention_backward.cu, sdp_utils.cpp, mem_eff_attention/kernel_forward.h, kernel_backward.h) or FlashAttention-2
(flash_fwd_kernel.h, flash_bwd_kernel.h, softmax.h, mask.h), so a caller that breaks one fails loudly here instead
of reading the wrong memory on a GPU.

FlashAttention-2 (flash_api.cpp mha_fwd / mha_bwd, reached through attention.cu and attention_backward.cu, which
view [B, H, S, d] as [B, S, H, d]):
- dtype fp16 or bf16, the same for q, k, v, and (backward) out and dout ("FlashAttention only support fp16 and bf16
  data type", "query and out must have the same dtype");
- q, k, v with last-dim stride 1 ("Input tensor must have contiguous last dimension"); out and dout are made
  contiguous by `_flash_attention_backward`, so they may have any layout;
- head dim a multiple of 8 and at most 256, v's the same as q's (CHECK_SHAPE(v, ..., head_size_og));
- grouped heads: H a multiple of Hkv ("Number of heads in key/value must divide number of heads in query"); the
  backward computes dK/dV per query head in the input dtype (dk_expanded) and sums each group with at::sum_out;
- causal masks align to the bottom right when Sq != Sk (mask.h: a row sees keys up to row + Sk - Sq);
- the log-sum-exp is fp32 [B, H, Sq], contiguous, natural log (softmax.h normalize_softmax_lse: max * scale +
  log(sum)); a row that sees no key has lse +inf and output 0 (softmax.h; mha_fwd fills +inf when Sk == 0);
  the backward reads it by data pointer at (b * H + h) * Sq + row (flash_bwd_kernel.h), so it must be contiguous;
- outputs: out like q (empty_like), in q's dtype, from fp32 accumulators; P is rounded to the input dtype before
  P @ V (flash_fwd_kernel.h "Convert acc_s from fp32 to fp16/bf16"), and in the backward P and dS before their
  products (flash_bwd_kernel.h); dq, dk, dv like q, k, v.
Memory-efficient kernel (attention.cu `_scaled_dot_product_efficient_attention_cuda` ->
`_efficient_attention_forward`; attention_backward.cu `_efficient_attention_backward`):
- q, k, v of one dtype (fp32, fp16 or bf16); last-dim stride 1 (CHECK_NOSPARSE_LASTCONTIGUOUS_CUDA);
- as many key heads as query heads (TORCH_CHECK(query.size(2) == key.size(2)); sdp_utils.cpp lists
  check_batch_size_and_num_heads_dense<false /*supports_grouped_query_attention*/> for this backend);
- q and k of one head dim (v's may differ);
- causal masks align to the top left (CustomMaskType::CausalFromTopLeft): row i sees keys 0..i;
- the log-sum-exp is fp32 [B, H, ceil(Sq / 32) * 32], rows past Sq +inf (kernel_forward.h: "To make the backward
  easier, we pad logsumexp with `inf`"); the backward reads it at the strides of its first two dims with unit
  stride over rows, whole 32-row blocks, so it needs the padding;
- the output is allocated [B, Sq, H, Dv] and returned transposed; the half-precision backward kernels read the
  output's rows at stride H * Dv (kernel_backward.h o_strideM()), so `out` must keep that layout there (fp32
  computes its row sums in ATen, from any layout);
- gradients allocated [B, S, H, d] and returned transposed, in the input dtype.
Not modelled, and asserted absent: dropout, attention bias, debug masks, and the memory-efficient kernel over no
keys (the source does not pin down its output there; the library does not call a kernel with no keys).

`Recorder` notes every call's kernel and the library line that reached it (`call_sites` lists those lines
statically), so a test can assert that every `cuda_*` code path ran.
"""

from __future__ import annotations

import ast
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType

import torch

Tensor = torch.Tensor
HALF = (torch.float16, torch.bfloat16)
LSE_ALIGN = 32  # kernel_forward.h kAlignLSE
# the library functions that only pass a part on to a kernel: a call site is the first frame outside them
PLUMBING = frozenset({"part_forward", "part_backward", "_forward", "_efficient_forward", "_efficient_backward",
                      "unmasked_part_backward", "prefix_part_backward", "_prefix_part"})


class ContractError(AssertionError):
    """A caller broke a CUDA attention kernel's contract."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise ContractError(what)


@dataclass
class Recorder:
    """Each kernel call's kernel and the library line that made it (module, function, line of the first frame
    outside PLUMBING), and the head counts each call got."""

    calls: set[tuple[str, str, str, int]] = field(default_factory=set)
    heads: list[tuple[str, bool, int, int]] = field(default_factory=list)  # (kernel, causal, query heads, key heads)

    def note(self, kernel: str, query: Tensor, key: Tensor, causal: bool) -> None:
        self.heads.append((kernel, bool(causal), query.shape[1], key.shape[1]))
        frame = sys._getframe(2)
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if module.startswith("longstraw.") and frame.f_code.co_name not in PLUMBING:
                name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
                self.calls.add((kernel, module, name, frame.f_lineno))
                return
            frame = frame.f_back
        self.calls.add((kernel, "<outside longstraw>", "", 0))

    def paths(self, sites: list[tuple[str, str, int, int]]) -> set[tuple[str, str, str, int]]:
        """The (kernel, module, function, first line) of each of `sites` (from `call_sites`) that ran."""
        ran = set()
        for kernel, module, name, line in self.calls:
            for s_module, s_name, first, last in sites:
                if (module, name) == (s_module, s_name) and first <= line <= last:
                    ran.add((kernel, module, name, first))
        return ran


def call_sites(module: ModuleType) -> list[tuple[str, str, int, int]]:
    """(module, function qualname, first line, last line) of every call in `module` that hands an attention part to
    a kernel (a call of a PLUMBING function from outside them)."""
    tree = ast.parse(inspect.getsource(module))
    sites = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                visit(child, [*scope, child.name])
                continue
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id in PLUMBING
                    and scope and scope[-1] not in PLUMBING):
                sites.append((module.__name__, ".".join(scope), child.lineno, child.end_lineno))
            visit(child, scope)

    visit(tree, [])
    return sites


# ---- the formula ----------------------------------------------------------------------------------------------


def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x rounded to `dtype` where the kernel rounds (half types), back in fp64."""
    return x.to(dtype).double() if dtype in HALF else x


def _scores(q: Tensor, k: Tensor, scale: float, causal: str | None) -> Tensor:
    """fp64 scores [B, H, Sq, Sk] of q over k (k with q's head count), -inf where the mask hides a key."""
    s = q.double() @ k.double().transpose(-1, -2) * scale
    if causal is not None:
        sq, sk = s.shape[-2:]
        shift = sk - sq if causal == "bottom_right" else 0
        hidden = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + shift
        s = s.masked_fill(hidden, float("-inf"))
    return s


def _groups(x: Tensor, h: int) -> Tensor:
    return x.repeat_interleave(h // x.shape[1], dim=1)


def _attend(q, k, v, scale, causal, dtype):
    """(out fp64, lse fp64 with +inf where a row sees no key) of the plain softmax formula, P rounded to `dtype`
    before its product with V."""
    h = q.shape[1]
    if k.shape[2] == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64), \
            torch.full(q.shape[:-1], float("inf"), dtype=torch.float64)
    s = _scores(q, _groups(k, h), scale, causal)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    den = e.sum(-1)
    out = (_as(e, dtype) @ _groups(v, h).double()) / den.clamp_min(1e-300)[..., None]
    empty = den == 0
    lse = torch.where(empty, torch.full_like(den, float("inf")), m[..., 0] + den.log())
    return out.masked_fill(empty[..., None], 0.0), lse


def _gradients(do, q, k, v, o, lse, scale, causal, dtype):
    """fp64 (dq, dk, dv per query head) of the formula, given the merged output and log-sum-exp; P and dS rounded
    to `dtype` before their products, as the kernels' half-precision matrix products take them."""
    h = q.shape[1]
    ke, ve = _groups(k, h).double(), _groups(v, h).double()
    p = torch.exp(_scores(q, ke, scale, causal) - lse.double()[..., None])  # 0 where lse is +inf
    do64 = do.double()
    dv = _as(p, dtype).transpose(-1, -2) @ do64
    delta = (do64 * o.double()).sum(-1, keepdim=True)
    ds = _as(p * (do64 @ ve.transpose(-1, -2) - delta), dtype)
    return ds @ ke * scale, ds.transpose(-1, -2) @ q.double() * scale, dv


def _fold_groups(dx: Tensor, hkv: int, dtype: torch.dtype) -> Tensor:
    """Per-query-head gradients [B, H, S, d] summed over each key head's group: rounded to the dtype per head (the
    kernel's dk_expanded), then summed and rounded again (at::sum_out)."""
    per_head = dx.to(dtype)
    if per_head.shape[1] == hkv:
        return per_head
    return per_head.unflatten(1, (hkv, -1)).sum(2, dtype=torch.float32).to(dtype)


def _like(x: Tensor, value: Tensor) -> Tensor:
    """`value` in a tensor laid out like `x` (the kernels' empty_like) and of its dtype."""
    return torch.empty_like(x).copy_(value)


def _seq_major(value: Tensor, dtype: torch.dtype) -> Tensor:
    """`value` [B, H, S, d] in a [B, S, H, d] allocation, seen as [B, H, S, d] (the memory-efficient kernel's)."""
    b, h, s, d = value.shape
    return torch.empty(b, s, h, d, dtype=dtype).transpose(1, 2).copy_(value)


# ---- the contracts ---------------------------------------------------------------------------------------------


def _common(name: str, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> None:
    _require(q.dim() == k.dim() == v.dim() == 4, f"{name}: q, k, v are [B, H, S, d]")
    _require(q.shape[0] == k.shape[0] == v.shape[0], f"{name}: q, k, v of one batch size")
    _require(k.shape[2] == v.shape[2], f"{name}: k and v of one length")
    _require(k.shape[1] == v.shape[1], f"{name}: k and v of one head count")
    _require(q.shape[-1] == k.shape[-1], f"{name}: q and k of one head dim")
    _require(q.dtype == k.dtype == v.dtype, f"{name}: q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        _require(t.stride(-1) == 1, f"{name}: {n} must have a contiguous last dimension (stride {t.stride()})")
    _require(dropout_p == 0.0, f"{name}: dropout is not modelled (the library never drops)")


def _flash_inputs(name: str, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> None:
    _common(name, q, k, v, dropout_p)
    _require(q.dtype in HALF, f"{name}: FlashAttention only supports fp16 and bf16, got {q.dtype}")
    d = q.shape[-1]
    _require(d % 8 == 0 and d <= 256, f"{name}: head dim must be a multiple of 8 and at most 256, got {d}")
    _require(v.shape[-1] == d, f"{name}: v's head dim must be q's ({v.shape[-1]} != {d})")
    _require(q.shape[1] % k.shape[1] == 0, f"{name}: H ({q.shape[1]}) must be a multiple of Hkv ({k.shape[1]})")


def _efficient_inputs(name: str, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> None:
    _common(name, q, k, v, dropout_p)
    _require(q.dtype in (torch.float32, *HALF), f"{name}: fp32, fp16 or bf16 only, got {q.dtype}")
    _require(q.shape[1] == k.shape[1], f"{name}: as many key heads as query heads ({k.shape[1]} != {q.shape[1]}); "
             "this kernel takes no grouped heads")
    _require(k.shape[2] > 0, f"{name}: no keys (the kernel's output there is not pinned down)")


def _lse_rows(sq: int) -> int:
    return -(-sq // LSE_ALIGN) * LSE_ALIGN


# ---- the ops -------------------------------------------------------------------------------------------------


def _standin(recorder: Recorder):
    def flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        recorder.note("cuda_flash", query, key, is_causal)
        name = "flash forward"
        _flash_inputs(name, query, key, value, dropout_p)
        _require(not return_debug_mask, f"{name}: debug masks are not modelled")
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        out, lse = _attend(query, key, value, scale, "bottom_right" if is_causal else None, query.dtype)
        sq, sk = query.shape[2], key.shape[2]
        seed = torch.zeros(2, dtype=torch.uint64)  # the kernel's rng state, unused without dropout
        return (_like(query, out), lse.float().contiguous(), None, None, sq, sk, seed,
                torch.zeros((), dtype=torch.uint64), torch.empty(0, dtype=query.dtype))

    def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                       is_causal, philox_seed, philox_offset, *, scale=None):
        recorder.note("cuda_flash", query, key, is_causal)
        name = "flash backward"
        _flash_inputs(name, query, key, value, dropout_p)
        b, h, sq, d = query.shape
        _require(out.dtype == grad_out.dtype == query.dtype, f"{name}: out and grad_out in q's dtype {query.dtype}, "
                 f"got {out.dtype} and {grad_out.dtype}")
        _require(out.shape == grad_out.shape == query.shape, f"{name}: out and grad_out shaped like q")
        _require(logsumexp.dtype == torch.float32, f"{name}: the log-sum-exp is fp32, got {logsumexp.dtype}")
        _require(tuple(logsumexp.shape) == (b, h, sq), f"{name}: the log-sum-exp is [B, H, Sq] = {(b, h, sq)}, got "
                 f"{tuple(logsumexp.shape)}")
        _require(logsumexp.is_contiguous(), f"{name}: the log-sum-exp is read by pointer and must be contiguous "
                 f"(strides {logsumexp.stride()})")
        _require(cum_seq_q is None and cum_seq_k is None, f"{name}: the dense kernel's cumulative lengths are "
                 "undefined (the forward returns none)")
        # not checked by the dense kernel; a mismatch means one part's forward state went to another's backward
        _require((max_q, max_k) == (sq, key.shape[2]), f"{name}: max_q, max_k ({max_q}, {max_k}) are not this "
                 f"call's lengths ({sq}, {key.shape[2]})")
        scale = d**-0.5 if scale is None else scale
        dq, dk, dv = _gradients(grad_out, query, key, value, out, logsumexp, scale,
                                "bottom_right" if is_causal else None, query.dtype)
        return (_like(query, dq), _like(key, _fold_groups(dk, key.shape[1], key.dtype)),
                _like(value, _fold_groups(dv, key.shape[1], value.dtype)))

    def efficient_forward(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *,
                          scale=None):
        recorder.note("cuda_efficient", query, key, is_causal)
        name = "memory-efficient forward"
        _efficient_inputs(name, query, key, value, dropout_p)
        _require(attn_bias is None, f"{name}: attention bias is not modelled")
        _require(compute_log_sumexp, f"{name}: without compute_log_sumexp the log-sum-exp has no rows")
        b, h, sq, d = query.shape
        scale = d**-0.5 if scale is None else scale
        out, lse = _attend(query, key, value, scale, "top_left" if is_causal else None, query.dtype)
        padded = torch.full((b, h, _lse_rows(sq)), float("inf"), dtype=torch.float32)
        padded[..., :sq] = lse.float()
        zero = torch.zeros((), dtype=torch.int64)
        return _seq_major(out, query.dtype), padded, zero, zero.clone()

    def efficient_backward(grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                           dropout_p, grad_input_mask, is_causal=False, *, scale=None):
        recorder.note("cuda_efficient", query, key, is_causal)
        name = "memory-efficient backward"
        _efficient_inputs(name, query, key, value, dropout_p)
        _require(attn_bias is None and list(grad_input_mask) == [True, True, True, False],
                 f"{name}: attention bias is not modelled (mask {grad_input_mask})")
        b, h, sq, d = query.shape
        _require(out.dtype == grad_out.dtype == query.dtype, f"{name}: out and grad_out in q's dtype")
        _require(out.shape[:3] == grad_out.shape[:3] == query.shape[:3], f"{name}: out and grad_out have q's rows")
        if query.dtype in HALF:
            _require(out.stride(2) == h * out.shape[-1] and out.stride(-1) == 1,
                     f"{name}: the half kernels read out's rows at stride H * Dv = {h * out.shape[-1]} (the "
                     f"forward's [B, Sq, H, Dv] layout), got strides {out.stride()}")
        rows = _lse_rows(sq)
        _require(logsumexp.dtype == torch.float32 and logsumexp.dim() == 3, f"{name}: the log-sum-exp is fp32 "
                 f"[B, H, rows], got {logsumexp.dtype} {tuple(logsumexp.shape)}")
        _require(tuple(logsumexp.shape[:2]) == (b, h) and logsumexp.shape[2] >= rows, f"{name}: the log-sum-exp is "
                 f"[B, H, >= {rows}] (Sq padded to a multiple of {LSE_ALIGN}), got {tuple(logsumexp.shape)}")
        _require(logsumexp.stride(-1) == 1, f"{name}: the log-sum-exp's rows must have unit stride")
        _require(bool(torch.isposinf(logsumexp[..., sq:rows]).all()), f"{name}: the log-sum-exp's padding rows "
                 "must be +inf, as the forward writes them (the kernel reads whole 32-row blocks)")
        scale = d**-0.5 if scale is None else scale
        dq, dk, dv = _gradients(grad_out, query, key, value, out, logsumexp[..., :sq], scale,
                                "top_left" if is_causal else None, query.dtype)
        return _seq_major(dq, query.dtype), _seq_major(dk, key.dtype), _seq_major(dv, value.dtype), None

    return {
        "_scaled_dot_product_flash_attention": flash_forward,
        "_scaled_dot_product_flash_attention_backward": flash_backward,
        "_scaled_dot_product_efficient_attention": efficient_forward,
        "_scaled_dot_product_efficient_attention_backward": efficient_backward,
    }


@contextmanager
def installed() -> Iterator[Recorder]:
    """The stand-in registered as the four ops' CPU kernels while the context lasts; yields its recorder."""
    recorder = Recorder()
    lib = torch.library.Library("aten", "IMPL")
    try:
        for op, fn in _standin(recorder).items():
            lib.impl(op, fn, "CPU")
        yield recorder
    finally:
        lib._destroy()


def as_on_cuda(choose: Callable[[str, torch.dtype, int, int], str]) -> Callable[[str, torch.dtype, int, int], str]:
    """`choose` (ops/attention.py's choose_kernel) deciding for CPU tensors as it decides for CUDA ones."""

    def choose_on_cuda(device_type: str, dtype: torch.dtype, qk_dim: int, v_dim: int) -> str:
        return choose("cuda" if device_type == "cpu" else device_type, dtype, qk_dim, v_dim)

    return choose_on_cuda
