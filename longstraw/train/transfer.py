"""Batched copies between a device's tensors and one flat fp32 host buffer (`optim.offload`): `HostMirror`.

The offloaded optimizer moves every gradient to the host and every updated weight back, each step. One copy per
parameter through pageable memory, cast on the host, would cost a driver call and a synchronisation per
parameter (hundreds per step) and keep the GPU idle meanwhile. Here the tensors are packed, in order, into
chunks of `CHUNK_ELEMENTS` fp32 values:

- device -> host (`to_host`): each tensor is cast to fp32 on the device into a staging chunk (exact from bf16),
  and each full chunk goes to the host in one non-blocking copy on a side CUDA stream, into pinned memory, while
  the compute stream packs the next chunk into the other staging buffer;
- host -> device (`to_device`): each chunk comes to the device in one non-blocking copy on the side stream while
  the compute stream unpacks the previous one into the tensors, casting on the device (fp32 -> bf16 rounds to
  nearest even there as on the host: the same bits).

Events order the two streams: the side stream copies a chunk once the compute stream has packed it (or has
unpacked what the buffer held before), and the compute stream reuses a staging buffer once the side stream is done
with it. Each call returns when the host buffer is complete (to_host) or free to change again (to_device).

On the CPU the same code runs without a stream or pinning (the "device" copies are host copies). The staging
chunks take 2 x 4 x CHUNK_ELEMENTS bytes of device memory (128 MB)."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 24  # fp32 values per staging chunk: 64 MB, a few ms over PCIe, few copies per step


def host_copy(dst: Tensor, src: Tensor) -> None:
    """One device <-> host copy of a whole chunk (non-blocking from and to pinned memory on CUDA)."""
    dst.copy_(src, non_blocking=True)


class HostMirror:
    """fp32 host copies of `tensors` (all on one device, contiguous, any float dtype) packed in one flat buffer,
    `values`, and a second one, `grads`, with views shaped like each tensor (`value_views`, `grad_views`).

    `make_values(numel)` gives the flat fp32 `values` buffer (e.g. memory-mapped files for offload nvme); by
    default host memory, pinned when the tensors are on a CUDA device."""

    def __init__(self, tensors: list[Tensor], make_values: Callable[[int], Tensor] | None = None,
                 chunk: int | None = None) -> None:
        if not tensors:
            raise ValueError("HostMirror needs at least one tensor")
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise ValueError(f"optimizer offload keeps one device's parameters per mirror; they are on "
                             f"{sorted(map(str, devices))}: put the model on one device")
        self.device = tensors[0].device
        self.cuda = self.device.type == "cuda"
        self.shapes = [t.shape for t in tensors]
        self.sizes = [t.numel() for t in tensors]
        self.total = sum(self.sizes)
        self.chunk = max(1, min(chunk or CHUNK_ELEMENTS, self.total))
        self.values = make_values(self.total) if make_values is not None else self._host(self.total)
        self.grads = self._host(self.total)
        self.value_views = self._views(self.values)
        self.grad_views = self._views(self.grads)
        # (chunk, offset in the chunk, offset in the tensor, length) of each tensor's pieces, in order
        self.pieces: list[list[tuple[int, int, int, int]]] = []
        start = 0
        for n in self.sizes:
            mine, done = [], 0
            while done < n:
                c, at = divmod(start + done, self.chunk)
                length = min(n - done, self.chunk - at)
                mine.append((c, at, done, length))
                done += length
            self.pieces.append(mine)
            start += n
        self.chunks = -(-self.total // self.chunk)
        self.stage = [torch.empty(self.chunk, dtype=torch.float32, device=self.device)
                      for _ in range(min(2, self.chunks))]
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None

    def _host(self, numel: int) -> Tensor:
        t = torch.empty(numel, dtype=torch.float32)
        if self.cuda:
            _pin(t, self)
        return t

    def _views(self, flat: Tensor) -> list[Tensor]:
        out, start = [], 0
        for shape, n in zip(self.shapes, self.sizes):
            out.append(flat[start:start + n].view(shape))
            start += n
        return out

    def _range(self, c: int) -> tuple[int, int]:
        """The flat offsets [a, b) of chunk c."""
        return c * self.chunk, min((c + 1) * self.chunk, self.total)

    # ---- the two streams ----------------------------------------------------------------------------------------
    def _event(self, stream) -> torch.cuda.Event | None:
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _compute(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def _on_side(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    @staticmethod
    def _wait(stream, event) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    def _finish(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    # ---- copies ---------------------------------------------------------------------------------------------------
    def to_host(self, sources: Iterable[Tensor | None], into: Tensor | None = None) -> list[bool]:
        """Copy `sources` (one per mirrored tensor, in order, each its shape, on the device, or None to skip) into
        the flat host buffer `into` (default `grads`), as fp32. `sources` may be a generator: it is consumed in
        order, one item per tensor, all of it, as the chunks fill. Returns which tensors had a source."""
        into = self.grads if into is None else into
        compute = self._compute()
        self._wait(compute, self._event(self.stream))  # the side stream's earlier reads of the staging buffers
        copied: list = [None] * len(self.stage)  # per staging buffer: the event of its last host copy
        dirty = [False] * self.chunks
        present = []
        for i, src in enumerate(sources):
            if i >= len(self.pieces):
                raise ValueError(f"to_host got more than the {len(self.pieces)} tensors mirrored")
            present.append(src is not None)
            if src is not None and (tuple(src.shape) != tuple(self.shapes[i]) or src.device != self.device):
                raise ValueError(f"tensor {i}: {tuple(src.shape)} on {src.device}, the mirror holds "
                                 f"{tuple(self.shapes[i])} on {self.device}")
            flat = None if src is None else src.reshape(-1)  # read only: a copy would do
            for c, at, off, n in self.pieces[i]:
                k = c % len(self.stage)
                if flat is not None:
                    if not dirty[c]:
                        self._wait(compute, copied[k])  # the buffer's previous chunk has left
                    self.stage[k][at:at + n].copy_(flat[off:off + n])  # cast to fp32 on the device
                    dirty[c] = True
                if c * self.chunk + at + n == self._range(c)[1]:  # the chunk is complete
                    copied[k] = self._send(c, k, into, compute) if dirty[c] else copied[k]
        if len(present) != len(self.pieces):
            raise ValueError(f"to_host got {len(present)} tensors, the mirror holds {len(self.pieces)}")
        self._finish()
        return present

    def _send(self, c: int, k: int, into: Tensor, compute) -> torch.cuda.Event | None:
        """Chunk c, packed in staging buffer k, to the host on the side stream once the compute stream has packed it."""
        a, b = self._range(c)
        packed = self._event(compute)
        with self._on_side():
            self._wait(self.stream, packed)
            host_copy(into[a:b], self.stage[k][:b - a])
            return self._event(self.stream)

    def to_device(self, targets: list[Tensor], source: Tensor | None = None) -> None:
        """Copy the flat host buffer `source` (default `values`) into `targets` (the mirrored tensors, or tensors
        of their shapes and device), casting to each target's dtype on the device."""
        if len(targets) != len(self.pieces):
            raise ValueError(f"to_device got {len(targets)} tensors, the mirror holds {len(self.pieces)}")
        source = self.values if source is None else source
        flats = [_flat(t) for t in targets]
        by_chunk: list[list[tuple[int, int, int, int]]] = [[] for _ in range(self.chunks)]
        for i, pieces in enumerate(self.pieces):
            for c, at, off, n in pieces:
                by_chunk[c].append((i, at, off, n))
        compute = self._compute()
        unpacked: list = [self._event(compute)] * len(self.stage)  # the compute stream's earlier uses of the buffers
        for c in range(self.chunks):
            k = c % len(self.stage)
            a, b = self._range(c)
            with self._on_side():
                self._wait(self.stream, unpacked[k])  # the buffer's previous chunk is unpacked
                host_copy(self.stage[k][:b - a], source[a:b])
                loaded = self._event(self.stream)
            self._wait(compute, loaded)
            for i, at, off, n in by_chunk[c]:
                flats[i][off:off + n].copy_(self.stage[k][at:at + n])  # cast to the target's dtype on the device
            unpacked[k] = self._event(compute)
        self._finish()


def _pin(t: Tensor, owner: object) -> None:
    """Page-lock `t`'s memory for asynchronous copies until `owner` goes. Registered in place rather than taken
    from torch's pinned allocator, which rounds each block up to a power of two (a 13.5 GB master would take 16)."""
    runtime = torch.cuda.cudart()
    ptr = t.data_ptr()
    err = runtime.cudaHostRegister(ptr, t.numel() * t.element_size(), 0)
    if int(err) != 0:  # e.g. a locked-memory limit: the copies still work, synchronously through pageable memory
        warnings.warn(f"optimizer offload: could not page-lock {t.numel() * t.element_size() / 1e9:.2f} GB of host "
                      f"memory (cudaHostRegister error {int(err)}); copies go through pageable memory, slower "
                      "(raise the locked-memory limit: ulimit -l)", stacklevel=3)
        return
    weakref.finalize(owner, runtime.cudaHostUnregister, ptr)


def _flat(t: Tensor) -> Tensor:
    """`t` as a 1-D view of its own storage (a copy would lose the writes)."""
    if not t.is_contiguous():
        raise ValueError(f"optimizer offload copies whole tensors: a parameter of shape {tuple(t.shape)} is not "
                         "contiguous; make it contiguous (e.g. param.data = param.data.contiguous())")
    return t.view(-1)
