"""infra/slurm and infra/k8s start one torchrun per node through infra/launch.sh; neither scheduler runs here, so
each launch runs with stand-ins on PATH (`srun` runs its command once per node with that node's SLURM_NODEID,
`scontrol` lists two hosts, `torchrun` records its argv), and what reaches torchrun is checked against torch's
own argument parser and the `longstraw` command line a rank parses (its config validated as on a rank)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from torch.distributed.run import get_args_parser

from tests import progress
from tests.flows.test_train_flow import config

ROOT = Path(__file__).resolve().parents[1]

SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done  # srun's options
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do SLURM_NODEID=$i "$@" || exit $?; done
"""
SCONTROL = """#!/usr/bin/env bash
[[ "$*" == "show hostnames node-[a-b]" ]] && printf 'node-a\\nnode-b\\n'
"""
SBATCH = """#!/usr/bin/env bash
printf '%s\n' "$@" > "$RECORD/sbatch"
"""
TORCHRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$RECORD/torchrun-${SLURM_NODEID:-$JOB_COMPLETION_INDEX}"
"""


@pytest.fixture
def stand_ins(tmp_path) -> dict[str, str]:
    """A checkout without a .venv (so launch.sh takes `torchrun` from PATH) and the scheduler stand-ins."""
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "infra").symlink_to(ROOT / "infra")
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("sbatch", SBATCH), ("torchrun", TORCHRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "RECORD": str(record)}


def _recorded(env: dict, node: int) -> list[str]:
    return (Path(env["RECORD"]) / f"torchrun-{node}").read_text().splitlines()


def _check_rank_command_line(argv: list[str], tmp_path: Path, monkeypatch, nodes: int, per_node: int,
                             node: int, endpoint: str) -> None:
    """torchrun accepts its part; a rank of the job (WORLD_SIZE set by torchrun) accepts the longstraw part, and
    its config holds the placement."""
    targs = get_args_parser().parse_args(argv)
    assert (targs.nnodes, targs.rdzv_backend, targs.rdzv_endpoint, targs.nproc_per_node, targs.module) == (
        str(nodes), "c10d", endpoint, str(per_node), True)
    assert targs.training_script == "flows.cli" and not targs.standalone
    from flows.cli import _config, parser

    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text(yaml.safe_dump(config(tmp_path / "run")))
    rest = [yaml_path.as_posix() if a.startswith("/runs/") or a == "x.yaml" else a for a in targs.training_script_args]
    monkeypatch.setenv("WORLD_SIZE", str(nodes * per_node))
    monkeypatch.setenv("RANK", "0")
    p = _config(parser().parse_args(rest)).pipeline
    assert (p.nproc, p.nnodes, p.node_rank, p.rdzv_endpoint) == (nodes * per_node, nodes, node, endpoint)


def test_sbatch_starts_one_torchrun_per_node_with_the_rendezvous_on_the_first(stand_ins, tmp_path, monkeypatch):
    env = {**stand_ins, "SLURM_SUBMIT_DIR": str(tmp_path / "root"), "SLURM_JOB_NODELIST": "node-[a-b]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_PER_NODE": "h100:4", "SLURM_JOB_ID": "77"}
    script = ROOT / "infra" / "slurm" / "longstraw.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    done = progress.run(["bash", str(script), "train", "--config", "x.yaml"], env=env)
    assert done.returncode == 0, done.stderr
    for node in (0, 1):
        argv = _recorded(env, node)
        assert argv[argv.index("--rdzv-id") + 1] == "77"  # one rendezvous per Slurm job
        _check_rank_command_line(argv, tmp_path, monkeypatch, 2, 4, node, "node-a:29500")


def test_k8s_indexed_job_and_headless_service_agree(stand_ins, tmp_path, monkeypatch):
    service, job = yaml.safe_load_all((ROOT / "infra" / "k8s" / "longstraw-job.yaml").read_text())
    assert (service["kind"], job["kind"]) == ("Service", "Job")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert pod["subdomain"] == service["metadata"]["name"]
    (container,) = pod["containers"]
    nodes, per_node = spec["completions"], container["resources"]["limits"]["nvidia.com/gpu"]
    endpoint = f"{job['metadata']['name']}-0.{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert container["command"] == ["bash", "-c"]
    job_name = next(e for e in container["env"] if e["name"] == "JOB_NAME")["valueFrom"]["fieldRef"]["fieldPath"]
    assert job_name == "metadata.labels['batch.kubernetes.io/job-name']"  # what Kubernetes sets on a Job's pods
    for node in (0, nodes - 1):
        env = {**stand_ins, "JOB_COMPLETION_INDEX": str(node), "JOB_NAME": job["metadata"]["name"]}
        done = progress.run(["bash", "-c", *container["args"]], cwd=tmp_path / "root", env=env)
        assert done.returncode == 0, done.stderr
        _check_rank_command_line(_recorded(env, node), tmp_path, monkeypatch, nodes, per_node, node, endpoint)


def test_launch_sh_needs_the_whole_placement():
    def launch(*args: str) -> subprocess.CompletedProcess:
        return progress.run(["bash", str(ROOT / "infra" / "launch.sh"), "--nproc", "2", *args, "--dry-run", "--",
                             "train"], cwd=ROOT)

    assert "needs --node-rank 0..1" in launch("--nnodes", "2", "--rdzv-endpoint", "h:1").stderr
    assert "needs --rdzv-endpoint HOST:PORT" in launch("--nnodes", "2", "--node-rank", "1").stderr
    assert "give --nnodes too" in launch("--node-rank", "1").stderr
    one = shlex.split(launch().stdout)
    assert "--standalone" in one and "--nnodes" not in one


def test_a_prefect_flow_run_becomes_the_sbatch_job_resuming_it(stand_ins):
    """infra/slurm/flow-run.sh, a process work pool's command: sbatch --wait of the run script, every node resuming
    the flow run the worker started (its config read from the Prefect API)."""
    script = ROOT / "infra" / "slurm" / "flow-run.sh"
    env = {**stand_ins, "PREFECT__FLOW_RUN_ID": "0f5c6a7e-0000-4000-8000-000000000001"}
    done = progress.run(["bash", str(script), "--nodes=2"], env=env)
    assert done.returncode == 0, done.stderr
    assert (Path(env["RECORD"]) / "sbatch").read_text().splitlines() == [
        "--wait", "--nodes=2", str(script.parent / "longstraw.sbatch"), "resume", env["PREFECT__FLOW_RUN_ID"]]
    env.pop("PREFECT__FLOW_RUN_ID")
    unset = progress.run(["bash", str(script)], env=env)
    assert unset.returncode != 0 and "set by the Prefect worker" in unset.stderr
