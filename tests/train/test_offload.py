"""Optimizer offload (`optim.offload: cpu | nvme`): DeepSpeed's CPU Adam stepping host-resident (or memory-mapped)
fp32 master weights and moments gives the in-device torch AdamW's weights, fp32, after 3 updates, to 1e-6; on one
process and on 2 gloo ranks (ZeRO-1 partition, ZeRO-3 FSDP shards).

DeepSpeed's CPU Adam compiles at its first use (about a minute; `make install` builds it once per venv, cached in
TORCH_EXTENSIONS_DIR), hence the generous timeouts."""

from __future__ import annotations

import os

import pytest
import torch

from longstraw.train.config import OptimConfig
from longstraw.train.offload import FileTensors, cpu_adam_class
from longstraw.train.optim import MasterAdamW, build_optimizer, optimizer_step
from tests.conftest import tiny_model
from tests.parallel.launch import run_ranks
from tests.train.optim_cases import OPTIM, UPDATES, loss_of, offload_rank, run_updates, weights

pytest.importorskip("deepspeed", reason="optim.offload needs DeepSpeed (make install)")
TOL = 1e-6


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """One process, in-device torch AdamW, fp32."""
    model = tiny_model()
    start = weights(model)
    cfg = OptimConfig(**OPTIM)
    norms = run_updates(model, build_optimizer(model, cfg), cfg)
    return {"start": start, "weights": weights(model), "norms": torch.tensor(norms, dtype=torch.float64)}


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_offload_equals_device_adamw_one_process(offload, reference, tmp_path):
    model = tiny_model()
    kw = {"nvme_path": str(tmp_path / "nvme")} if offload == "nvme" else {}
    cfg = OptimConfig(**OPTIM, offload=offload, **kw)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, MasterAdamW) and isinstance(opt.inner, cpu_adam_class())
    norms = run_updates(model, opt, cfg)
    diff = float((weights(model) - reference["weights"]).abs().max())
    print(f"offload {offload}, one process: max |w - w_device| = {diff:.3g}")
    assert diff <= TOL
    assert float((reference["weights"] - reference["start"]).abs().max()) > 1e-3  # the updates moved the weights
    assert torch.allclose(torch.tensor(norms, dtype=torch.float64), reference["norms"], rtol=1e-5)
    state = opt.state
    assert len(state) == sum(1 for _ in model.parameters())
    for p, st in state.items():  # fp32 on the host, the model's own parameters untouched in place
        assert {"master", "exp_avg", "exp_avg_sq", "step"} <= set(st) and float(st["step"]) == 3
        assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in st.values())
        assert st["master"].data_ptr() != p.data_ptr()
        assert torch.equal(st["master"], p.detach())  # fp32: the copy back is exact
    if offload == "nvme":  # master and moments are memory-mapped files under nvme_path
        files = list(opt.files.dir.iterdir())
        numel = sum(p.numel() for p in model.parameters())
        assert sum(f.stat().st_size for f in files) >= 3 * 4 * numel
        assert opt.files.dir.parent == tmp_path / "nvme"
        opt.files.close()
        assert not opt.files.dir.exists()


def test_file_tensors_are_backed_by_files_and_stale_directories_go(tmp_path):
    root = tmp_path / "nvme"
    stale = root / "longstraw-optim-rank0-pid999999999-x"  # a process that no longer runs
    stale.mkdir(parents=True)
    mine = root / f"longstraw-optim-rank0-pid{os.getpid()}-y"  # this one runs
    mine.mkdir()
    files = FileTensors(root, 0)
    t = files.new((3, 4), torch.arange(12.0).reshape(3, 4))
    t.mul_(2)
    assert not stale.exists() and mine.exists()
    raw = next(files.dir.iterdir()).read_bytes()
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32)[:12], torch.arange(12.0) * 2)


@pytest.mark.parametrize("stage", [1, 3])
def test_offload_on_two_ranks_equals_one_process_device_adamw(stage, reference, tmp_path):
    """ZeRO-1: each rank's CPU Adam steps the masters of its partition and broadcasts them; ZeRO-3: each rank's
    CPU Adam steps its FSDP shards' masters. Both: the one-process in-device weights to 1e-6."""
    ranks = run_ranks(2, offload_rank, stage, "cpu", str(tmp_path), timeout=400)
    numel = reference["weights"].numel()
    for r in ranks:
        diff = float((r["weights"] - reference["weights"]).abs().max())
        print(f"offload cpu, ZeRO-{stage} on 2 ranks: max |w - w_device| = {diff:.3g}")
        assert diff <= TOL
        assert torch.allclose(r["norms"], reference["norms"], rtol=1e-5)
        assert bool(r["on_host"])
        # the clip norm's and the finiteness check's sums at least, each on its backend's device (optim_cases)
        assert int(r["reductions"]) >= 2 * UPDATES
    held = [int(r["moments_held"]) for r in ranks]
    assert sum(held) == numel and max(held) < 0.75 * numel  # each rank keeps its share of the moments


def test_nvme_offload_on_two_ranks_zero3(reference, tmp_path):
    ranks = run_ranks(2, offload_rank, 3, "nvme", str(tmp_path), timeout=400)
    for r in ranks:
        assert float((r["weights"] - reference["weights"]).abs().max()) <= TOL


def test_offload_config_needs_nvme_path_and_refuses_a_stray_one():
    with pytest.raises(ValueError, match="needs optim.nvme_path"):
        OptimConfig(offload="nvme")
    with pytest.raises(ValueError, match="nvme_path is set but optim.offload is 'cpu'"):
        OptimConfig(offload="cpu", nvme_path="/tmp/x")
    with pytest.raises(ValueError):
        OptimConfig(offload="gpu")


def test_offload_keeps_pure_bf16_model_weights_on_an_fp32_master():
    """offload with a bf16 model and no mixed_precision: the host master is fp32 all the same (CPU Adam's
    moments are fp32), and the bf16 weights are its rounding."""
    model = tiny_model(dtype=torch.bfloat16)
    cfg = OptimConfig(**OPTIM, offload="cpu")
    opt = build_optimizer(model, cfg)
    run_updates(model, opt, cfg, 2)
    for p, st in opt.state.items():
        assert st["master"].dtype == torch.float32 and torch.equal(st["master"].to(torch.bfloat16), p.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 40_000])
def test_offload_copies_are_batched_and_equal_per_parameter_copies(dtype, chunk, monkeypatch):
    """The host copies go chunk by chunk (transfer.py): per update, one copy of the gradients to the host and one
    of the weights back per chunk of `CHUNK_ELEMENTS` values, however many parameters; and the weights are, bit for
    bit, those of the per-parameter reference written here (fp32 copies of each gradient, clip, DeepSpeed's CPU
    Adam, each master copied back into its parameter). The default chunk holds the tiny model (105,120 values)
    whole; chunks of 40,000 split it in 3, with parameters across chunk ends."""
    from longstraw.train import transfer
    from longstraw.train.offload import cpu_adam

    copies: list[int] = []
    real = transfer.host_copy
    monkeypatch.setattr(transfer, "host_copy", lambda dst, src: (copies.append(src.numel()), real(dst, src)))
    if chunk is not None:
        monkeypatch.setattr(transfer, "CHUNK_ELEMENTS", chunk)
    mixed = dtype == torch.bfloat16
    cfg = OptimConfig(**OPTIM, offload="cpu", mixed_precision=mixed)
    model, reference = tiny_model(dtype=dtype), tiny_model(dtype=dtype)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    chunks = -(-numel // (chunk or numel))
    opt = build_optimizer(model, cfg)
    assert copies == [min(chunk or numel, numel - c * (chunk or numel)) for c in range(chunks)]  # masters filled
    per_update = []
    for update in range(UPDATES):
        copies.clear()
        loss_of(model, update).backward()
        optimizer_step(model, opt, cfg, update, UPDATES)
        per_update.append(len(copies))
    assert per_update == [2 * chunks] * UPDATES  # each chunk once to the host and once back
    assert len(params) == 36 and chunks == (1 if chunk is None else 3)  # per parameter: 2 x 36 copies

    ref = list(reference.parameters())
    masters = [p.detach().float().clone() for p in ref]
    adam = cpu_adam(masters, lr=OPTIM["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=OPTIM["weight_decay"])
    for update in range(UPDATES):
        loss_of(reference, update).backward()
        for m, p in zip(masters, ref):
            m.grad, p.grad = p.grad.float(), None
        torch.nn.utils.clip_grad_norm_(masters, OPTIM["grad_clip"])
        adam.step()
        with torch.no_grad():
            for m, p in zip(masters, ref):
                p.copy_(m)
    for p, q, m in zip(params, ref, masters):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["master"], m)

