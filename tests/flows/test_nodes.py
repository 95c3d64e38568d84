"""One run on two "nodes" of this machine: two `longstraw train --nnodes 2 --node-rank 0/1 --rdzv-endpoint
127.0.0.1:PORT` launches, each starting one rank under torchrun, meet at torchrun's c10d rendezvous. Two steps
of the tiny model in exact mode give the weights of the same run on one node (bitwise: the same two ranks
compute the same sums). Losing the node of rank 1 in replay (its launcher and its rank killed with kill -9) fails
the run on the other node within the collective timeout, naming the lost rank, its node and host; `longstraw
resume` on one node then ends with the weights of the uninterrupted run. Everything talks over the loopback
interface (torch's TCPStore, which serves the rendezvous, has no bind address: it listens on every interface)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from longstraw.parallel.agent import STUCK_AFTER_S
from tests.flows.test_ranks import ROOT, _cli, _env, _final, _yaml
from tests.progress import IDLE_S, POLL_S, IdleWatch, communicate, kill_tree

# gloo's connections and torchrun's node address (MASTER_ADDR of the ranks' store) on the loopback interface;
# PET_LOCAL_ADDR is torchrun's environment form of --local-addr
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo", "PET_LOCAL_ADDR": "127.0.0.1"}
COLLECTIVE_TIMEOUT_S = 60


@pytest.mark.parametrize("pipeline, message", [
    ({"nproc": 3, "nnodes": 2, "rdzv_endpoint": "h:1"}, "counts the ranks of all nodes together: 3 ranks do not split "
     "evenly over 2 nodes; use a multiple of 2, e.g. --nproc 2 for 1 per node"),
    ({"nproc": 4, "nnodes": 2}, "needs the rendezvous address: --rdzv-endpoint HOST:PORT"),
    ({"nproc": 4, "nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "node_rank 2 is not below nnodes 2"),
    ({"nproc": 4, "nnodes": 2, "rdzv_endpoint": "node0"}, "'node0' is not HOST:PORT"),
])
def test_placement_is_validated_with_the_fix(tmp_path, pipeline, message):
    from longstraw.train.config import TrainConfig
    from tests.flows.test_train_flow import config

    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig.model_validate({**config(tmp_path), "pipeline": pipeline})


def test_a_run_dir_url_is_refused_with_the_store_url_instead(tmp_path):
    from longstraw.train.config import TrainConfig
    from tests.flows.test_train_flow import config

    fix = "use a path every node mounts (NFS, Lustre, CephFS), and the state store on object storage with store.url: "
    with pytest.raises(ValueError, match=re.escape(fix + "s3://bucket/runs/x/store")):
        TrainConfig.model_validate({**config(tmp_path), "run_dir": "s3://bucket/runs/x/"})


def test_a_placement_error_on_the_command_line_names_the_fix(tmp_path, capsys):
    from flows.cli import main

    assert main(["train", "--config", str(_yaml(tmp_path, "run")), "--nproc", "2", "--nnodes", "2"]) == 2
    err = capsys.readouterr().err
    # load_config's form: the file, then pydantic's lines naming the field
    assert err.startswith("longstraw train: error: invalid config") and "Traceback" not in err, err
    assert "a run on 2 nodes needs the rendezvous address: --rdzv-endpoint HOST:PORT" in err, err
    assert not (tmp_path / "run").exists()


def test_torchrun_line_per_placement(monkeypatch):
    """One node: --standalone; several: c10d at the endpoint, nproc / nnodes ranks on each (torchrun numbers the
    nodes itself there: --node-rank is not passed, it would be ignored with a warning)."""
    from longstraw.parallel import launch

    seen = []
    monkeypatch.setattr(launch.subprocess, "run", lambda cmd, **kw: seen.append((cmd, kw["env"])))
    launch.torchrun("flows.ranks", ["--x"], 8, nnodes=4, rdzv_endpoint="node0:29500")
    launch.torchrun("flows.ranks", ["--x"], 2)
    (multi, env), (one, _) = seen
    assert multi[multi.index("longstraw.parallel.agent") + 1:multi.index("-m", 3)] == [
        "--nnodes=4", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500", "--rdzv-id=longstraw",
        "--nproc-per-node=2", "--monitor-interval=0.5"]
    assert "--standalone" in one and "--nproc-per-node=2" in one and not any("rdzv" in a for a in one)
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))


def test_placement_is_neither_in_cache_keys_nor_resumed(tmp_path):
    """Where the ranks ran does not change what a stage computes (its cached result holds on other nodes), and a
    resume runs where its command line says (one node by default), not where the stopped run ran."""
    import argparse

    from flows.cli import _overrides, _resume_config
    from longstraw.config import with_overrides
    from longstraw.train.config import TrainConfig
    from tasks.run import Run
    from tasks.stages import _cache_key
    from tests.flows.test_train_flow import config

    here = config(tmp_path, pipeline={"nproc": 4})
    there = config(tmp_path, pipeline={"nproc": 4, "nnodes": 2, "node_rank": 1, "rdzv_endpoint": "n0:29500"})
    key = _cache_key("capture")
    run = lambda c: Run.resolve(TrainConfig.model_validate(c))  # noqa: E731
    assert key(None, {"run": run(here), "step": 1}) == key(None, {"run": run(there), "step": 1})
    assert key(None, {"run": run(here), "step": 1}) != key(None, {"run": run(config(tmp_path)), "step": 1})
    assert key(None, {"run": run(here), "step": 1}) != key(None, {"run": run(here), "step": 2})
    (tmp_path / "config.json").write_text(json.dumps(there))
    stored = _resume_config(str(tmp_path))
    assert stored["pipeline"]["nproc"] == 4 and not {"nnodes", "node_rank", "rdzv_endpoint"} & stored["pipeline"].keys()
    args = argparse.Namespace(nproc=None, nnodes=2, node_rank=0, rdzv_endpoint="m:1", run_dir=None, steps=None)
    resumed = with_overrides(stored, _overrides(args))["pipeline"]
    assert (resumed["nproc"], resumed["nnodes"], resumed["node_rank"], resumed["rdzv_endpoint"]) == (4, 2, 0, "m:1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes(config: Path, tmp_path: Path, hooks: dict | None = None, cwds: tuple = (ROOT, ROOT)
           ) -> list[subprocess.Popen]:
    """Node 0 and node 1 of a 2-rank run (one rank each), each launcher in a process group of its own; `hooks`:
    the test hooks' environment, on both. Node 1 starts once node 0's torchrun serves the rendezvous, as on a
    cluster, where the endpoint's host serves it (both are 127.0.0.1 here: the first to bind would). It also puts
    rank 0 on node 0: c10d orders the nodes of one address by their torchrun's process id."""
    port = _free_port()

    def start(node: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "train", "--config", str(config), "--nproc", "2", "--nnodes", "2",
             "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}", "--no-progress"],
            cwd=cwds[node], env=_env(**LOOPBACK, **(hooks or {})), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)

    first = start(0)
    watch = IdleWatch()
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        if first.poll() is not None or watch.idle([first.pid]):
            raise AssertionError(f"node 0 never served the rendezvous:\n{_stop([first])[0][-3000:]}")
        time.sleep(0.2)
    return [first, start(1)]


def _wait(procs: list[subprocess.Popen], idle_s: float = IDLE_S) -> list[str]:
    """The launchers' outputs once they all exited; fails only when they hang (no CPU time for `idle_s` s)."""
    try:
        return [out for out, _ in communicate(procs, idle_s)]
    finally:
        _stop(procs)


def _stop(procs: list[subprocess.Popen]) -> list[str]:
    """Kill the launchers still running and everything below them (a failed test leaves nothing running); their
    outputs."""
    for p in procs:
        kill_tree(p)
    return [out for out, _ in communicate(procs)]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The reference: the same run on one node, 2 ranks (torchrun --standalone)."""
    tmp = tmp_path_factory.mktemp("one-node")
    done = _cli(["train", "--config", str(_yaml(tmp, "run")), "--nproc", "2"], tmp, **LOOPBACK)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return _final(tmp, "run")


def test_two_nodes_match_one_node(tmp_path, one_node):
    procs = _nodes(_yaml(tmp_path, "run"), tmp_path)
    outs = _wait(procs)  # every wait in these tests fails on a hang: nothing hangs the suite
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    got = _final(tmp_path, "run")
    assert got.keys() == one_node.keys(), outs
    assert all(torch.equal(got[k], one_node[k]) for k in got), outs
    state = tmp_path / "run" / "store" / "states" / "step-000001" / "group-000" / "epoch-00"
    assert sorted(p.name for p in state.iterdir()) == ["manifest.json", "shard-000", "shard-001"]  # one per rank


def _marked(marker: Path, procs: list[subprocess.Popen]) -> tuple[int, int]:
    """The (rank PID, launcher process group) a test hook wrote to `marker` once the run reached its op."""
    watch = IdleWatch()
    while not marker.exists():
        ended = [p for p in procs if p.poll() is not None]
        assert not ended, "a node ended before the hook's op:\n" + _stop(ended)[0][-3000:]
        assert not watch.idle(p.pid for p in procs), "the run never reached the hook's op (it hangs)"
        time.sleep(0.2)
    rank, launcher = map(int, marker.read_text().split())
    return rank, launcher


def _with_timeout(tmp_path: Path, timeout_s: float) -> Path:
    """The test run's config with `pipeline.collective_timeout_s` set."""
    import yaml

    config = _yaml(tmp_path, "run")
    cfg = yaml.safe_load(config.read_text())
    cfg["pipeline"]["collective_timeout_s"] = timeout_s
    config.write_text(yaml.safe_dump(cfg))
    return config


def _lose_rank_1_in_replay(tmp_path: Path, how: signal.Signals, timeout_s: float) -> tuple[int, float, str, int]:
    """A two-node run whose rank 1 stalls in step 1's replay, then gets `how` on its node's every process (its
    launcher, torchrun agent and rank; SIGSTOP: a machine gone silent, its connections left open). Returns the
    lost node, the seconds from then until the other node's launcher exited, its output and exit status."""
    marker = tmp_path / "stalled"
    procs = _nodes(_with_timeout(tmp_path, timeout_s), tmp_path,
                   hooks={"LONGSTRAW_TEST_STALL": f"replay:1:1:{marker}"})  # rank 1 stalls
    try:
        rank1, launcher = _marked(marker, procs)
        lost = next(n for n, p in enumerate(procs) if p.pid == launcher)  # the node rank 1 runs on
        assert lost == 1  # node 0, which started first, has rank 0 (see _nodes)
        hit = time.monotonic()
        os.killpg(launcher, how)  # the node's launcher and torchrun agent
        os.killpg(rank1, how)  # and its rank (torchrun starts each rank in a session of its own)
        survivor = procs[1 - lost]
        ((out, _),) = communicate([survivor], max(IDLE_S, timeout_s + 60))  # it may wait out the timeout idle
        seconds = time.monotonic() - hit
    finally:
        for group in (launcher, rank1) if marker.exists() else ():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        _stop(procs)
    line = next((x for x in out.splitlines() if "lost rank(s)" in x), None)
    assert line is not None, out[-3000:]
    assert f"lost rank(s) 1 of 2 (node {lost}, host {socket.gethostname()}) in replay (step 1" in line, line
    assert "longstraw resume" in line, line
    return lost, seconds, out, survivor.returncode


def test_node_lost_in_replay_then_resume_on_one_node(tmp_path, one_node):
    _, seconds, out, status = _lose_rank_1_in_replay(tmp_path, signal.SIGKILL, COLLECTIVE_TIMEOUT_S)
    assert status != 0, out[-3000:]
    assert seconds < COLLECTIVE_TIMEOUT_S, seconds  # its connections closed: no need to wait for the timeout

    stored = tmp_path / "run" / "store" / "states" / "step-000001"
    written = {f: f.stat().st_mtime_ns for f in stored.rglob("*") if f.is_file()}
    assert written  # step 1's capture was stored before its replay
    done = _cli(["resume", str(tmp_path / "run")], tmp_path, **LOOPBACK)  # one node, the run's 2 ranks
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    # the cached capture is reused on other nodes: placement is not in the cache key
    assert {f: f.stat().st_mtime_ns for f in stored.rglob("*") if f.is_file()} == written
    got = _final(tmp_path, "run")
    assert got.keys() == one_node.keys()
    assert all(torch.equal(got[k], one_node[k]) for k in got)


def test_a_silent_node_fails_the_run_after_the_collective_timeout(tmp_path):
    """A node that stops answering without closing its connections (SIGSTOP: a machine that lost power or its
    network): the other node fails after `collective_timeout_s`, not later, naming the lost rank."""
    timeout_s = 30
    _, seconds, out, status = _lose_rank_1_in_replay(tmp_path, signal.SIGSTOP, timeout_s)
    assert status != 0, out[-3000:]
    assert timeout_s * 0.9 <= seconds < timeout_s + 30, seconds


def test_rank_0_busy_past_the_timeout_keeps_the_run(tmp_path, one_node):
    """Rank 0 alone for longer than the collective timeout (here after step 1's replay; in a run: scoring, tracking,
    its flow's start) while rank 1 waits for its next command: its heartbeat keeps rank 1 waiting."""
    timeout_s, pause_s = 10, 25
    marker = tmp_path / "paused"
    done = _cli(["train", "--config", str(_with_timeout(tmp_path, timeout_s)), "--nproc", "2"], tmp_path,
                LONGSTRAW_TEST_PAUSE=f"replay:1:{marker}:{pause_s}", **LOOPBACK)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert marker.exists()
    got = _final(tmp_path, "run")
    assert all(torch.equal(got[k], one_node[k]) for k in one_node)


def test_a_silent_rank_0_fails_the_other_node_naming_it(tmp_path):
    """Rank 0's machine goes silent (SIGSTOP of its launcher and rank) while rank 1, on the other node, waits for a
    command: rank 1 fails after `collective_timeout_s`, naming rank 0's node and host, and its node exits non-zero
    (before heartbeats, it waited for the command group's timeout of 7 days; before agent.py, its torchrun agent
    stayed blocked on the silent machine's rendezvous store)."""
    timeout_s = 20
    marker = tmp_path / "paused"
    procs = _nodes(_with_timeout(tmp_path, timeout_s), tmp_path,
                   hooks={"LONGSTRAW_TEST_PAUSE": f"replay:1:{marker}:600"})
    rank0 = launcher = None
    try:
        rank0, launcher = _marked(marker, procs)
        assert launcher == procs[0].pid  # node 0, which started first, has rank 0 (see _nodes)
        hit = time.monotonic()
        os.killpg(launcher, signal.SIGSTOP)
        os.killpg(rank0, signal.SIGSTOP)
        ((out, _),) = communicate([procs[1]], max(IDLE_S, timeout_s + STUCK_AFTER_S + 60))
        seconds = time.monotonic() - hit
    finally:
        for group in (launcher, rank0):
            if group is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
        _stop(procs)
    assert procs[1].returncode != 0, out[-3000:]
    # rank 1 fails after the timeout; its torchrun agent, blocked on node 0's silent rendezvous store, leaves
    # STUCK_AFTER_S later (longstraw/parallel/agent.py)
    assert timeout_s * 0.5 <= seconds < timeout_s + STUCK_AFTER_S + 20, seconds
    assert "the rendezvous host does not answer; leaving" in out, out[-3000:]
    assert json.loads((tmp_path / "run" / "ranks" / "error-rank001.json").read_text())["rank"] == 1
    line = next((x for x in out.splitlines() if "lost rank 0 of 2" in x), None)
    assert line is not None, out[-3000:]
    assert (f"lost rank 0 of 2 (node 0, host {socket.gethostname()}), which drives the run: it sent neither a "
            f"command nor a heartbeat for {timeout_s} s") in line, line
    assert f"`longstraw resume {tmp_path / 'run'}` continues it" in line, line


def test_killing_only_the_launcher_stops_its_ranks(tmp_path):
    """kill -9 of `longstraw train` alone, not its process group: the kernel sends its torchrun agent SIGTERM
    (longstraw/parallel/agent.py) and the agent stops both ranks, instead of leaving them running unwatched."""
    import psutil

    marker = tmp_path / "stalled"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "train", "--config", str(_yaml(tmp_path, "run")), "--nproc", "2",
         "--no-progress"], cwd=ROOT, env=_env(**LOOPBACK, LONGSTRAW_TEST_STALL=f"replay:1:1:{marker}"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    below: list = []
    try:
        _marked(marker, [proc])
        below = psutil.Process(proc.pid).children(recursive=True)  # the agent, the ranks, rank 0's servers
        assert len(below) >= 3, below
        proc.kill()
        watch, alive = IdleWatch(), below
        while alive and not watch.idle(p.pid for p in alive):  # stopping, however slowly, until they hang
            _, alive = psutil.wait_procs(alive, timeout=POLL_S)
        assert not alive, [" ".join(p.cmdline()[:4]) for p in alive]
    finally:
        for p in below:  # the ranks run in sessions of their own
            with contextlib.suppress(psutil.Error):
                p.kill()
        _stop([proc])


def test_an_error_on_node_1_fails_both_nodes(tmp_path):
    """Rank 1's own error in replay: rank 0 names it, and both nodes' launchers exit non-zero (a scheduler sees
    every node of the job fail; on one machine, rank 1 exits 0 instead, so that torchrun leaves rank 0 be)."""
    procs = _nodes(_yaml(tmp_path, "run"), tmp_path, hooks={"LONGSTRAW_TEST_FAULT": "replay:1:1"})
    outs = _wait(procs)
    assert [p.returncode != 0 for p in procs] == [True, True], "\n".join(o[-2000:] for o in outs)
    assert "rank 1 of 2 failed in replay (step 1" in outs[0] and "injected replay fault on rank 1" in outs[0]
    assert (tmp_path / "run" / "checkpoints" / "update-000001").is_dir()  # step 0 committed


def test_a_run_dir_the_nodes_do_not_share_is_an_error_on_every_rank(tmp_path):
    """A relative run_dir on nodes in different working directories: two directories, not one. Every rank stops
    at the start with the same error, naming the rank that does not see rank 0's directory."""
    import yaml

    cfg = yaml.safe_load(_yaml(tmp_path, "run").read_text())
    cfg["run_dir"] = "run"
    config = tmp_path / "relative.yaml"
    config.write_text(yaml.safe_dump(cfg))
    cwds = (tmp_path / "a", tmp_path / "b")
    for d in cwds:
        d.mkdir()
    procs = _nodes(config, tmp_path, cwds=cwds)
    outs = _wait(procs)
    assert all(p.returncode != 0 for p in procs), outs
    for out in outs:
        line = next((x for x in out.splitlines() if "ValueError: the run directory run is not one" in x), None)
        assert line is not None, out[-3000:]
        assert "do not see what rank 0" in line and "every node mounts at the same path" in line, line
    assert not any((d / "run" / "checkpoints").exists() for d in cwds)  # nothing trained


def test_rank_0_names_the_ranks_that_recorded_nothing_by_node(tmp_path, monkeypatch):
    """Four ranks on two nodes; node 1 (ranks 2, 3) is lost: rank 1 recorded that a peer left, ranks 2 and 3
    recorded nothing, so they are the lost ones. A rank's own error, when one is recorded, is named instead."""

    from longstraw.train import spmd
    from tests.flows.test_train_flow import config

    monkeypatch.setattr(spmd, "RECORD_WAIT_S", 0.2)
    cfg = spmd.TrainConfig.model_validate(config(tmp_path / "run"))
    ranks = spmd.Ranks(None, None, 0, 4, places=[{"node": 0, "host": "a"}] * 2 + [{"node": 1, "host": "b"}] * 2)
    driver = spmd.Driver(type("W", (), {"cfg": cfg, "ranks": ranks})())
    d = tmp_path / "run" / "ranks"
    d.mkdir(parents=True)

    def record(rank: int, message: str) -> None:
        (d / f"error-rank{rank:03d}.json").write_text(json.dumps({"rank": rank, "message": message, "time": 10.0}))

    record(0, "rank 0 of 4 failed in replay: RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1")
    record(1, "rank 1 of 4 failed in replay: RuntimeError: [gloo] Timed out waiting 60000ms for recv")
    got = str(driver._who_failed(10.0, ranks, "replay (step 1)"))
    assert got.startswith("lost rank(s) 2, 3 of 4 (node 1, host b) in replay (step 1): no answer"), got
    record(3, "rank 3 of 4 failed in replay: ValueError: bad input")
    got = driver._who_failed(10.0, ranks, "replay")
    assert str(got).startswith("rank 3 of 4 failed in replay: ValueError: bad input") and not got.user
