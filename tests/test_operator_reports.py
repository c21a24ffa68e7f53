"""Operator reports end to end: live progress naming a late node (plain lines and a
terminal bar), the failure report naming the first failing rank and node, the timeline
file and its PNG. Real agents and Gloo workers on simulated nodes (loopback addresses)."""

import json
import os
import pty
import subprocess
import sys
import threading
import time

from launch import SCRIPTS, finish, free_port, kill_tree, tierrun


def static_node(k: int, nodes: int, port: int, *extra, log, env=None):
    return tierrun("--nnodes", nodes, "--nproc_per_node", 2, "--rdzv_backend", "parallel",
                   "--master_addr", "127.0.1.1", "--master_port", port, "--node_rank", k,
                   "--local_addr", f"127.0.1.{k + 1}", *extra, log=log, env=env)


def test_late_node_named_failure_report_and_timeline(tmp_path):
    """3 nodes; node 2 starts late and its first worker (rank 4) raises."""
    port = free_port()
    timeline = tmp_path / "timeline.json"
    logs = [tmp_path / f"node{k}.log" for k in range(3)]
    env = {"FAIL_RANK": "4"}
    common = ("--progress_interval", "1", "--timeline", timeline)
    procs = [static_node(k, 3, port, *common, "--log_dir", tmp_path / f"logs{k}",
                         SCRIPTS / "fail_rank.py", log=logs[k], env=env) for k in range(2)]
    # node 2 starts once the store host shows nodes 0 and 1 waiting for it (a fixed
    # sleep was not enough: under CI's load the host's agent can take longer to start
    # than the sleep, and then all three nodes join within one progress interval)
    deadline = time.monotonic() + 90
    while "2/3 nodes" not in logs[0].read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)
    procs.append(static_node(2, 3, port, *common, "--log_dir", tmp_path / "logs2",
                             SCRIPTS / "fail_rank.py", log=logs[2], env=env))
    codes = finish(procs)
    host = logs[0].read_text()
    assert all(c != 0 for c in codes), codes

    # progress, plain lines (stderr is a file): the late node is named while missing
    progress = [line for line in host.splitlines() if line.startswith("[tierrun] rendezvous")]
    assert any("2/3 nodes" in line and "missing: node rank 2" in line for line in progress), progress or host[-3000:]
    assert "3 nodes joined" in progress[-1], progress
    assert "[tierrun] rendezvous" not in logs[1].read_text()  # only the store host shows it
    # quiet while node 2 is late: no C++ warnings from torch's client (it printed two
    # "waitForInput ... timed out" a second when the rendezvous polled in short waits)
    assert "waitForInput" not in host and not any(line.startswith("[W") for line in host.splitlines()), host[-3000:]

    # the failure report: the first failure is rank 4 on node 2, with its error
    for log in logs:
        text = log.read_text()
        assert "first failure: rank 4 (local rank 0) on node 127.0.1.3 (node rank 2)" in text, text[-3000:]
        assert "ValueError: boom on purpose in rank 4" in text
        assert "| ValueError: boom on purpose in rank 4" in text  # the traceback's tail
        assert "worker_main" not in text.split("tierrun: job")[1].split("restarts used")[0]
    reports = list((tmp_path / "logs0").glob("tierrun_failure_*.json"))
    assert len(reports) == 1
    report = json.loads(reports[0].read_text())
    assert report["first"]["failure"]["global_rank"] == 4
    assert report["first"]["group_rank"] == 2 and report["first"]["addr"] == "127.0.1.3"
    assert report["restarts"] == 0 and report["nodes_seen"] == 3
    assert set(report["phases"]) == {"agent start", "rendezvous", "worker start", "run"}
    assert report["phases"]["rendezvous"] > 0

    # the timeline: written by the store host, one row per node, phases in order
    tl = json.loads(timeline.read_text())
    assert [n["addr"] for n in tl["nodes"]] == ["127.0.1.1", "127.0.1.2", "127.0.1.3"]
    for n in tl["nodes"]:
        phases = n["attempts"][0]["phases"]
        assert [p["name"] for p in phases] == ["agent start", "rendezvous", "worker start", "run"]
        assert all(p["start"] <= p["end"] for p in phases)
        assert all(a["end"] <= b["start"] + 1e-3 for a, b in zip(phases, phases[1:]))
    late = tl["nodes"][2]["attempts"][0]["phases"][0]["start"]
    assert late > 3, "node 2's agent started seconds after the others"
    # node 0 waited for the late node: its rendezvous ended after node 2's agent started
    # (how long it waited depends on how slowly its own agent started: a loaded machine)
    node0_rendezvous = tl["nodes"][0]["attempts"][0]["phases"][1]
    assert node0_rendezvous["name"] == "rendezvous" and node0_rendezvous["end"] > late, tl
    png = tmp_path / "timeline.png"
    out = subprocess.run([sys.executable, "-m", "tierrun", "timeline", str(timeline), "--png", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_bar_on_a_terminal(tmp_path):
    """3 nodes, node 2 late; the store host's stderr is a terminal: a tqdm bar names
    the missing node."""
    port = free_port()
    master, slave = pty.openpty()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", COLUMNS="160")
    host = subprocess.Popen(
        [sys.executable, "-m", "tierrun", "--nnodes", "3", "--nproc_per_node", "1",
         "--rdzv_backend", "parallel", "--master_addr", "127.0.1.1", "--master_port", str(port),
         "--node_rank", "0", "--local_addr", "127.0.1.1", "--progress_interval", "1",
         str(SCRIPTS / "collectives.py")],
        stdout=subprocess.DEVNULL, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    screen = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                return
            if not chunk:
                return
            screen.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    others = [static_node(1, 3, port, "--nproc_per_node", "1", SCRIPTS / "collectives.py",
                          log=tmp_path / "node1.log")]
    # node 2 comes once the bar has shown node 1 for three progress intervals (a fixed
    # delay was too short on a loaded machine, where node 1 took that long to arrive)
    deadline = time.monotonic() + 60
    while b"2/3 nodes" not in screen and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(3)
    others.append(static_node(2, 3, port, "--nproc_per_node", "1", SCRIPTS / "collectives.py",
                              log=tmp_path / "node2.log"))
    try:
        codes = finish([host, *others])
    finally:
        kill_tree(host.pid)
    reader.join(timeout=10)
    os.close(master)
    text = screen.decode(errors="replace")
    assert codes == [0, 0, 0], text[-3000:]
    assert "2/3 nodes |" in text and "missing: node rank 2" in text, text[-3000:]
    assert "3/3 nodes |" in text and "all joined" in text, text[-3000:]
    assert "[tierrun] rendezvous" not in text  # a bar, not log lines


def test_a_node_started_before_the_store_host_says_what_it_waits_for(tmp_path):
    """Tiered, 2 nodes: node 1 starts first, node 0 (the store host) once node 1 has
    said, as it does every progress interval, what it is waiting for; then node 1 says
    that it reached it, and the job runs."""
    port = free_port()
    logs = [tmp_path / f"node{k}.log" for k in range(2)]
    env = {"TIERRUN_TOKEN": "a-job-token"}
    common = ("--progress_interval", "1", "--enable_tiered_parallel_tcpstore", "true", SCRIPTS / "ddp_toy.py")
    early = static_node(1, 2, port, *common, log=logs[1], env=env)
    deadline = time.monotonic() + 60
    while "still waiting for" not in logs[1].read_text() and early.poll() is None:
        assert time.monotonic() < deadline, logs[1].read_text()[-3000:]
        time.sleep(0.2)
    host = static_node(0, 2, port, *common, log=logs[0], env=env)
    assert finish([host, early]) == [0, 0], logs[1].read_text()[-3000:]
    waiting = logs[1].read_text()
    said = [line for line in waiting.splitlines() if "still waiting for" in line]
    assert said, waiting[-3000:]
    assert said[0].startswith(f"[tierrun] node 127.0.1.2: still waiting for the job's store host 127.0.1.1:{port} after ")
    assert "(giving up after 900 s)" in said[0]  # torch's LaunchConfig default rendezvous timeout
    assert f"[tierrun] node 127.0.1.2: reached the job's store host 127.0.1.1:{port} after" in waiting
    assert "still waiting" not in logs[0].read_text()  # the store host waits for no store
