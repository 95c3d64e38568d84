"""Which device a run computes on (`device:` in the run config) and which device a collective's tensor takes
(issue 36): one process on a GPU machine trains on the GPU (it used to take the CPU without a word), `device:`
forces one, with clear errors; NCCL is handed CUDA tensors only. CUDA is simulated by monkeypatching torch.cuda:
nothing here touches a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError

from longstraw.parallel.backend import backend_device, collective_device
from longstraw.train.device import run_device
from longstraw.train.worker import Worker
from tests.train.test_train_inputs import make_cfg


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda as on a machine with 2 GPUs, the current one GPU 0; `set_device` calls recorded."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.device(d)))
    return chosen


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_one_process_on_a_gpu_machine_takes_the_gpu(two_gpus, tmp_path):
    worker = Worker(make_cfg(tmp_path))  # nproc 1, device auto (the defaults)
    assert worker.device == torch.device("cuda", 0)
    assert two_gpus == [torch.device("cuda", 0)]  # the current device too (Triton kernels launch there)
    assert Worker(make_cfg(tmp_path, device="cuda:1")).device == torch.device("cuda", 1)
    assert Worker(make_cfg(tmp_path, device="cpu")).device == torch.device("cpu")


def test_device_settings_on_a_gpu_machine(two_gpus):
    assert run_device("auto") == run_device("cuda") == torch.device("cuda", 0)
    assert run_device("cuda:1") == torch.device("cuda", 1)
    assert run_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"2 CUDA device\(s\), cuda:0..cuda:1"):
        run_device("cuda:2")


def test_device_settings_without_a_gpu(no_gpu, tmp_path):
    assert run_device("auto") == torch.device("cpu")
    assert Worker(make_cfg(tmp_path)).device == torch.device("cpu")
    for setting in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="sees no CUDA device.*set device: cpu"):
            run_device(setting)
    with pytest.raises(ValueError, match="sees no CUDA device"):
        Worker(make_cfg(tmp_path, device="cuda"))


def test_device_setting_is_validated(tmp_path):
    for bad in ("gpu", "cuda:", "cuda:x", "CPU", "cuda:0,1"):
        with pytest.raises(ValidationError, match=r"not one of auto, cpu, cuda or cuda:N"):
            make_cfg(tmp_path, device=bad)
    with pytest.raises(ValidationError, match="pins one GPU, but the 2 ranks each take their own"):
        make_cfg(tmp_path, device="cuda:1", pipeline={"nproc": 2})
    assert make_cfg(tmp_path, device="cuda", pipeline={"nproc": 2}).device == "cuda"
    assert make_cfg(tmp_path).device == "auto"


def test_collectives_take_the_device_their_backend_reduces_on(monkeypatch):
    assert backend_device("nccl").type == "cuda"
    assert backend_device("NCCL").type == "cuda"
    assert backend_device("xccl").type == "xpu"
    for backend in ("gloo", "mpi", "ucc", "fake", "cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo"):
        assert backend_device(backend) == torch.device("cpu"), backend
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert collective_device().type == "cuda"
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert collective_device() == torch.device("cpu")


def test_offloaded_clip_norm_never_hands_nccl_a_host_tensor(monkeypatch):
    """The clip norm of host-resident (offloaded) gradients, reduced over ranks that report NCCL: it goes to the
    GPU first. Without one (here) that move fails before the collective, which never sees the host tensor."""
    from longstraw.train.config import OptimConfig
    from longstraw.train.optim import MasterAdamW
    from tests.conftest import tiny_model

    pytest.importorskip("deepspeed", reason="optim.offload needs DeepSpeed (make install)")
    opt = MasterAdamW(tiny_model(), OptimConfig(offload="cpu", zero_stage=1))
    opt.world = 2  # as on 2 ranks: the ranks' norms are summed
    grads = [torch.ones(3)]
    seen = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **kw: seen.append(t.device.type))
    if torch.cuda.is_available():
        opt.global_norm(grads)
        assert seen == ["cuda"]
    else:
        with pytest.raises((AssertionError, RuntimeError), match="CUDA"):  # torch's "not compiled with CUDA"
            opt.global_norm(grads)
        assert seen == []
