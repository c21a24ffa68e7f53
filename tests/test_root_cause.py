"""The failure report blames the rank that died, not the peers whose collectives failed
because it did: 3 simulated nodes x 2 Gloo workers, one rank exits (``sys.exit(3)``),
is SIGKILLed or segfaults while the others block in an all_reduce with it. The agents
watch with a 2 s monitor interval: the dead rank is timed by its exit, not by when its
agent noticed it."""

import json
import re

import pytest

from launch import SCRIPTS, finish, free_port, tierrun

CASES = {  # how: (global rank, what the report says)
    "exit": (3, "exited with code 3"),  # node rank 1, local rank 1
    "kill": (4, "killed by signal SIGKILL"),  # node rank 2, local rank 0
    "segv": (1, "killed by signal SIGSEGV"),  # node rank 0 (the store host), local rank 1
}


@pytest.mark.parametrize("how", list(CASES))
def test_the_report_blames_the_rank_that_died(tmp_path, how):
    rank, said = CASES[how]
    node, local = divmod(rank, 2)
    port = free_port()
    logs = [tmp_path / f"node{k}.log" for k in range(3)]
    procs = [tierrun("--nnodes", 3, "--nproc_per_node", 2, "--rdzv_backend", "parallel",
                     "--master_addr", "127.0.1.1", "--master_port", port, "--node_rank", k,
                     "--local_addr", f"127.0.1.{k + 1}", "--monitor_interval", 2,
                     "--log_dir", tmp_path / f"logs{k}", SCRIPTS / "die_in_collective.py",
                     log=logs[k], env={"DIE_RANK": str(rank), "DIE_HOW": how})
             for k in range(3)]
    codes = finish(procs)
    texts = [log.read_text() for log in logs]
    assert all(c != 0 for c in codes), codes
    dying = float(re.search(r"DYING rank=\d+ t=(\S+)", texts[node]).group(1))

    blame = f"first failure: rank {rank} (local rank {local}) on node 127.0.1.{node + 1} (node rank {node}) at "
    for text in texts:  # every node's report, built from every agent's record
        line = next((s for s in text.splitlines() if "first failure:" in s), None)
        assert line is not None and blame in line and line.endswith(said), text[-4000:]
        if how == "exit":  # where the script exited (Python prints no traceback for it)
            assert "    |     sys.exit(3)\n    | SystemExit: 3\n" in text, text[-4000:]
        # torch's @record has no error file of the launcher's to copy the failure to: it
        # said so at ERROR on every node, after the report
        assert "no error file defined for parent" not in text, text[-4000:]
        assert "5 failure(s) in collectives after it (consequences)" in text or \
            "worker(s) stopped by their agent" in text, text[-4000:]
    # torch's own summary, the launcher's last lines, agrees on every node: on the dying
    # rank's node it names that rank; on the others (whose own workers failed only
    # because it died, and torch would name one of them) that rank on its node
    for k, text in enumerate(texts):
        root = text.split("Root Cause (first observed failure):")[1]
        assert f"rank      : {rank} (local_rank: {local})" in root, text[-3000:]
        if k != node:
            assert f"host      : 127.0.1.{node + 1} (node rank {node}; this node's failures followed it)" in root
            assert root.count("rank      :") == 1 and said in root, text[-3000:]
            failures = text.split("Root Cause (first observed failure):")[0].rsplit("Failures:", 1)[1]
            assert failures.count("rank      :") >= 1, text[-3000:]  # this node's own, listed there

    report = json.loads(next((tmp_path / "logs0").glob("tierrun_failure_*.json")).read_text())
    first = report["first"]
    assert (first["failure"]["global_rank"], first["addr"], first["consequence"]) == (rank, f"127.0.1.{node + 1}", False)
    assert sorted(fr["failure"]["global_rank"] for fr in report["failed"]) == list(range(6))
    assert all(fr["consequence"] for fr in report["failed"][1:]), report["failed"]
    # timed by its exit: a kill or a segfault within milliseconds of the DYING line (the
    # agent looks every 2 s); sys.exit first runs Python's and Gloo's clean-up
    late = first["failure"]["time"] - dying
    assert 0 <= late < (1.5 if how == "exit" else 0.5), late
