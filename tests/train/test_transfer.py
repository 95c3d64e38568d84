"""`HostMirror` (longstraw/train/transfer.py), the batched device <-> host copies of optimizer offload, on the CPU
(the same code as on CUDA, without the side stream and pinning): tensors packed into chunks, parameters across
chunk ends, skipped sources, casts, and the errors."""

from __future__ import annotations

import pytest
import torch

from longstraw.train import transfer
from longstraw.train.transfer import HostMirror

SHAPES = [(3, 5), (7,), (2, 2, 2), (1,), (11,)]  # 42 values: chunks of 4 split most tensors


def tensors(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


@pytest.mark.parametrize("chunk", [4, 7, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_by_chunks(chunk, dtype, monkeypatch):
    copies = []
    real = transfer.host_copy
    monkeypatch.setattr(transfer, "host_copy", lambda dst, src: (copies.append(src.numel()), real(dst, src)))
    params = tensors(dtype)
    mirror = HostMirror(params, chunk=chunk)
    n = sum(p.numel() for p in params)
    assert mirror.values.dtype == torch.float32 and mirror.values.numel() == n

    mirror.to_host(params, into=mirror.values)
    assert copies == [min(chunk, n - a) for a in range(0, n, chunk)]
    for view, p in zip(mirror.value_views, params):
        assert view.shape == p.shape and torch.equal(view, p.float())  # bf16 -> fp32 is exact

    grads = tensors(dtype, seed=1)
    present = mirror.to_host(iter([grads[0], None, grads[2], None, grads[4]]))  # a generator, with gaps
    assert present == [True, False, True, False, True]
    for i in (0, 2, 4):
        assert torch.equal(mirror.grad_views[i], grads[i].float())

    new = torch.randn(n, generator=torch.Generator().manual_seed(2))
    mirror.values.copy_(new)
    mirror.to_device(params)  # back into the tensors, rounded to their dtype
    assert torch.equal(torch.cat([p.flatten() for p in params]), new.to(dtype))


def test_mismatches_are_refused():
    params = tensors(torch.float32)
    mirror = HostMirror(params, chunk=4)
    with pytest.raises(ValueError, match="got 4 tensors, the mirror holds 5"):
        mirror.to_host(params[:4])
    with pytest.raises(ValueError, match="more than the 5"):
        mirror.to_host(params + params[:1])
    with pytest.raises(ValueError, match=r"tensor 1: \(8,\)"):
        mirror.to_host([params[0], torch.zeros(8), *params[2:]])
    with pytest.raises(ValueError, match="not contiguous"):
        HostMirror([torch.zeros(3, 4).t()]).to_device([torch.zeros(3, 4).t()])
    with pytest.raises(ValueError, match="one device"):
        HostMirror([torch.zeros(2), torch.zeros(2, device="meta")])
