"""``tierrun [flags] script.py [args]``: torchrun's launcher on tierrun's store."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket
import sys
import uuid
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args

from .. import rendezvous, torchrun_plugin
from ..extras import MissingExtraError, require
from ..link.auth import new_token
from ..rendezvous.conf import conf_flag
from ..rendezvous.handler_base import JobStoppedError
from ..rendezvous.sockets import hosts_store
from ..rendezvous.spare import SpareNotNeededError
from ..frontend import FrontEndConfig
from ..server.open_files import store_host_shortfall
from ..settings import Settings, SettingsError
from .args import TIERRUN_BACKENDS, UsageError, build_parser, normalise
from .devices import resolve_nproc_per_node
from .reporting import JobFailedError, JobReporting

log = logging.getLogger("tierrun")

#: Said once per node when a tiered job across nodes has no secret (torch_npu_run's flags).
DERIVED_TOKEN_WARNING = (
    "node %s: no job token (TIERRUN_TOKEN_FILE or TIERRUN_TOKEN): the store links use one "
    "derived from the job id %r and the port of the store endpoint %s, which guards against "
    "accidents, not against attackers (every command line shows both). For a secret, give every "
    "node the same one in the file TIERRUN_TOKEN_FILE names (guide: Security)."
)

#: Said once per node, at INFO, when the job's size chose its tiering (``tiering.choose``).
AUTO_TIERING = ("node %s: %s, chosen for --nnodes %s (a store proxy per node; the store host serves %s, and "
                "its port takes node links only); --no-tiered turns it off, --store-fanout F sets the tree")


def derived_token(run_id: str, endpoint: str, backend: str | None = None) -> str:
    """The job token of a tiered job given no secret: a hash of its id and its endpoint's
    port(s), which every node knows from its flags, and so does anyone who sees them.

    Not the host: nodes name the store host as they reach it (node 0 may say
    ``localhost``, the others its address or a name), and a node reaches only the store
    host it was told of, so the host would guard against nothing but spellings.
    ``backend`` (``--rdzv_backend``, mapped): whose default port an endpoint without one
    stands for."""
    return hashlib.sha256(f"tierrun:{run_id}:{endpoint_ports(endpoint, backend)}".encode()).hexdigest()


#: the port an endpoint without one stands for, per backend (parallel's needs one):
#: tierrun's elastic backend reads it as torch's c10d does; tierrun-etcd, etcd's client port
DEFAULT_PORTS = {"tierrun": rendezvous.elastic.DEFAULT_PORT, "tierrun-etcd": 2379}


def endpoint_ports(endpoint: str, backend: str | None = None) -> str:
    """The ports of ``endpoint``'s comma-separated items, as ``backend`` reads them
    (``host:port``, ``[v6]:port``, torch's ``v6:port``; for tierrun-etcd, URLs too),
    sorted and once each: ``localhost``, ``node0:29400`` and ``[::1]`` give ``29400`` for
    tierrun. An item whose port cannot be read, or that has none for a backend with no
    default, gives ``-``: the backend refuses it, not this."""
    default = DEFAULT_PORTS.get(backend or "")
    ports = set()
    for item in (e.strip() for e in endpoint.split(",")):
        if not item:
            continue
        port: int | str | None = "-"
        if "://" in item or backend == "tierrun-etcd":  # (as EtcdOptions.parse reads it)
            try:
                port = urlsplit(item if "://" in item else f"http://{item}").port
            except ValueError:
                pass
        elif item.startswith("[") and item.endswith("]"):  # (an IPv6 address alone)
            port = None
        else:  # (torch's parse_rendezvous_endpoint: after the last colon)
            _, sep, after = item.rpartition(":")
            if not sep:
                port = None
            elif after.isascii() and after.isdigit():
                port = int(after)
        ports.add(str(port if port is not None else default if default is not None else "-"))
    return ",".join(sorted(ports))


def prepare(argv: list[str], settings: Settings):
    """Parse and check the flags; return torch's (LaunchConfig, entrypoint, args) and
    this launch's reporting, attached to the agent. The rendezvous handlers get
    ``settings`` (with a job token it makes up), not the environment. Raises
    ``UsageError``, ``SettingsError`` (a token file that is empty or cannot be read),
    ``MissingExtraError``."""
    args = normalise(build_parser().parse_args(argv))
    if args.rdzv_backend == "tierrun-etcd":
        require("etcd", "--rdzv_backend tierrun-etcd", ("requests", "etcd3gw"))
    elif args.rdzv_backend in ("etcd", "etcd-v2"):
        require("etcd", f"torch's --rdzv_backend {args.rdzv_backend}", ("etcd",))
    args.nproc_per_node = resolve_nproc_per_node(args.nproc_per_node)
    if args.standalone:
        args.rdzv_backend = "tierrun"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
        args.local_addr = args.local_addr or "localhost"
    if args.master_port is None:
        args.master_port = 29500
    if args.rdzv_backend in ("parallel", "static") and not args.rdzv_endpoint:
        args.rdzv_endpoint = f"{args.master_addr}:{args.master_port}"
    elif args.rdzv_backend == "tierrun" and not args.rdzv_endpoint:
        # torch_npu_run style: the store host is --master_addr
        args.rdzv_endpoint = f"{args.master_addr}:{args.master_port}"
    if args.rdzv_backend == "parallel":
        conf = f"rank={args.node_rank}"
        args.rdzv_conf = f"{args.rdzv_conf},{conf}" if args.rdzv_conf else conf
        args.node_rank = 0  # now in rdzv_conf; keeps torch from warning it is ignored
    if args.tiering.auto:
        links = f"at most {args.store_fanout} links" if args.store_fanout else "one link per node"
        log.info(AUTO_TIERING, args.local_addr or socket.gethostname(), args.tiering.describe(), args.nnodes, links)
    if args.tiered:
        if _job_token(settings, args.local_addr) is None:
            if args.standalone or args.nnodes.split(":")[-1] == "1":
                settings = replace(settings, token=new_token())  # one node: nobody else needs it
            else:
                # torch_npu_run's flags carry no secret; stay drop-in, but say what it costs
                # (chosen by size, not asked for: still more than a flat store's none)
                settings = replace(settings, token=derived_token(args.rdzv_id, args.rdzv_endpoint, args.rdzv_backend))
                (log.info if args.tiering.auto else log.warning)(
                    DERIVED_TOKEN_WARNING, args.local_addr or socket.gethostname(), args.rdzv_id, args.rdzv_endpoint)
        if args.store_workers > 1:
            log.warning("--store-workers has no effect with tiered wire-up: the store host sees "
                        "only the nodes' links")
        # (as normalise read them: a later key wins over the user's tiered=yes or store_fanout=08;
        # a store_fanout of --rdzv_conf that is 0, here read as such, stands)
        conf = "tiered=1" + (f",store_fanout={args.store_fanout}" if args.store_fanout else "")
        args.rdzv_conf = f"{args.rdzv_conf},{conf}" if args.rdzv_conf else conf
    if args.rdzv_backend in TIERRUN_BACKENDS:  # (first: a key of --rdzv_conf, as torchrun passes them, wins)
        conf = (f"progress={args.progress},progress_interval={args.progress_interval},"
                f"store_workers={args.store_workers}")
        args.rdzv_conf = f"{conf},{args.rdzv_conf}" if args.rdzv_conf else conf
    elif args.timeline:
        log.warning("--timeline needs a tierrun rendezvous backend (tierrun or parallel); "
                    "with --rdzv_backend %s no timeline is written", args.rdzv_backend)
    torchrun_plugin.register(settings)
    config, entrypoint, cmd_args = config_from_args(args)
    if args.rdzv_backend in TIERRUN_BACKENDS:  # (as torch resolved --nproc_per_node)
        config.rdzv_configs["local_world_size"] = config.nproc_per_node
        config.rdzv_configs["monitor_interval"] = config.monitor_interval
        short = store_host_shortfall(config.max_nodes, config.nproc_per_node, args.tiered, args.store_fanout,
                                     args.store_workers, FrontEndConfig().max_connections)
        if short and _may_host(args.rdzv_backend, config.rdzv_configs, args.rdzv_endpoint, args.local_addr):
            log.warning("node %s: %s", args.local_addr or socket.gethostname(), short)
    reporting = JobReporting(config.run_id, config.local_addr, Path(args.timeline) if args.timeline else None,
                             local_workers=config.nproc_per_node)
    config.event_log_handler = reporting.install(config.event_log_handler)
    rendezvous.on_handler_created[:] = [reporting.handler_created]
    if entrypoint == sys.executable and cmd_args[:1] == ["-u"]:
        # record uncaught exceptions of scripts without @record, for the failure report
        cmd_args = ["-u", "-m", "tierrun.launcher.worker_main", *cmd_args[1:]]
    return config, entrypoint, cmd_args, reporting


def _may_host(backend: str, conf: dict, endpoint: str, local_addr: str | None) -> bool:
    """Whether this node may host the job's store: node rank 0 of a static job; under
    the elastic backends, a node not told ``is_host=false`` (tierrun's: the endpoint's
    node, as torch's c10d infers it). Where the early open-files line is said."""
    if backend == "parallel":
        return str(conf.get("rank", "0")) == "0"
    is_host = conf_flag(conf, "is_host")
    if is_host is not None or backend == "tierrun-etcd":
        return is_host is not False
    return hosts_store(endpoint.rpartition(":")[0].strip("[]"), local_addr)


def _job_token(settings: Settings, local_addr: str | None) -> bytes | None:
    """The job token the environment gives (``Settings.job_token``); raises
    ``SettingsError`` saying which node cannot read its token file, and what to check."""
    node = local_addr or socket.gethostname()
    try:
        return settings.job_token()
    except SettingsError as e:
        raise SettingsError(f"node {node}: {e}") from None
    except OSError as e:
        raise SettingsError(
            f"node {node}: cannot read the job token file "
            f"$TIERRUN_TOKEN_FILE={settings.token_file}: {e.strerror or e}. Check that the file (a "
            "mounted Secret, a file written before srun) exists on this node and that this user "
            "can read it") from None


def _script_name(cmd_args: list[str]) -> str:
    """What the user launched (torch would name the worker_main module)."""
    rest = cmd_args[3:] if cmd_args[1:3] == ["-m", "tierrun.launcher.worker_main"] else cmd_args
    rest = rest[1:] if rest[:1] == ["-m"] else rest
    return os.path.basename(rest[0]) if rest else "script"


class _NoParentErrorFile(logging.Filter):
    """Drops torch's "no error file defined for parent" (logged at ERROR by ``@record``
    on every node of a failed job launched with no error file of its own: the usual
    case, where it is noise after the failure report; with ``TORCHELASTIC_ERROR_FILE``
    set, the failure is copied there and nothing is said)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("no error file defined for parent")


@record
def main(argv: list[str]) -> int:
    logging.basicConfig(format="[tierrun] %(levelname)s %(message)s")
    logging.getLogger("torch.distributed.elastic.multiprocessing.errors.error_handler").addFilter(_NoParentErrorFile())
    try:
        settings = Settings.take_from_env()  # (secrets out of the environment the workers copy)
        logging.getLogger("tierrun").setLevel(settings.log_level)
        config, entrypoint, cmd_args, reporting = prepare(argv, settings)
    except (UsageError, SettingsError) as e:
        print(f"tierrun: error: {e}", file=sys.stderr)
        return 2
    except MissingExtraError as e:
        print(f"tierrun: error: {e}", file=sys.stderr)
        return 1
    try:
        elastic_launch(config=config, entrypoint=entrypoint)(*cmd_args)
    except ChildFailedError as e:
        if reporting.handler is not None and reporting.handler.store_lost is not None:
            # the workers failed because the job lost its store (noticed at shutdown)
            print(f"tierrun: error: {reporting.handler.store_lost}", file=sys.stderr)
            return 1
        report = reporting.report_failure(config.logs_specs.root_log_dir)
        failures = reporting.torch_failures_in_report_order(report, e.failures)
        raise JobFailedError(_script_name(cmd_args), failures, report) from None
    except SpareNotNeededError as e:  # (nothing failed: torch's agent ends such a node quietly too)
        print(f"tierrun: {e}", file=sys.stderr)
        return 0
    except (RendezvousError, JobStoppedError) as e:  # (timed out, closed, store lost: one line)
        print(f"tierrun: error: {e}", file=sys.stderr)
        return 1
    except SignalException as e:  # torch's agent has stopped the workers
        if reporting.handler is not None:
            reporting.handler.leave(f"received {signal.Signals(e.sigval).name}")
        raise
    return 0
