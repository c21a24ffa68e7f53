"""Flag parsing: torchrun's and torch_npu_run's spellings, and one-line errors."""

import logging
import os
import subprocess
import sys

import pytest

from tierrun.launcher.args import UsageError, build_parser, normalise
from tierrun.launcher.cli import derived_token


def parse(*argv):
    return normalise(build_parser().parse_args([*argv, "train.py", "--lr", "1"]))


def test_defaults_and_script_args():
    a = parse()
    assert a.rdzv_backend == "tierrun" and a.nnodes == "1:1"
    assert a.training_script == "train.py" and a.training_script_args == ["--lr", "1"]


@pytest.mark.parametrize("flag", ["--nproc_per_node", "--nproc-per-node"])
def test_dash_and_underscore(flag):
    assert parse(flag, "3").nproc_per_node == "3"


def test_pet_environment_fallback(monkeypatch):
    monkeypatch.setenv("PET_NNODES", "2:4")
    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    a = parse()
    assert a.nnodes == "2:4" and a.rdzv_backend == "tierrun"


@pytest.mark.parametrize("argv, backend, rank", [
    ((), "tierrun", 0),
    (("--nnodes", "2", "--node_rank", "1"), "parallel", 1),  # torchrun's default (static) honours it
    (("--nnodes", "2", "--node-rank=0"), "parallel", 0),
    (("--nnodes", "2"), "tierrun", 0),  # no node rank: every node would claim rank 0
    (("--nnodes", "1:2", "--node_rank", "1"), "tierrun", 1),  # an elastic job
    (("--nnodes", "1", "--node_rank", "0"), "tierrun", 0),  # one node: nothing to order
    (("--nnodes", "2", "--node_rank", "1", "--rdzv_backend", "c10d"), "tierrun", 1),  # asked for
    (("--nnodes", "2", "--node_rank", "1", "--rdzv_endpoint", "h"), "tierrun", 1),  # c10d's command (port 29400)
    (("--nnodes", "2", "--node_rank", "1", "--rdzv_endpoint", "h:5000"), "parallel", 1),  # static reads it
])
def test_with_no_backend_given_a_node_rank_is_honoured_as_torchrun_does(argv, backend, rank):
    a = parse(*argv)
    assert (a.rdzv_backend, a.node_rank) == (backend, rank)


@pytest.mark.parametrize("argv, standalone", [
    ((), True),  # as torchrun: a store of its own on a free port, so two such jobs never meet
    (("--nnodes", "1", "--rdzv_backend", "static"), True),
    (("--master_port", "29751"), False),  # a port asked for: that port
    (("--rdzv_endpoint", "h:1"), False),
    (("--rdzv_backend", "c10d"), False),
    (("--nnodes", "1:2"), False),
])
def test_one_node_with_no_port_asked_for_runs_standalone_as_torchrun_does(argv, standalone):
    assert parse(*argv).standalone is standalone


def test_a_pet_rdzv_backend_that_cannot_be_used_is_named_as_written(monkeypatch):
    monkeypatch.setenv("PET_RDZV_BACKEND", "bogus")
    with pytest.raises(UsageError, match="^unknown PET_RDZV_BACKEND=bogus: write one of tierrun,"):
        parse()
    assert parse("--rdzv_backend", "c10d").rdzv_backend == "tierrun"  # (the flag wins)



def test_a_fixed_node_backend_given_min_max_runs_max_nodes_and_says_so(monkeypatch, caplog):
    """torchrun's static and torch_npu_run's parallel backends run MAX nodes of --nnodes MIN:MAX."""
    monkeypatch.setenv("PET_RDZV_BACKEND", "static")
    with caplog.at_level(logging.WARNING, logger="tierrun"):
        a = parse("--nnodes", "1:2")
    assert (a.rdzv_backend, a.nnodes) == ("parallel", "2")
    assert caplog.messages == ["PET_RDZV_BACKEND=static is not elastic: --nnodes 1:2 runs as --nnodes 2 (as torchrun's "
                               "static and torch_npu_run's parallel backends run it); for an elastic job use "
                               "--rdzv_backend tierrun"]


@pytest.mark.parametrize("value", ["disable", "1", "yes"])
def test_a_torch_npu_run_flag_value_other_than_true_or_false_is_false_as_there(value, caplog):
    """torch_npu_run tiers only for ``true`` (any case)."""
    with caplog.at_level(logging.WARNING, logger="tierrun"):
        a = parse("--nnodes", "64", f"--enable_tiered_parallel_tcpstore={value}")
    assert (a.enable_tiered_parallel_tcpstore, a.tiered) == (False, False)
    assert caplog.messages == [f"--enable_tiered_parallel_tcpstore {value} is not true: read as false (no tiering), "
                               "as torch_npu_run reads every value but true; write true (or --tiered) to tier"]
    with pytest.raises(UsageError, match=f"--enable_tiered_parallel_tcpstore {value} .*disagree"):
        parse("--nnodes", "64", f"--enable_tiered_parallel_tcpstore={value}", "--tiered")


def test_pet_rdzv_backend_and_pet_node_rank_are_read(monkeypatch):
    monkeypatch.setenv("PET_RDZV_BACKEND", "static")
    assert parse("--nnodes", "2", "--node_rank", "1").rdzv_backend == "parallel"
    monkeypatch.setenv("PET_RDZV_BACKEND", "torch-c10d")
    assert parse("--nnodes", "2").rdzv_backend == "c10d"
    monkeypatch.delenv("PET_RDZV_BACKEND")
    monkeypatch.setenv("PET_NODE_RANK", "1")
    a = parse("--nnodes", "2")
    assert (a.rdzv_backend, a.node_rank) == ("parallel", 1)


@pytest.mark.parametrize("given, resolved", [("c10d", "tierrun"), ("static", "parallel"),
                                             ("parallel", "parallel"), ("torch-c10d", "c10d"),
                                             ("torch-static", "static"), ("etcd-v2", "etcd-v2")])
def test_backend_mapping(given, resolved):
    assert parse("--rdzv_backend", given, "--nnodes", "2").rdzv_backend == resolved


def test_tiered_flag_spellings(monkeypatch):
    assert parse("--enable_tiered_parallel_tcpstore", "true").enable_tiered_parallel_tcpstore is True
    assert parse("--enable-tiered-parallel-tcpstore=false").enable_tiered_parallel_tcpstore is False
    monkeypatch.setenv("PET_ENABLE_TIERED_PARALLEL_TCPSTORE", "true")
    assert parse().enable_tiered_parallel_tcpstore is True


def test_the_tiered_flag_falls_back_on_pet_tiered_and_a_flag_wins(monkeypatch):
    monkeypatch.setenv("PET_TIERED", "true")
    a = parse("--nnodes", "2")
    assert a.tiered is True and not a.tiering.auto
    assert parse("--nnodes", "2", "--no-tiered").tiered is False
    monkeypatch.setenv("PET_TIERED", "0")
    a = parse("--nnodes", "64")
    assert a.tiered is False and not a.tiering.auto
    monkeypatch.setenv("PET_TIERED", "maybe")
    with pytest.raises(UsageError, match="PET_TIERED='maybe' is not a boolean: write PET_TIERED=true"):
        parse()
    assert parse("--nnodes", "2", "--tiered").tiered is True  # (a flag wins over any PET_* value)
    helped = subprocess.run([sys.executable, "-m", "tierrun", "--help"], capture_output=True, text=True,
                            env={**os.environ, "PET_TIERED": "maybe"})
    assert helped.returncode == 0 and "--no-tiered" in helped.stdout, helped.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rdzv_backend", "tierrun-etcd", "--nnodes", "2:3"], "tierrun-etcd needs --rdzv_endpoint: etcd's"),
        (["--nnodes", "3:2"], "0 < MIN <= MAX"),
        (["--nnodes", "x"], "is not a number"),
        (["--rdzv_backend", "zookeeper"], "write one of"),
        (["--standalone", "--nnodes", "2"], "drop --standalone"),
        (["--monitor_interval", "-1"], "--monitor_interval -1: write a number of seconds above 0"),
        (["--rdzv_backend", "parallel", "--nnodes", "2", "--node_rank", "2"], "outside 0..1"),
        (["--store-workers", "0"], "--store-workers 0: write 1 to"),
        (["--store-workers", "100000"], "4 per core this node may use"),
        (["--rdzv_backend", "torch-c10d", "--nnodes", "2", "--tiered"],
         "--tiered needs a tierrun rendezvous backend, which starts the node proxies, not --rdzv_backend torch-c10d"),
        (["--rdzv_backend", "torch-static", "--nnodes", "2", "--enable_tiered_parallel_tcpstore", "true"],
         "not --rdzv_backend torch-static .torch.s own.: use tierrun"),
        (["--rdzv_backend", "tierrun-etcd", "--rdzv_endpoint", "h:2379", "--store-fanout", "4", "--tiered"],
         "not --rdzv_backend tierrun-etcd: use tierrun"),
        (["--rdzv_backend", "parallel", "--nnodes", "4", "--store-fanout", "4", "--no-tiered"],
         "--store-fanout 4 stacks .* but --no-tiered turns tiering off: drop one of them"),
        (["--nnodes", "2:4", "--store-fanout", "4", "--enable_tiered_parallel_tcpstore", "false"],
         "but --enable_tiered_parallel_tcpstore false turns tiering off"),
        (["--nnodes", "4", "--tiered", "--enable_tiered_parallel_tcpstore", "false"], "disagree: give one of them"),
        (["--store-fanout", "1"], "write 2 or more"),
        (["--rdzv_backend", "torch-c10d", "--store_workers", "2"], "needs a tierrun rendezvous backend"),
        # --rdzv_conf tiered=/store_fanout= count as the flags do: a contradiction is refused, not
        # settled by whichever the handlers happen to read
        (["--nnodes", "64", "--no-tiered", "--rdzv_conf", "tiered=1"],
         "--no-tiered and --rdzv_conf tiered=1 disagree: give one of them"),
        (["--nnodes", "4", "--tiered", "--rdzv_conf", "tiered=0"], "--tiered and --rdzv_conf tiered=0 disagree"),
        (["--nnodes", "4", "--store-fanout", "4", "--rdzv_conf", "tiered=0"],
         "--store-fanout 4 stacks .* but --rdzv_conf tiered=0 turns tiering off: drop one of them"),
        (["--nnodes", "64", "--no-tiered", "--rdzv_conf", "store_fanout=8"],
         "--rdzv_conf store_fanout=8 stacks .* but --no-tiered turns tiering off"),
        (["--nnodes", "64", "--rdzv_conf", "tiered=maybe"], "tiered=maybe is not a boolean: write tiered=true or "),
        (["--nnodes", "64", "--rdzv_conf", "store_fanout=x"], "store_fanout=x is not a whole number: write"),
        (["--nnodes", "64", "--rdzv_conf", "store_fanout=1"], "store_fanout=1: write 2 or more"),
        (["--rdzv_backend", "tierrun-etcd", "--rdzv_endpoint", "h:2379", "--rdzv_conf", "store_fanout=4"],
         "--rdzv_conf store_fanout=4 needs a backend .* not --rdzv_backend tierrun-etcd"),
        (["--nnodes", "64", "--rdzv_conf", "tiered="], "--rdzv_conf tiered=: .* must have a value"),
    ],
)
def test_contradictions_say_what_to_write(argv, message):
    with pytest.raises(UsageError, match=message):
        parse(*argv)


def test_store_fanout_on_the_elastic_backend_and_its_c10d_alias():
    for backend in ("tierrun", "c10d"):
        args = parse("--rdzv_backend", backend, "--nnodes", "2:4", "--tiered", "--store-fanout", "2")
        assert args.rdzv_backend == "tierrun" and args.store_fanout == 2


@pytest.mark.parametrize("argv, tiered, fanout, auto", [
    (["--nnodes", "31"], False, 0, False),  # below the crossover: flat
    (["--nnodes", "32"], True, 0, True),
    (["--nnodes", "63", "--rdzv_backend", "parallel"], True, 0, True),
    (["--nnodes", "64", "--rdzv_backend", "parallel"], True, 8, True),
    (["--nnodes", "2:64", "--rdzv_backend", "c10d"], True, 8, True),  # elastic: by its maximum
    (["--nnodes", "64", "--no-tiered"], False, 0, False),  # flags win
    (["--nnodes", "64", "--enable_tiered_parallel_tcpstore", "false"], False, 0, False),
    (["--nnodes", "64", "--enable_tiered_parallel_tcpstore", "true"], True, 0, False),  # torch_npu_run's layout
    (["--nnodes", "2", "--tiered"], True, 0, False),
    (["--nnodes", "4", "--store-fanout", "2"], True, 2, False),  # a tree implies tiering
    (["--nnodes", "64", "--store-fanout", "0"], True, 0, True),  # "no tree"; tiering by size
    (["--nnodes", "64", "--store-workers", "2"], False, 0, False),  # the flat store's front-ends asked for
    (["--nnodes", "64", "--rdzv_conf", "tiered=0"], False, 0, False),  # torchrun's spelling counts too
    (["--nnodes", "64", "--rdzv_conf", "tiered=no"], False, 0, False),  # (torch's boolean spellings)
    (["--nnodes", "8", "--rdzv_conf", "tiered=yes"], True, 0, False),
    (["--nnodes", "8", "--rdzv_conf", "tiered=TRUE"], True, 0, False),
    (["--nnodes", "64", "--rdzv_conf", "store_fanout=0"], True, 0, True),  # as --store-fanout 0: "no tree"
    (["--nnodes", "8", "--rdzv_conf", "store_fanout=00"], False, 0, False),
    (["--nnodes", "8", "--rdzv_conf", "store_fanout=4"], True, 4, False),  # as --store-fanout 4
    (["--nnodes", "64", "--store-fanout", "8", "--rdzv_conf", "store_fanout=08"], True, 8, False),  # (a number)
    (["--nnodes", "64", "--rdzv_backend", "torch-c10d"], False, 0, False),  # torch's agents: no tier
    (["--nnodes", "64", "--rdzv_backend", "tierrun-etcd", "--rdzv_endpoint", "h:2379"], False, 0, False),
])
def test_tiering_is_chosen_by_the_jobs_size_unless_a_flag_says(argv, tiered, fanout, auto):
    from tierrun.launcher import tiering

    a = parse(*argv)
    assert (a.tiered, a.store_fanout, a.tiering.auto) == (tiered, fanout, auto)
    assert (tiering.TIERED_FROM_NODES, tiering.TREE_FROM_NODES, tiering.AUTO_FANOUT) == (32, 64, 8)


def test_a_tiering_chosen_by_size_reaches_the_handlers_and_is_said(caplog):
    """No flag, 64 nodes: the rendezvous gets tiered=1 and store_fanout=8, as from
    ``--tiered --store-fanout 8``; the node says what was chosen and how to turn it off,
    and the derived token (no secret given) at INFO, not as a warning: the flat store it
    replaces authenticates nothing."""
    import logging

    from tierrun.launcher.cli import prepare
    from tierrun.settings import Settings

    with caplog.at_level(logging.INFO, logger="tierrun"):
        config, *_ = prepare(["--nnodes", "64", "--rdzv_backend", "parallel", "--master_addr", "127.0.1.1",
                              "--local_addr", "127.0.1.2", "train.py"], Settings())
    assert config.rdzv_configs["tiered"] == "1" and config.rdzv_configs["store_fanout"] == "8"
    said = {r.levelname: r.getMessage() for r in caplog.records}
    assert said["INFO"]  # (both lines at INFO)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert ("node 127.0.1.2: tiered wire-up in a tree of fanout 8, chosen for --nnodes 64" in caplog.text
            and "--no-tiered turns it off" in caplog.text and "derived from the job id" in caplog.text)
    # what it costs and changes, right for a tree too (the store host serves F links, not one per node)
    assert "a store proxy per node; the store host serves at most 8 links" in caplog.text, caplog.text


def test_a_tiering_chosen_by_size_without_a_tree_says_one_link_per_node(caplog):
    import logging

    from tierrun.launcher.cli import prepare
    from tierrun.settings import Settings

    with caplog.at_level(logging.INFO, logger="tierrun"):
        prepare(["--nnodes", "32", "--rdzv_backend", "parallel", "--master_addr", "127.0.1.1",
                 "--local_addr", "127.0.1.2", "train.py"], Settings(token="t"))
    assert ("node 127.0.1.2: tiered wire-up, chosen for --nnodes 32 (a store proxy per node; the store host "
            "serves one link per node" in caplog.text), caplog.text


def test_progress_keys_of_rdzv_conf_are_not_overridden_by_the_flags_defaults():
    from tierrun.launcher.cli import prepare
    from tierrun.settings import Settings

    config, *_ = prepare(["--standalone", "--rdzv_conf", "progress=off,progress_interval=2", "train.py"], Settings())
    assert config.rdzv_configs["progress"] == "off" and config.rdzv_configs["progress_interval"] == "2"
    config, *_ = prepare(["--standalone", "--progress", "log", "train.py"], Settings())
    assert config.rdzv_configs["progress"] == "log"


@pytest.mark.parametrize("argv", [("--nnodes", "3:2"), ("--tiered=maybe",),
                                  ("--max_restarts", "abc"), ("--no-such-flag",),
                                  ("--standalone", "--nproc_per_node", "xpu")])
def test_cli_error_is_one_line_and_exit_code_2(argv):
    """Flags tierrun checks and flags argparse refuses alike: one line, no usage text."""
    r = subprocess.run([sys.executable, "-m", "tierrun", *argv, "x.py"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("tierrun: error:"), r.stderr


def test_nproc_per_node_values():
    from tierrun.launcher.devices import resolve_nproc_per_node

    assert resolve_nproc_per_node("4") == "4"
    assert resolve_nproc_per_node("cpu") == "cpu"
    assert resolve_nproc_per_node("auto") == "auto"  # no accelerator here: torch counts CPUs
    with pytest.raises(UsageError, match="no CUDA GPU or Ascend NPU"):
        resolve_nproc_per_node("gpu")
    with pytest.raises(UsageError, match="no Intel XPU"):  # (not torch's traceback)
        resolve_nproc_per_node("xpu")
    with pytest.raises(UsageError, match="write a number"):
        resolve_nproc_per_node("lots")


@pytest.mark.parametrize("conf, fanout", [("store_fanout=2", "2"), ("join_timeout=5", None)])
def test_rdzv_conf_store_fanout_with_the_tiered_flag_is_kept(conf, fanout):
    """``--tiered --rdzv_conf store_fanout=F`` builds the tree of fanout F (the guide's
    spelling for torchrun users works with tierrun's own command too): ``--tiered``
    without ``--store-fanout`` adds no store_fanout=0 that would silently win."""
    from tierrun.launcher.cli import prepare
    from tierrun.settings import Settings

    config, *_ = prepare(["--nnodes", "2:4", "--tiered", "--rdzv_endpoint", "127.0.0.1:29400",
                          "--rdzv_conf", conf, "train.py"], Settings(token="t"))
    assert config.rdzv_configs.get("store_fanout") == fanout and config.rdzv_configs["tiered"] == "1"


@pytest.mark.parametrize("conf, tiered, fanout", [
    ("tiered=yes", "1", None), ("tiered=t", "1", None), ("store_fanout=08", "1", "8"), ("store_fanout=0", "1", "0"),
])
def test_what_the_handlers_read_is_what_the_launcher_chose(conf, tiered, fanout):
    """A spelling the launcher reads as tiered (torch's booleans, a fanout with a leading
    zero) reaches the handlers as tiered=1 and the fanout it read, at 64 nodes too:
    ``tiered=yes`` ran a flat store, and ``store_fanout=0`` turned off the tiering that
    ``--store-fanout 0`` keeps."""
    from tierrun.launcher.cli import prepare
    from tierrun.settings import Settings

    config, *_ = prepare(["--nnodes", "64", "--rdzv_endpoint", "127.0.0.1:29400", "--rdzv_conf", conf,
                          "train.py"], Settings(token="t"))
    assert (config.rdzv_configs.get("tiered"), config.rdzv_configs.get("store_fanout")) == (tiered, fanout)


def test_the_store_fanout_flag_and_rdzv_conf_must_agree():
    from tierrun.launcher.cli import prepare
    from tierrun.settings import Settings

    with pytest.raises(UsageError, match="--store-fanout 4 and --rdzv_conf store_fanout=2"):
        prepare(["--nnodes", "2:4", "--tiered", "--store-fanout", "4", "--rdzv_endpoint", "127.0.0.1:29400",
                 "--rdzv_conf", "store_fanout=2", "train.py"], Settings(token="t"))


def test_the_derived_token_does_not_depend_on_how_a_node_names_the_store_host():
    """Without a secret, node 0 may name itself localhost and the others name it by
    address or host name: they must derive the same token. Another port or job id is
    another job's."""
    same = {derived_token("job", e) for e in ("localhost:29500", "10.0.0.1:29500", "node0.cluster:29500",
                                              "[fd00::1]:29500", " node0:029500")}
    assert len(same) == 1
    assert derived_token("job", "node0:29501") not in same and derived_token("job2", "node0:29500") not in same
    assert derived_token("job", "node0") == derived_token("job", "10.0.0.1")  # (the backend's default port)
    assert derived_token("job", "node0") not in same


@pytest.mark.parametrize("backend, spellings", [
    # the elastic backend reads a missing port as torch's c10d does: 29400
    ("tierrun", ("localhost", "node0:29400", "[fd00::1]", "fd00::1:29400", "[fd00::1]:29400")),
    # etcd's client URLs, with or without a scheme, a path or the default port, in any order
    ("tierrun-etcd", ("http://etcd:2379", "etcd:2379", "etcd", "https://[fd00::1]:2379/", "10.0.0.5",
                      "http://etcd1:2379, http://etcd2:2379", "etcd2:2379,etcd1")),
])
def test_the_derived_token_reads_the_port_as_the_backend_does(backend, spellings):
    """A node that leaves out the backend's default port, or writes etcd's endpoints as
    URLs or in another order, is in the same job as one that does not."""
    assert len({derived_token("job", e, backend) for e in spellings}) == 1, spellings
    other = "etcd:2380" if backend == "tierrun-etcd" else "node0:29401"
    assert derived_token("job", other, backend) != derived_token("job", spellings[0], backend)


def test_a_port_that_is_not_a_number_is_left_to_the_backend_to_refuse():
    """(Unicode digits pass str.isdigit but not int: no traceback from the launcher.)"""
    assert derived_token("job", "node0:²") == derived_token("job", "node0:²")
    assert derived_token("job", "node0:x", "tierrun") != derived_token("job", "node0", "tierrun")


@pytest.mark.parametrize("env, argv, message", [
    ({"PET_TIERED": "yes", "PET_ENABLE_TIERED_PARALLEL_TCPSTORE": "false"}, [],
     "PET_TIERED=yes and PET_ENABLE_TIERED_PARALLEL_TCPSTORE=false disagree"),
    ({"PET_TIERED": "false", "PET_STORE_FANOUT": "4"}, [],
     "PET_STORE_FANOUT=4 stacks the node proxies of tiered wire-up in a tree, but PET_TIERED=false turns"),
    # a flag given on the command line is named as written, whatever the environment says
    ({"PET_TIERED": "false"}, ["--tiered", "--rdzv_conf", "tiered=0"], "--tiered and --rdzv_conf tiered=0 disagree"),
])
def test_a_contradiction_names_the_environment_variable_that_said_it(monkeypatch, env, argv, message):
    """A setting that came from a PET_* variable is named as such: the user wrote no flag."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=message):
        parse("--nnodes", "8", *argv)


@pytest.mark.parametrize("env, argv, tiered, fanout", [
    ({"PET_TIERED": "true"}, ["--enable_tiered_parallel_tcpstore", "false"], False, 0),
    ({"PET_ENABLE_TIERED_PARALLEL_TCPSTORE": "false"}, ["--tiered"], True, 0),
    ({"PET_TIERED": "1"}, ["--rdzv_conf", "tiered=0"], False, 0),
    ({"PET_TIERED": "false"}, ["--store-fanout", "4"], True, 4),
    ({"PET_STORE_FANOUT": "4"}, ["--no-tiered"], False, 0),
    ({"PET_STORE_FANOUT": "4"}, ["--rdzv_conf", "store_fanout=2"], True, 2),
])
def test_the_command_line_wins_over_pet_settings_it_contradicts(monkeypatch, env, argv, tiered, fanout):
    """PET_* values are defaults, as torchrun reads them: a flag or an --rdzv_conf key
    that says otherwise wins, even when the variable has another name (PET_TIERED and
    --enable_tiered_parallel_tcpstore); two PET_* values that disagree stop the launch."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    a = parse("--nnodes", "8", *argv)
    assert (a.tiered, a.store_fanout or 0) == (tiered, fanout)
