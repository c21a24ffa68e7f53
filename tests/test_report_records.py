"""The report package without processes: torch agent events -> a node's record ->
the failure report and the timeline; the worker wrapper's error file."""

import json
import py_compile
import os
import resource
import signal
import subprocess
import sys
import time

from torch.distributed.elastic.events import Event, EventSource

from tierrun.report import timeline
from tierrun.report.board import NodeRecord
from tierrun.report.failure import FailureReport
from tierrun.report.progress import Arrivals, arrivals_line
from tierrun.report.recorder import AgentRecorder


def agent_event(state, restarts=0, duration_ms=0.0):
    return Event("e", EventSource.AGENT, metadata={"state": state, "agent_restarts": restarts,
                                                   "duration_ms": duration_ms, "group_rank": None})


def worker_event(state, global_rank, local_rank, group_rank=1, exit_code=None, raw_error=None, restarts=0):
    md = json.dumps({"local_rank": [local_rank], "exit_code": [exit_code], "group_world_size": 3})
    return Event("w", EventSource.WORKER, metadata={
        "state": state, "global_rank": global_rank, "group_rank": group_rank, "agent_restarts": restarts,
        "raw_error": raw_error, "metadata": md})


def recorder(addr="10.0.0.2"):
    r = AgentRecorder(addr, 7, board=lambda: None)
    r.node.started = 100.0
    return r


def test_events_make_attempts_with_phases_restarts_and_failures():
    r = recorder()
    r.on_event(agent_event("RENDEZVOUS", duration_ms=2000), 103.0)
    r.on_event(worker_event("START", 2, 0), 103.5)
    r.on_event(worker_event("START", 3, 1), 103.6)
    # workers failed, the agent restarted them: the next rendezvous ends attempt 0
    r.on_event(agent_event("RENDEZVOUS", restarts=1, duration_ms=1000), 110.0)
    r.on_event(worker_event("START", 2, 0, restarts=1), 110.2)
    error = {"message": {"message": "ValueError: bad", "extraInfo": {
        "py_callstack": "Traceback...\nValueError: bad\n", "timestamp": "111", "tierrun_time": 111.25}}}
    r.on_event(worker_event("FAILED", 2, 0, exit_code=1, raw_error=json.dumps(error), restarts=1), 112.0)
    r.on_event(worker_event("FAILED", 3, 1, exit_code=-9, restarts=1), 112.0)
    first, second = r.node.attempts
    assert first.rendezvous == (101.0, 103.0) and first.workers_started == 103.6
    assert first.state == "RESTARTED" and first.ended == 109.0
    assert first.group_rank == 1 and first.world_size == 3
    assert second.number == 1 and second.state == "FAILED" and second.ended == 112.0
    f2, f3 = second.failures
    assert (f2.global_rank, f2.exitcode, f2.time, f2.message) == (2, 1, 111.25, "ValueError: bad")
    assert f2.traceback.endswith("ValueError: bad\n")
    assert (f3.global_rank, f3.local_rank, f3.message) == (3, 1, "killed by signal SIGKILL")
    # the record survives the board's JSON round trip
    assert NodeRecord.from_json(r.node.to_json()) == r.node


def test_a_round_has_ended_only_once_every_worker_has_its_final_state():
    """torch's agent reports its workers' final states one by one, and the record is
    published after each: a reader must not take the first FAILED for the whole node."""
    r = recorder()
    r.on_event(agent_event("RENDEZVOUS", duration_ms=10), 101.0)
    r.on_event(worker_event("START", 2, 0), 101.5)
    r.on_event(worker_event("START", 3, 1), 101.6)
    assert not r.attempt.has_ended()
    r.on_event(worker_event("FAILED", 2, 0, exit_code=1), 102.0)
    assert r.attempt.state == "FAILED" and not r.attempt.has_ended()
    assert not NodeRecord.from_json(r.node.to_json()).attempts[-1].has_ended()
    r.on_event(worker_event("TERMINATED", 3, 1), 102.0)
    assert r.attempt.state == "FAILED" and r.attempt.has_ended()
    assert NodeRecord.from_json(r.node.to_json()).attempts[-1].has_ended()


def test_failure_report_names_the_earliest_failure_in_the_job():
    mine, other = recorder("10.0.0.1"), recorder("10.0.0.3")
    for rec, rank, when in ((mine, 0, 50.0), (other, 4, 20.0)):
        rec.on_event(agent_event("RENDEZVOUS", duration_ms=1000), 10.0)
        rec.on_event(worker_event("START", rank, 0, group_rank=rank // 2), 11.0)
        rec.on_event(worker_event("FAILED", rank, 0, group_rank=rank // 2, exit_code=2), when)
    mine.node.started = 5.0
    report = FailureReport.build("job", mine.node, [other.node, mine.node])
    assert report.first.addr == "10.0.0.3" and report.first.failure.global_rank == 4
    assert [fr.failure.global_rank for fr in report.failed] == [4, 0]
    assert report.nodes_seen == 2
    text = report.render()
    assert "first failure: rank 4 (local rank 0) on node 10.0.0.3 (node rank 2)" in text
    assert "exited with code 2" in text and "rank 0 on 10.0.0.1 (+30.00 s)" in text
    assert report.phases == {"agent start": 4.0, "rendezvous": 1.0, "worker start": 1.0, "run": 39.0}


def test_failure_report_puts_the_crashed_rank_before_those_the_agent_stopped():
    # what torch's agent reports when one worker aborts and it stops the others: every
    # failure at once, none with an error file ({"message": "<NONE>"}), rank 0 first
    r = recorder("10.0.0.1")
    r.on_event(agent_event("RENDEZVOUS", duration_ms=1000), 10.0)
    r.on_event(worker_event("START", 0, 0, group_rank=0), 11.0)
    no_file = json.dumps({"message": "<NONE>"})
    for rank, code in ((0, -15), (1, -6), (2, -15), (3, -15)):
        r.on_event(worker_event("FAILED", rank, rank, group_rank=0, exit_code=code, raw_error=no_file), 20.0)
    report = FailureReport.build("job", r.node, [])
    assert [fr.failure.global_rank for fr in report.failed] == [1, 0, 2, 3]
    text = report.render()
    assert "first failure: rank 1 (local rank 1) on node 10.0.0.1 (node rank 0) at " in text
    assert text.splitlines()[1].endswith(": killed by signal SIGABRT")
    assert "<NONE>" not in text


def test_timeline_orders_nodes_by_rank_and_phases_by_time():
    a, b = recorder("10.0.0.1"), recorder("10.0.0.2")
    b.node.started = 104.0
    for rec, rank in ((b, 1), (a, 0)):
        rec.on_event(agent_event("RENDEZVOUS", duration_ms=3000), 108.0)
        rec.on_event(worker_event("START", rank, 0, group_rank=rank), 109.0)
    tl = timeline.build("job", [b.node, a.node])
    assert tl["t0"] == 100.0 and [n["addr"] for n in tl["nodes"]] == ["10.0.0.1", "10.0.0.2"]
    phases = tl["nodes"][1]["attempts"][0]["phases"]
    assert [(p["name"], p["start"], p["end"]) for p in phases] == [
        ("agent start", 4.0, 5.0), ("rendezvous", 5.0, 8.0), ("worker start", 8.0, 9.0), ("run", 9.0, None)]
    a.node_lost("10.0.0.2", silent_since=120.0)  # (b died: its own record still says RUNNING)
    tl = timeline.build("job", [b.node, a.node])
    dead = tl["nodes"][1]["attempts"][0]
    assert dead["state"] == "LOST" and dead["phases"][-1] == {"name": "run", "start": 9.0, "end": 20.0}
    assert tl["nodes"][0]["attempts"][0]["state"] == "RUNNING"


def test_the_timeline_draws_every_short_run_bar_alike(tmp_path):
    import matplotlib.pyplot as plt

    drawn = []
    original = plt.Axes.barh
    plt.Axes.barh = lambda ax, row, width, left, **kw: drawn.append((row, width)) or original(ax, row, width, left=left, **kw)
    try:
        nodes = [{"node": f"n{i}", "addr": f"10.0.0.{i}", "attempts": [{"number": 0, "group_rank": i, "state": "RUNNING",
                  "phases": [{"name": "rendezvous", "start": 0.0, "end": 2.0 + i},
                             {"name": "run", "start": 2.0 + i, "end": 100.0}]}]} for i in range(3)]
        timeline.render_png({"run_id": "job", "t0": 0.0, "nodes": nodes}, tmp_path / "t.png")
    finally:
        plt.Axes.barh = original
    runs = [width for row, width in drawn if width not in (2.0, 3.0, 4.0)]
    assert len(runs) == 3 and len(set(runs)) == 1  # (row 0's was drawn shorter than the others')


def test_arrivals_line_names_missing_nodes_or_says_how_many_are_short():
    assert arrivals_line(Arrivals(["a"], 3, 3, ["node rank 1", "node rank 2"])) == "missing: node rank 1, node rank 2"
    many = [f"node rank {k}" for k in range(25)]
    assert arrivals_line(Arrivals([], 25, 25, many)).endswith("node rank 9 and 15 more")
    assert arrivals_line(Arrivals(["a", "b"], 4, 8, None)) == "waiting for at least 2 more node(s); joined: a, b"
    assert arrivals_line(Arrivals(["a", "b"], 2, 4, None)).startswith("2 joined, taking up to 4")


def test_worker_wrapper_records_the_error_and_keeps_python_behaviour(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import sys\nprint(__name__, sys.argv[1:], sys.path[0])\nraise KeyError('lost')\n")
    err = tmp_path / "error.json"
    out = subprocess.run([sys.executable, "-m", "tierrun.launcher.worker_main", str(script), "--x", "1"],
                         capture_output=True, text=True, env=dict(os.environ, TORCHELASTIC_ERROR_FILE=str(err)))
    assert out.returncode == 1
    assert out.stdout == f"__main__ ['--x', '1'] {tmp_path}\n"
    assert "KeyError: 'lost'" in out.stderr and "worker_main" not in out.stderr and "runpy" not in out.stderr
    data = json.loads(err.read_text())["message"]
    assert data["message"] == "KeyError: 'lost'"
    assert 'job.py", line 3' in data["extraInfo"]["py_callstack"]
    # SystemExit is an exit: Python's exit code, and the time of the call (the process
    # ends later, after clean-up that fails its peers' collectives first)
    script.write_text("raise SystemExit(3)\n")
    err.unlink()
    before = time.time()
    out = subprocess.run([sys.executable, "-m", "tierrun.launcher.worker_main", str(script)],
                         capture_output=True, text=True, env=dict(os.environ, TORCHELASTIC_ERROR_FILE=str(err)))
    data = json.loads(err.read_text())["message"]
    assert out.returncode == 3 and data["message"] == "exited with code 3"
    # where it exited, the script's frames only (Python prints no traceback for it)
    assert data["extraInfo"]["py_callstack"] == (f'Traceback (most recent call last):\n  File "{script}", line 1, in '
                                                 '<module>\n    raise SystemExit(3)\nSystemExit: 3\n')
    assert out.stderr == ""  # (as Python prints nothing for it)
    assert before <= data["extraInfo"]["tierrun_time"] <= time.time()
    script.write_text("raise SystemExit(0)\n")
    err.unlink()
    out = subprocess.run([sys.executable, "-m", "tierrun.launcher.worker_main", str(script)],
                         env=dict(os.environ, TORCHELASTIC_ERROR_FILE=str(err)))
    assert out.returncode == 0 and not err.exists()


def test_worker_wrapper_leaves_no_partial_record_on_a_full_disk(tmp_path):
    """The record cannot be written whole (a full disk; here a 16-byte file size limit,
    which Python meets as EFBIG): no file is left, where an empty one made torch's agent
    crash parsing it (no report, no restart; torchrun, with no file, restarts)."""
    script = tmp_path / "job.py"
    script.write_text("raise KeyError('lost')\n")
    err = tmp_path / "error.json"

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))

    out = subprocess.run([sys.executable, "-m", "tierrun.launcher.worker_main", str(script)], capture_output=True,
                         text=True, env=dict(os.environ, TORCHELASTIC_ERROR_FILE=str(err)), preexec_fn=small_files)
    assert out.returncode == 1 and "KeyError: 'lost'" in out.stderr
    assert list(tmp_path.iterdir()) == [script]


def test_the_worker_script_runs_as_python_runs_it(tmp_path):
    """A relative script path gives an absolute ``__file__`` (a script that changes
    directory still finds its files); a missing script and a KeyboardInterrupt end as
    Python ends them (code 2 and its message; death by SIGINT), recorded for the report."""
    (tmp_path / "cfg.txt").write_text("found")
    (tmp_path / "job.py").write_text("import os, pathlib\nos.chdir('/')\n"
                                     "print(pathlib.Path(__file__).parent.joinpath('cfg.txt').read_text(), __file__)\n")
    err = tmp_path / "error.json"
    env = dict(os.environ, TORCHELASTIC_ERROR_FILE=str(err))
    run = lambda script: subprocess.run([sys.executable, "-m", "tierrun.launcher.worker_main", script],
                                        capture_output=True, text=True, env=env, cwd=tmp_path)
    out = run("job.py")
    assert (out.returncode, out.stdout) == (0, f"found {tmp_path / 'job.py'}\n"), out.stderr
    out = run("missing.py")
    python = subprocess.run([sys.executable, "missing.py"], capture_output=True, text=True, cwd=tmp_path)
    assert (out.returncode, out.stderr) == (python.returncode, python.stderr) == (2, python.stderr)
    assert "can't open file" in json.loads(err.read_text())["message"]["message"]
    err.unlink()
    # sys.argv as written, sys.path[0] the real directory of a script reached by a symbolic link
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "sibling.py").write_text("NAME = 'sibling'\n")
    (tmp_path / "sub" / "imp.py").write_text("import sys, sibling\nprint(sys.argv, sys.path[0], __file__, __name__, "
                                             "sibling.NAME, __package__, __spec__)\n")
    (tmp_path / "link_imp.py").symlink_to(tmp_path / "sub" / "imp.py")
    # the script stays __main__ once its body ended (an atexit handler pickles its class);
    # a compiled script; a directory with a __main__.py
    (tmp_path / "ax.py").write_text("import atexit, pickle, sys\nclass Ckpt:\n    pass\n"
                                    "atexit.register(lambda: print(len(pickle.dumps(Ckpt())) > 0, sys.argv[0]))\n")
    py_compile.compile(str(tmp_path / "sub" / "sibling.py"), cfile=str(tmp_path / "sub" / "compiled.pyc"))
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("import sys\nprint(sys.argv, sys.path[0], __name__)\n")
    for script in ("link_imp.py", "sub/imp.py", "ax.py", "sub/compiled.pyc", "app"):
        out = run(script)
        python = subprocess.run([sys.executable, script], capture_output=True, text=True, cwd=tmp_path)
        assert (out.returncode, out.stdout) == (python.returncode, python.stdout) == (0, python.stdout), out.stderr
    (tmp_path / "job.py").write_text("import atexit\natexit.register(print, 'cleaned up')\nraise KeyboardInterrupt\n")
    out = run("job.py")  # (after the script's clean-up, as Python's)
    assert out.returncode == -signal.SIGINT and "KeyboardInterrupt" in out.stderr and out.stdout == "cleaned up\n"
    assert json.loads(err.read_text())["message"]["message"] == "KeyboardInterrupt: "


def test_collective_failures_after_a_death_are_consequences_not_the_root_cause():
    """A rank exits at 10.20 s; a peer's all_reduce failed at 10.05 s (the dead rank's
    clean-up closed its connections before its process ended): the exit is the root
    cause. When every failure is a collective's, the earliest is."""
    def node(addr, rank, exit_code, message, when):
        rec = recorder(addr)
        rec.on_event(agent_event("RENDEZVOUS", duration_ms=1000), 5.0)
        rec.on_event(worker_event("START", rank, 0, group_rank=rank), 6.0)
        error = None if message is None else json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": f"Traceback...\n{message}\n", "tierrun_time": when}}})
        rec.on_event(worker_event("FAILED", rank, 0, group_rank=rank, exit_code=exit_code, raw_error=error), when)
        return rec.node

    gloo = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5000"
    nccl = "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1234, remote process exited"
    peer, dead = node("10.0.0.1", 0, 1, gloo, 10.05), node("10.0.0.2", 1, 3, None, 10.20)
    report = FailureReport.build("job", peer, [dead])
    assert (report.first.failure.global_rank, report.first.consequence) == (1, False)
    assert [(fr.failure.global_rank, fr.consequence) for fr in report.failed] == [(1, False), (0, True)]
    text = report.render()
    assert text.splitlines()[1].endswith(": exited with code 3")
    assert "1 failure(s) in collectives after it (consequences): rank 0 on 10.0.0.1 (-0.15 s)" in text
    both = FailureReport.build("job", node("10.0.0.1", 0, 1, gloo, 10.05), [node("10.0.0.2", 1, 1, nccl, 9.9)])
    assert [fr.failure.global_rank for fr in both.failed] == [1, 0] and not any(fr.consequence for fr in both.failed)


def test_a_dead_node_whose_watcher_saw_its_heartbeat_stop_is_the_root_cause_not_a_survivors_collective():
    """A whole node dies (its agent too: it records nothing); a survivor's rank fails in
    its all_reduce at once, and the watcher declares the dead node lost 3 s later. The
    report names the dead node first and the survivor's failure as its consequence, on
    every node that reads the board (the watcher's record carries the loss)."""
    gloo = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.1.3]:5000"
    survivor, watcher = recorder("127.0.1.2"), recorder("127.0.1.1")
    for rec, rank in ((survivor, 1), (watcher, 0)):
        rec.on_event(agent_event("RENDEZVOUS", duration_ms=1000), 5.0)
        rec.on_event(worker_event("START", rank, 0, group_rank=rank), 6.0)
    error = json.dumps({"message": {"message": gloo, "extraInfo": {"py_callstack": f"Traceback...\n{gloo}\n",
                                                                    "tierrun_time": 20.01}}})
    survivor.on_event(worker_event("FAILED", 1, 0, group_rank=1, exit_code=1, raw_error=error), 20.01)
    watcher.node_lost("127.0.1.3", silent_since=20.0)
    watcher.node_lost("127.0.1.3", silent_since=21.0)  # (declared once per address)
    published = NodeRecord.from_json(watcher.node.to_json())  # (as the survivor reads it from the board)
    assert [(n.addr, n.silent_since, n.by) for n in published.lost] == [("127.0.1.3", 20.0, "127.0.1.1")]
    report = FailureReport.build("job", survivor.node, [published])
    assert report.lost_first.addr == "127.0.1.3"
    assert [(fr.failure.global_rank, fr.consequence) for fr in report.failed] == [(1, True)]
    text = report.render()
    assert text.splitlines()[1].startswith("  first failure: node 127.0.1.3 stopped answering at about ")
    assert "declared lost by node 127.0.1.1" in text
    assert "1 failure(s) in collectives after it (consequences): rank 1 on 127.0.1.2 (+0.01 s)" in text
    # a rank that failed on its own before the node was lost stays the root cause
    early = recorder("127.0.1.2")
    early.on_event(agent_event("RENDEZVOUS", duration_ms=1000), 5.0)
    early.on_event(worker_event("START", 1, 0, group_rank=1), 6.0)
    early.on_event(worker_event("FAILED", 1, 0, group_rank=1, exit_code=3), 12.0)
    later = FailureReport.build("job", early.node, [published])
    assert later.lost_first is None and later.first.failure.global_rank == 1
    assert "node(s) that stopped answering after it: 127.0.1.3 at about" in later.render()


def _record(addr, state, workers=1, pid=1):
    from tierrun.report.board import Attempt
    ended = workers if state != "RUNNING" else 0
    return NodeRecord(f"{addr}:{pid}", addr, 100.0, [Attempt(0, state=state, workers=workers, workers_ended=ended)])


class _Board:
    def __init__(self, records):
        self.records, self.reads = records, 0

    def read_all(self):
        self.reads += 1
        return list(self.records)


def test_a_report_waits_only_for_members_that_may_still_end(monkeypatch):
    """The reporting node counts itself as ended (its workers may have been stopped with
    no final state: another node stopped the job), and the members it declared dead
    DEAD_GRACE seconds ago (they publish nothing more): it waited REPORT_GRACE (5 s)."""
    from tierrun.launcher import reporting

    monkeypatch.setattr(reporting, "REPORT_GRACE", 1.0)
    monkeypatch.setattr(reporting, "DEAD_GRACE", 0.5)
    job = reporting.JobReporting("r", "10.0.0.1", None)
    me = job.recorder.node.node
    mine = NodeRecord(me, "10.0.0.1", 100.0, _record("10.0.0.1", "RUNNING").attempts)
    long_ago = time.monotonic() - 10
    board = _Board([mine, _record("10.0.0.2", "RUNNING")])
    t = time.monotonic()
    job._read_when_all_ended(board, 3, lambda: {"10.0.0.2": long_ago, "10.0.0.3": long_ago})
    assert time.monotonic() - t < 0.3 and board.reads == 1
    # declared dead just now: waited for DEAD_GRACE, not REPORT_GRACE (room for a slow machine)
    monkeypatch.setattr(reporting, "REPORT_GRACE", 5.0)
    board = _Board([mine, _record("10.0.0.2", "RUNNING")])
    now = time.monotonic()
    job._read_when_all_ended(board, 2, lambda: {"10.0.0.2": now})
    assert 0.5 <= time.monotonic() - now < 3.0
    monkeypatch.setattr(reporting, "REPORT_GRACE", 1.0)
    # a dead member that did publish its end counts once; a running one is awaited
    board = _Board([mine, _record("10.0.0.2", "FAILED"), _record("10.0.0.3", "RUNNING")])
    t = time.monotonic()
    job._read_when_all_ended(board, 3, lambda: {"10.0.0.2": long_ago})
    assert time.monotonic() - t >= 1.0 and board.reads > 5
    # ... and so is an agent of the same address as this node, but another process
    board = _Board([mine, _record("10.0.0.1", "RUNNING", pid=2)])
    t = time.monotonic()
    job._read_when_all_ended(board, 2, lambda: {})
    assert time.monotonic() - t >= 1.0


def test_a_member_declared_dead_that_publishes_a_moment_later_is_in_the_report():
    """Declared dead (3 s without a beat) but only stalled: its record, the root cause
    maybe, comes a moment later and is read (the helper review's case)."""
    import threading

    from tierrun.launcher import reporting
    from tierrun.report.board import Attempt, Failure

    job = reporting.JobReporting("r", "10.0.0.1", None)
    mine = NodeRecord(job.recorder.node.node, "10.0.0.1", 100.0, [Attempt(0, world_size=2, workers=1)])
    late = NodeRecord("10.0.0.2:7", "10.0.0.2", 100.0, [Attempt(0, world_size=2, workers=1)])
    declared = time.monotonic()

    def publish():
        time.sleep(0.3)
        late.attempts[-1] = Attempt(0, world_size=2, state="FAILED", workers=1, workers_ended=1,
                                    failures=[Failure(1, 0, -9, 1.0, "killed by signal SIGKILL")])

    threading.Thread(target=publish).start()
    job._read_when_all_ended(_Board([mine, late]), 2, lambda: {"10.0.0.2": declared})
    assert any(a.state == "FAILED" for r in job._others for a in r.attempts)
