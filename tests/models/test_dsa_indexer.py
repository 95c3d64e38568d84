"""GLM-5's DSA indexer scores (models/common/mla.py `Indexer`) on CUDA's branch, run here on CPU tensors through the
bmm stand-in (tests/bmm_standin.py): bf16 products into fp32 that give transformers' fp32 formula (written here),
the selection's ties, and the same positions on the one-rank and split paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longstraw.models.common.mla import Indexer
from longstraw.ops.sparse_attention import key_block, select_topk_global
from longstraw.ops.split_sparse_attention import SplitLayout, split_select_topk
from longstraw.parallel.sequence import ONE_RANK
from tests import bmm_standin

NEG = float("-inf")
HEADS, DIM = 4, 16


def indexer_inputs(b: int, t: int, rows: int, seed: int, distinct_keys: int | None = None):
    """bf16 queries [B, T, Hi, D], fp32 head weights [B, T, Hi] and bf16 key rows [rows, D]; with `distinct_keys`,
    the rows repeat that many distinct ones (exact ties in every query's scores)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, HEADS, DIM, generator=g).bfloat16()
    w = torch.randn(b, t, HEADS, generator=g)
    keys = torch.randn(rows, DIM, generator=g).bfloat16()
    if distinct_keys is not None:
        keys = keys[torch.randint(0, distinct_keys, (rows,), generator=g)]
    return q, w, keys


def transformers_scores(q, w, keys, scale):
    """transformers' GlmMoeDsaIndexer: fp32 products of the (bf16) queries and keys, relu, weighted sum of heads."""
    per_head = torch.matmul(q.float(), keys.float().t()) * scale  # [B, T, Hi, L]
    return torch.einsum("bth,bthl->btl", w, F.relu(per_head))


def test_indexer_scores_take_bf16_products_into_fp32():
    idx = Indexer(32, 8, HEADS, DIM, 4)
    q, w, keys = indexer_inputs(2, 5, 30, seed=0)
    want = transformers_scores(q, w, keys, idx.scale)
    with bmm_standin.installed() as calls:
        shared = idx.scores((q, w), keys)  # prefix rows, shared by the batch
        own = idx.scores((q, w), keys[:5].expand(2, -1, -1))  # own rows, per batch row
    assert [c[0] for c in calls.shapes] == [torch.bfloat16] * 2
    assert shared.dtype == own.dtype == torch.float32
    assert float((shared - want).abs().max() / want.abs().max()) < 1e-6
    assert float((own - want[..., :5]).abs().max() / want.abs().max()) < 1e-6
    upcast = idx.scores((q, w), keys)  # the CPU's branch: the operands upcast
    assert float((upcast - want).abs().max() / want.abs().max()) < 1e-6


def test_index_score_blocks_count_fp32_scores_for_bf16_queries():
    """The per-head scores of a key block are fp32 whatever the queries' dtype: bf16 queries get the blocks fp32
    queries get (half of them would double the scores' bytes)."""
    q = torch.zeros(1, 1024, 32, 128)
    assert key_block(q.bfloat16(), ranks=32) == key_block(q, ranks=32) < 4096
    assert key_block(q.double(), ranks=32) == key_block(q, ranks=32) // 2


def reference_selection(scores: torch.Tensor, k: int) -> list[list[list[int]]]:
    """Per (b, t): visible positions ranked by (-score, position), the first k, ascending."""
    return [[sorted(p for _, p in sorted((-v, p) for p, v in enumerate(row) if v != NEG)[:k]) for row in rows]
            for rows in scores.tolist()]


@pytest.mark.parametrize("distinct_keys", [3, None], ids=["tied", "random"])
def test_one_rank_and_split_paths_select_the_same_positions(distinct_keys):
    """bf16 indexer on CUDA's branch, a prefix of 45 rows scored in blocks of 8 and 30 own tokens (causal): both
    paths keep the reference's top 12, the lower position first among equal scores."""
    b, t, n, k, block = 2, 30, 45, 12, 8
    idx = Indexer(32, 8, HEADS, DIM, 4)
    q, w, keys = indexer_inputs(b, t, n + t, seed=1, distinct_keys=distinct_keys)
    own_keys = keys[n:].expand(b, -1, -1).contiguous()
    causal = torch.ones(t, t, dtype=torch.bool).triu(1)
    with bmm_standin.installed() as calls:
        own_scores = idx.scores((q, w), own_keys).masked_fill(causal, NEG)
        blocks = ((torch.arange(a, min(a + block, n)), idx.scores((q, w), keys[a: min(a + block, n)]))
                  for a in range(0, n, block))
        pos, valid = select_topk_global(blocks, (torch.arange(n, n + t), own_scores), k)
        lay = SplitLayout([t], [n], n, n, torch.arange(n), False, ONE_RANK)
        sel = split_select_topk((q, w), idx.scores, keys[:n], own_keys, k, lay, block)
        full = torch.cat([idx.scores((q, w), keys[:n]), own_scores], -1)
    assert calls.shapes  # the scores took the bf16 products
    if distinct_keys is not None:  # ties everywhere, across the blocks and the own rows
        assert all(len(set(row)) < len(row) for row in full[0, -1:].tolist())
    want = reference_selection(full, k)
    for i in range(b):
        for j in range(t):
            assert pos[i, j][valid[i, j]].tolist() == want[i][j], (i, j)
            assert sorted(sel.pos[i, j][sel.keep[i, j]].tolist()) == want[i][j], (i, j)


@pytest.mark.parametrize("dtype,want", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                        (torch.float64, torch.float32)])
def test_indexer_queries_stay_half_else_fp32(dtype, want):
    """A bf16 model's indexer queries stay bf16 (the scores multiply them as they are, and ranks gather half the
    bytes); any other model's are fp32, as transformers scores."""
    idx = Indexer(32, 8, HEADS, DIM, 4).to(dtype)
    x, q_resid = torch.randn(2, 5, 32, dtype=dtype), torch.randn(2, 5, 8, dtype=dtype)
    rope = torch.ones(5, 4, dtype=dtype), torch.zeros(5, 4, dtype=dtype)
    q, w = idx.queries(x, q_resid, rope)
    assert q.dtype == want and w.dtype == torch.float32 and q.shape == (2, 5, HEADS, DIM)
