"""DSA ops: deterministic streamed top-k selection and attention over gathered latent rows.

References are written here independently: the selection is Python's `sorted` on (-score, position) over the whole
row, and the attention is a plain float64 softmax over the gathered rows of cat(prefix, own) with autograd. The CUDA
branch of the products (bf16 operands into fp32) runs on CPU tensors through tests/bmm_standin.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from longstraw.ops.sparse_attention import QUERY_BLOCK, select_topk, select_topk_global, sparse_latent_attention
from longstraw.ops.split_sparse_attention import SplitLayout, split_select_topk, split_sparse_attention
from longstraw.parallel.sequence import ONE_RANK
from tests import bmm_standin

NEG = float("-inf")


# --- select_topk ---------------------------------------------------------------------------------------------------


def tied_scores(b: int, t: int, length: int, seed: int, levels: int = 4, masked: float = 0.3) -> torch.Tensor:
    """Scores from a handful of values (so ties are everywhere, also across blocks), some entries -inf."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, levels, (b, t, length), generator=g).float() * 0.5 - 0.5
    return s.masked_fill(torch.rand(b, t, length, generator=g) < masked, NEG)


def blocks_of(scores: torch.Tensor, sizes: list[int]):
    """(positions, block) in increasing position order, block widths `sizes`."""
    assert sum(sizes) == scores.shape[-1]
    p0 = 0
    for n in sizes:
        yield torch.arange(p0, p0 + n), scores[..., p0 : p0 + n]
        p0 += n


def reference_topk(scores: torch.Tensor, k: int) -> list[list[list[int]]]:
    """Per (b, t): the visible positions ranked by (-score, position), first k, in position order."""
    out = []
    for row_b in scores.tolist():
        per_t = []
        for row in row_b:
            visible = [(-v, p) for p, v in enumerate(row) if v != NEG]
            per_t.append(sorted(p for _, p in sorted(visible)[:k]))
        out.append(per_t)
    return out


def check_against_reference(pos: torch.Tensor, valid: torch.Tensor, scores: torch.Tensor, k: int) -> None:
    b, t, length = scores.shape
    assert pos.shape == valid.shape == (b, t, min(k, length))
    assert valid.dtype == torch.bool
    want = reference_topk(scores, k)
    for i in range(b):
        for j in range(t):
            got = pos[i, j][valid[i, j]].tolist()
            assert got == want[i][j], (i, j, got, want[i][j])
            # exactly the visible winners are marked valid; the rest of the row is padding
            assert int(valid[i, j].sum()) == len(want[i][j])
            # positions ascending over the whole row and unique
            assert pos[i, j].tolist() == sorted(set(pos[i, j].tolist()))
            assert all(0 <= p < length for p in pos[i, j].tolist())


SPLITS = {
    "one": [48],
    "singles": [1] * 48,
    "uneven": [5, 1, 17, 2, 23],
    "halves": [24, 24],
    "smaller_than_k": [3, 4, 5, 36],
}


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("k", [1, 6, 13, 48, 60])
def test_select_topk_matches_reference(split, k):
    scores = tied_scores(2, 7, 48, seed=k)
    pos, valid = select_topk(blocks_of(scores, SPLITS[split]), k)
    check_against_reference(pos, valid, scores, k)


def test_select_topk_same_result_for_any_block_split_and_run():
    scores = tied_scores(2, 9, 48, seed=3, levels=2)  # mostly ties
    first = select_topk(blocks_of(scores, [48]), 10)
    for sizes in SPLITS.values():
        for _ in range(2):
            pos, valid = select_topk(blocks_of(scores, sizes), 10)
            assert torch.equal(pos, first[0]) and torch.equal(valid, first[1])


def test_select_topk_ties_go_to_lower_positions():
    """Equal scores in different blocks: lower positions win; a higher unique score still wins."""
    s = torch.zeros(1, 3, 12)
    s[0, 1, 9] = 1.0  # row 1: position 9 beats the tied rest
    s[0, 2, :4] = NEG  # row 2: the first four positions are not visible
    pos, valid = select_topk(blocks_of(s, [4, 4, 4]), 3)
    assert pos[0].tolist() == [[0, 1, 2], [0, 1, 9], [4, 5, 6]]
    assert valid.all()


def test_select_topk_causal_rows_with_few_visible():
    """A causal pattern (query t sees 0..t): early rows have fewer than k visible positions."""
    t, k = 10, 4
    g = torch.Generator().manual_seed(5)
    s = torch.randn(1, t, t, generator=g).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), NEG)
    pos, valid = select_topk(blocks_of(s, [3, 3, 4]), k)
    assert valid[0].sum(-1).tolist() == [min(i + 1, k) for i in range(t)]
    check_against_reference(pos, valid, s, k)


def test_select_topk_all_masked_row_has_no_valid_entry():
    s = torch.full((1, 2, 6), NEG)
    s[0, 1, 4] = 0.5
    pos, valid = select_topk(blocks_of(s, [2, 4]), 3)
    assert valid[0].tolist() == [[False] * 3, [False, False, True]]
    assert pos[0, 1][valid[0, 1]].tolist() == [4]


# --- sparse_latent_attention ---------------------------------------------------------------------------------------


def random_selection(b: int, t: int, n: int, k: int, seed: int, full: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query (own position n+j, causal): k distinct visible positions of 0..n+j, or all when fewer; the rest
    of the row is padding (position 0, invalid). `full`: every visible position (k = n + t)."""
    g = torch.Generator().manual_seed(seed)
    width = n + t if full else k
    pos = torch.zeros(b, t, width, dtype=torch.long)
    valid = torch.zeros(b, t, width, dtype=torch.bool)
    for i in range(b):
        for j in range(t):
            visible = n + j + 1
            m = visible if full else min(k, visible)
            chosen = torch.randperm(visible, generator=g)[:m].sort().values
            pos[i, j, :m] = chosen
            valid[i, j, :m] = True
    return pos, valid


def reference_attention(q, own, prefix, pos, valid, scale, vdim):
    """float64: gather rows of cat(prefix expanded over B, own), softmax over the valid ones, values = keys[:vdim]."""
    b = q.shape[0]
    rows = own if prefix is None else torch.cat([prefix.expand(b, -1, -1), own], dim=1)  # [B, N+T, D]
    keys = rows[torch.arange(b)[:, None, None], pos]  # [B, T, k, D]
    s = torch.einsum("bthd,btkd->bthk", q, keys) * scale
    s = s.masked_fill(~valid[:, :, None, :], NEG)
    return torch.einsum("bthk,btkd->bthd", torch.softmax(s, dim=-1), keys[..., :vdim])


def make_inputs(b, t, n, h, d, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g, dtype=torch.float64)
    own = torch.randn(b, t, d, generator=g, dtype=torch.float64)
    prefix = torch.randn(n, d, generator=g, dtype=torch.float64) if n else None
    dout = torch.randn(b, t, h, d, generator=g, dtype=torch.float64)  # cut to vdim by the caller
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return cast(q), cast(own), cast(prefix), cast(dout)


def run_op(q, own, prefix, pos, valid, scale, vdim, dout):
    """Output and gradients (q, own through autograd; prefix through the sink, which starts at zero; fp32 at least,
    as the engine's dState)."""
    q, own = q.detach().requires_grad_(), own.detach().requires_grad_()
    sink = None if prefix is None else torch.zeros_like(prefix, dtype=torch.promote_types(prefix.dtype, torch.float32))
    out = sparse_latent_attention(q, own, prefix, pos, valid, scale, vdim, sink)
    out.backward(dout)
    return out.detach(), q.grad, own.grad, sink


def run_reference(q, own, prefix, pos, valid, scale, vdim, dout):
    q = q.detach().double().requires_grad_()
    own = own.detach().double().requires_grad_()
    prefix = None if prefix is None else prefix.detach().double().requires_grad_()
    out = reference_attention(q, own, prefix, pos, valid, scale, vdim)
    out.backward(dout.double())
    return out.detach(), q.grad, own.grad, None if prefix is None else prefix.grad


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest error relative to the reference's largest magnitude."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


H, D, VDIM = 3, 20, 12  # latent rows of 20 features: 12 "c_kv" features (values) + 8 rope features


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("t,n,k", [(5, 0, 3), (70, 0, 9), (70, 30, 9), (150, 45, 17), (QUERY_BLOCK, 7, 100)])
def test_sparse_latent_attention_matches_reference(dtype, tol, b, t, n, k):
    seed = 100 * b + t + n + k
    q, own, prefix, dout = make_inputs(b, t, n, H, D, seed, dtype)
    dout = dout[..., :VDIM].contiguous()
    pos, valid = random_selection(b, t, n, k, seed)
    if n + 1 < k:  # early queries see fewer than k positions: their rows are padded
        assert (~valid).any()
    scale = D**-0.5 * 1.7
    got = run_op(q, own, prefix, pos, valid, scale, VDIM, dout)
    want = run_reference(q, own, prefix, pos, valid, scale, VDIM, dout)
    names = ("out", "dq", "down", "dprefix")
    assert got[0].dtype == dtype and got[0].shape == (b, t, H, VDIM)
    for name, g, w in zip(names, got, want):
        if w is None:
            assert g is None
            continue
        assert g.shape == w.shape, name
        assert max_rel(g, w) <= tol, (name, max_rel(g, w))
        assert float(w.abs().max()) > 0.1, name  # the gradient is not trivially zero
    # the rope features of the keys get gradient only through the scores, never as values: both paths present
    if prefix is not None:
        assert float(want[3][:, VDIM:].abs().max()) > 0


def test_prefix_gradient_accumulates_into_sink():
    """The sink is added into (exact mode sums dState over branches and chunks), not overwritten."""
    q, own, prefix, dout = make_inputs(2, 10, 8, H, D, 7, torch.float64)
    dout = dout[..., :VDIM].contiguous()
    pos, valid = random_selection(2, 10, 8, 5, 7)
    _, _, _, once = run_op(q, own, prefix, pos, valid, 0.3, VDIM, dout)
    sink = torch.full_like(prefix, 0.25)
    out = sparse_latent_attention(q.requires_grad_(), own.requires_grad_(), prefix, pos, valid, 0.3, VDIM, sink)
    out.backward(dout)
    out = sparse_latent_attention(q, own, prefix, pos, valid, 0.3, VDIM, sink)
    out.backward(dout)
    assert max_rel(sink - 0.25, 2 * once) <= 1e-12


def dense_causal_reference(q, own, prefix, scale, vdim):
    """Standard causal softmax attention of each row over prefix ++ own[:t+1] (one shared key/value head)."""
    b, t = own.shape[:2]
    n = 0 if prefix is None else prefix.shape[0]
    keys = own if prefix is None else torch.cat([prefix.expand(b, -1, -1), own], dim=1)
    s = torch.einsum("bthd,bld->bthl", q, keys) * scale
    future = torch.arange(n + t)[None, :] > (n + torch.arange(t))[:, None]  # [T, N+T]
    s = s.masked_fill(future[None, :, None, :], NEG)
    return torch.einsum("bthl,bld->bthd", torch.softmax(s, -1), keys[..., :vdim])


@pytest.mark.parametrize("n", [0, 23])
def test_selecting_every_position_is_dense_causal_attention(n):
    b, t = 2, 80
    q, own, prefix, dout = make_inputs(b, t, n, H, D, 11 + n, torch.float64)
    dout = dout[..., :VDIM].contiguous()
    pos, valid = random_selection(b, t, n, 0, 0, full=True)
    got = run_op(q, own, prefix, pos, valid, 0.2, VDIM, dout)
    qr, ownr = q.clone().requires_grad_(), own.clone().requires_grad_()
    pr = None if prefix is None else prefix.clone().requires_grad_()
    want = dense_causal_reference(qr, ownr, pr, 0.2, VDIM)
    want.backward(dout)
    assert max_rel(got[0], want) <= 1e-12
    assert max_rel(got[1], qr.grad) <= 1e-12
    assert max_rel(got[2], ownr.grad) <= 1e-12
    if n:
        assert max_rel(got[3], pr.grad) <= 1e-12


def test_positions_order_within_row_does_not_matter():
    """Attention over a set of rows: permuting a row's selected positions (with their valid flags) changes nothing."""
    b, t, n, k = 2, 12, 6, 5
    q, own, prefix, dout = make_inputs(b, t, n, H, D, 13, torch.float64)
    dout = dout[..., :VDIM].contiguous()
    pos, valid = random_selection(b, t, n, k, 13)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(1))
    a = run_op(q, own, prefix, pos, valid, 0.4, VDIM, dout)
    c = run_op(q, own, prefix, pos[..., perm], valid[..., perm], 0.4, VDIM, dout)
    for x, y in zip(a, c):
        assert max_rel(x, y) <= 1e-12
    assert math.isfinite(float(a[0].abs().sum()))


# --- the split path on one rank, host reads, and the CUDA branch's products ----------------------------------------
# ops/split_sparse_attention.py runs in one process over the group of one rank (its collectives are the identity), so
# its selection and attention are checked here against the one-rank path and the references above; several ranks:
# tests/parallel/test_sequence_parallel.py (glm_moe_dsa).

aten = torch.ops.aten


class HostReads(TorchDispatchMode):
    """Counts what makes the host read tensor values (on a GPU, each one waits for the stream): the ops that return
    host values or data-dependent shapes (`item`, `int()`, `bool()` reach `_local_scalar_dense`; `nonzero`, boolean
    masks), and `Tensor.tolist`, which reads memory directly, past the dispatcher."""

    READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.equal.default,
             aten.is_nonzero.default, aten._unique2.default, aten.unique_consecutive.default}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counter, tolist = self, self._tolist

        def counted_tolist(t):
            counter.count += 1
            return tolist(t)

        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        boolean_index = func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        self.count += func in self.READS or boolean_index
        return func(*args, **(kwargs or {}))


class Products(TorchDispatchMode):
    """The matrix products run, by kind: `half` (half operands into fp32, `aten::bmm.dtype`) and `wide` (fp32 or
    fp64 operands: what upcasting half inputs leads to)."""

    WIDE = {aten.bmm.default, aten.mm.default, aten.addmm.default, aten.baddbmm.default, aten.dot.default,
            aten.mv.default, aten.addbmm.default}

    def __init__(self) -> None:
        super().__init__()
        self.half = self.wide = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.half += func is aten.bmm.dtype
        self.wide += func in self.WIDE
        return func(*args, **(kwargs or {}))


def integer_scores(qs, keys):
    """Index scores q . k of small integer vectors (exact in fp32: ties wherever two products agree)."""
    (q,) = qs
    k = keys if keys.dim() == 3 else keys.expand(q.shape[0], -1, -1)
    return torch.einsum("bte,ble->btl", q, k)


def index_case(b, t, n, seed):
    """Indexer queries [B, T, 3] and keys [N + T, 3] of small integers (prefix rows, then the own tokens')."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, 2, (b, t, 3), generator=g).float(), torch.randint(-1, 2, (n + t, 3), generator=g).float()


def one_rank_selection(iq, ik, n, k, key_block=16):
    """The one-rank path's selection (prefix in blocks of `key_block`), and the full rows' scores [B, T, N + T]."""
    t = iq.shape[1]
    own_scores = integer_scores((iq,), ik[n:]).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), NEG)
    blocks = ((torch.arange(a, min(a + key_block, n)), integer_scores((iq,), ik[a: min(a + key_block, n)]))
              for a in range(0, n, key_block))
    full = torch.cat([integer_scores((iq,), ik[:n]), own_scores], -1)
    return select_topk_global(blocks, (torch.arange(n, n + t), own_scores), k), full


def split_layout(t, n):
    """A split segment over the group of one rank: queries and own rows at n.., a prefix of n rows held here."""
    return SplitLayout([t], [n], n, n, torch.arange(n), False, ONE_RANK)


def split_selection(iq, ik, n, k, key_block=16):
    b, t = iq.shape[:2]
    own_k = ik[n:].expand(b, -1, -1).contiguous()
    return split_select_topk((iq,), integer_scores, ik[:n] if n else None, own_k, k, split_layout(t, n), key_block)


def run_split(q, own, prefix, sel, lay, scale, vdim, dout):
    q, own = q.detach().requires_grad_(), own.detach().requires_grad_()
    sink = None if prefix is None else torch.zeros_like(prefix, dtype=torch.promote_types(prefix.dtype, torch.float32))
    out = split_sparse_attention(q, own, prefix, sel, scale, vdim, sink, lay)
    out.backward(dout)
    return out.detach(), q.grad, own.grad, sink


@pytest.mark.parametrize("t,n,k", [(70, 0, 9), (150, 45, 17), (40, 30, 100)])
def test_split_path_on_one_rank_selects_and_attends_as_the_one_rank_path(t, n, k):
    b = 2
    iq, ik = index_case(b, t, n, seed=t + n)
    (pos, valid), full = one_rank_selection(iq, ik, n, k)
    sel, lay = split_selection(iq, ik, n, k), split_layout(t, n)
    want_sel = reference_topk(full, k)
    for i in range(b):
        for j in range(t):
            assert pos[i, j][valid[i, j]].tolist() == want_sel[i][j]
            assert sorted(sel.pos[i, j][sel.keep[i, j]].tolist()) == want_sel[i][j]
    assert sel.held == tuple(sel.keep.sum(-1).amax(0).tolist())
    q, own, prefix, dout = make_inputs(b, t, n, H, D, t + n, torch.float64)
    dout = dout[..., :VDIM].contiguous()
    got = run_split(q, own, prefix, sel, lay, 0.3, VDIM, dout)
    want = run_reference(q, own, prefix, pos, valid, 0.3, VDIM, dout)
    for name, g, w in zip(("out", "dq", "down", "dprefix"), got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            assert max_rel(g, w) <= 1e-12, name


def test_no_host_read_per_query_block():
    """Host reads per call, at one query block and at five: the split path reads the selection's widths once when
    it selects, its attention (forward and backward) and the one-rank path never."""
    counts = {}
    for t in (QUERY_BLOCK, 5 * QUERY_BLOCK):
        n, k, b = 40, 12, 1
        q, own, prefix, dout = make_inputs(b, t, n, H, D, 1, torch.float32)
        dout = dout[..., :VDIM].contiguous()
        iq, ik = index_case(b, t, n, seed=2)
        with HostReads() as one_select:
            (pos, valid), _ = one_rank_selection(iq, ik, n, k)
        with HostReads() as split_select:
            sel = split_selection(iq, ik, n, k)
        lay = split_layout(t, n)
        q1, own1 = q.clone().requires_grad_(), own.clone().requires_grad_()
        sink = torch.zeros_like(prefix)
        with HostReads() as fwd:
            out = split_sparse_attention(q1, own1, prefix, sel, 0.3, VDIM, sink, lay)
        with HostReads() as bwd:
            out.backward(dout)
        q2, own2 = q.clone().requires_grad_(), own.clone().requires_grad_()
        with HostReads() as one_fwd:
            out = sparse_latent_attention(q2, own2, prefix, pos, valid, 0.3, VDIM, sink)
        with HostReads() as one_bwd:
            out.backward(dout)
        counts[t] = dict(one_select=one_select.count, split_select=split_select.count, split_forward=fwd.count,
                         split_backward=bwd.count, one_forward=one_fwd.count, one_backward=one_bwd.count)
    assert counts[QUERY_BLOCK] == counts[5 * QUERY_BLOCK] == dict(
        one_select=0, split_select=1, split_forward=0, split_backward=0, one_forward=0, one_backward=0), counts


def _bf16_case(b: int, t: int, n: int, k: int, seed: int) -> dict:
    """bf16 attention inputs with their one-rank selection (pos, valid) and split selection (sel, lay)."""
    iq, ik = index_case(b, t, n, seed=seed)
    (pos, valid), _ = one_rank_selection(iq, ik, n, k)
    q, own, prefix, dout = make_inputs(b, t, n, H, D, seed, torch.bfloat16)
    return dict(q=q, own=own, prefix=prefix, dout=dout[..., :VDIM].contiguous(), pos=pos, valid=valid,
                sel=split_selection(iq, ik, n, k), lay=split_layout(t, n))


def _run_path(path: str, c: dict):
    if path == "split":
        return run_split(c["q"], c["own"], c["prefix"], c["sel"], c["lay"], 0.4, VDIM, c["dout"])
    return run_op(c["q"], c["own"], c["prefix"], c["pos"], c["valid"], 0.4, VDIM, c["dout"])


@pytest.mark.parametrize("path", ["one_rank", "split"])
def test_cuda_branch_multiplies_bf16_into_fp32(path):
    """On CUDA (its branch run here through the bmm stand-in) every product of the attention's forward and backward
    takes bf16 operands into fp32, none upcasts them; results as accurate as bf16 rounding allows."""
    t = 150
    case = _bf16_case(2, t, 45, 17, seed=4)
    with bmm_standin.installed() as calls, Products() as products:
        got = _run_path(path, case)
    q, own, prefix, dout, pos, valid = (case[x] for x in ("q", "own", "prefix", "dout", "pos", "valid"))
    # per query block: scores and P @ V (the one-rank path: one P @ V per part, prefix and own rows); backward:
    # scores, dP, dQ (the one-rank path: per part), dK and dV
    per_block = 2 + 5 if path == "split" else 3 + 6
    assert products.wide == 0 and products.half == len(calls.shapes) == per_block * -(-t // QUERY_BLOCK)
    want = run_reference(q, own, prefix, pos, valid, 0.4, VDIM, dout)
    for name, g, w in zip(("out", "dq", "down", "dprefix"), got, want):
        # bf16 inputs and outputs, P and dS rounded to bf16 before their products (as flash attention's)
        assert max_rel(g, w) <= 1.5e-2, (name, max_rel(g, w))


@pytest.mark.parametrize("path", ["one_rank", "split"])
def test_cpu_bf16_is_the_fp32_computation(path):
    """On the CPU (no bf16 products into fp32) bf16 inputs are upcast, so the numerics are those of the fp32
    products: the one-rank path returns the fp32 computation on the same values, rounded as the op returns them;
    the split path too but for its partial outputs, which travel between ranks in the model's dtype."""
    case = _bf16_case(2, 100, 30, 11, seed=5)
    with Products() as products:
        got = _run_path(path, case)
    q, own, prefix, dout, pos, valid = (case[x] for x in ("q", "own", "prefix", "dout", "pos", "valid"))
    assert products.half == 0 and products.wide > 0
    names = ("out", "dq", "down", "dprefix")
    if path == "one_rank":
        wide = run_op(q.float(), own.float(), prefix.float(), pos, valid, 0.4, VDIM, dout.float())
        for name, g, w in zip(names, got, wide):
            assert torch.equal(g, w.to(g.dtype)), name
    want = run_reference(q, own, prefix, pos, valid, 0.4, VDIM, dout)
    for name, g, w in zip(names, got, want):
        assert max_rel(g, w) <= 1e-2, (name, max_rel(g, w))
