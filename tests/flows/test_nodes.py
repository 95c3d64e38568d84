"""One run on two "nodes" of this machine: two `longstraw train --nnodes 2 --node-rank 0/1 --rdzv-endpoint
127.0.0.1:PORT` launches, each starting one rank under torchrun, meet at torchrun's c10d rendezvous. Two steps
of the tiny model in exact mode give the weights of the same run on one node (bitwise: the same two ranks
compute the same sums). Losing the node of rank 1 in replay (its launcher and its rank killed with kill -9) fails
the run on the other node within the collective timeout, naming the lost rank, its node and host; `longstraw
resume` on one node then ends with the weights of the uninterrupted run. Gloo uses the loopback interface."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.flows.test_ranks import ROOT, TIMEOUT, _cli, _env, _final, _yaml

LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo"}
COLLECTIVE_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes(config: Path, tmp_path: Path, stall: dict | None = None) -> list[subprocess.Popen]:
    """Node 0 and node 1 of a 2-rank run (one rank each), each launcher in a process group of its own; `stall`:
    the test hooks' environment for node 1 only."""
    endpoint = f"127.0.0.1:{_free_port()}"
    return [subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "train", "--config", str(config), "--nproc", "2", "--nnodes", "2",
         "--node-rank", str(node), "--rdzv-endpoint", endpoint, "--no-progress"],
        cwd=ROOT, env=_env(**LOOPBACK, **(stall if node == 1 and stall else {})), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True) for node in (0, 1)]


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:  # a failed test leaves nothing running
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The reference: the same run on one node, 2 ranks (torchrun --standalone)."""
    tmp = tmp_path_factory.mktemp("one-node")
    done = _cli(["train", "--config", str(_yaml(tmp, "run")), "--nproc", "2"], tmp, **LOOPBACK)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return _final(tmp, "run")


def test_two_nodes_match_one_node(tmp_path, one_node):
    procs = _nodes(_yaml(tmp_path, "run"), tmp_path)
    outs = _wait(procs, TIMEOUT)  # every wait in these tests has a timeout: nothing hangs the suite
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    got = _final(tmp_path, "run")
    assert got.keys() == one_node.keys(), outs
    assert all(torch.equal(got[k], one_node[k]) for k in got), outs
    state = tmp_path / "run" / "store" / "states" / "step-000001" / "group-000" / "epoch-00"
    assert sorted(p.name for p in state.iterdir()) == ["manifest.json", "shard-000", "shard-001"]  # one per rank


def test_node_lost_in_replay_then_resume_on_one_node(tmp_path, one_node):
    import yaml

    config = _yaml(tmp_path, "run")
    cfg = yaml.safe_load(config.read_text())
    cfg["pipeline"]["collective_timeout_s"] = COLLECTIVE_TIMEOUT_S
    config.write_text(yaml.safe_dump(cfg))
    marker = tmp_path / "stalled"
    procs = _nodes(config, tmp_path, stall={"LONGSTRAW_TEST_STALL": f"replay:1:1:{marker}"})
    try:
        deadline = time.monotonic() + TIMEOUT
        while not marker.exists():
            assert all(p.poll() is None for p in procs), "a node ended before rank 1 reached step 1's replay"
            assert time.monotonic() < deadline, "rank 1 never reached step 1's replay"
            time.sleep(0.2)
        rank1, launcher = map(int, marker.read_text().split())
        lost = next(n for n, p in enumerate(procs) if p.pid == launcher)  # the node rank 1 runs on
        killed = time.monotonic()
        os.killpg(launcher, signal.SIGKILL)  # the node's launcher and torchrun agent
        os.killpg(rank1, signal.SIGKILL)  # and its rank (torchrun starts each rank in a session of its own)
        survivor = procs[1 - lost]
        out = survivor.communicate(timeout=COLLECTIVE_TIMEOUT_S)[0]
        seconds = time.monotonic() - killed
    finally:
        _wait(procs, 1)
    assert survivor.returncode != 0, out[-3000:]
    assert seconds < COLLECTIVE_TIMEOUT_S, seconds
    line = next((x for x in out.splitlines() if "lost rank(s)" in x), None)
    assert line is not None, out[-3000:]
    assert f"lost rank(s) 1 of 2 (node {lost}, host {socket.gethostname()}) in replay (step 1" in line, line
    assert "longstraw resume" in line, line

    done = _cli(["resume", str(tmp_path / "run")], tmp_path, **LOOPBACK)  # one node, the run's 2 ranks
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    got = _final(tmp_path, "run")
    assert got.keys() == one_node.keys()
    assert all(torch.equal(got[k], one_node[k]) for k in got)
