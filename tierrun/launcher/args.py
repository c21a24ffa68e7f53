"""Command-line flags: torchrun's own parser, extended with torch_npu_run's flags.

Every torchrun flag keeps its spelling (dash and underscore) and its ``PET_*``
environment fallback, because the parser *is* torchrun's.
"""

from __future__ import annotations

import argparse
import logging
import os

from torch.distributed.argparse_util import env
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.run import _parse_rendezvous_config, get_args_parser

from ..rendezvous.conf import RendezvousSettingError, conf_flag
from .tiering import choose

log = logging.getLogger("tierrun")

#: rendezvous backends whose name maps to tierrun's own, unless ``torch-`` is prefixed
BACKEND_ALIASES = {"c10d": "tierrun", "static": "parallel"}
TIERRUN_BACKENDS = ("tierrun", "parallel", "tierrun-etcd")
TORCH_BACKENDS = ("torch-c10d", "torch-static", "etcd", "etcd-v2")


class UsageError(ValueError):
    """A wrong or contradictory flag; the message says what to write instead."""


def parse_bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{value}'")


class NotABoolean(str):
    """A value of ``--enable_tiered_parallel_tcpstore`` other than true or false:
    torch_npu_run reads every value but ``true`` (any case) as false, and so does
    tierrun, saying so."""


def parse_npu_flag(value: str) -> bool | NotABoolean:
    v = value.strip().lower()
    return v == "true" if v in ("true", "false") else NotABoolean(value)


class InvalidEnvSetting(str):
    """A ``PET_*`` value that is not one its flag takes: the default it gives, refused by
    ``normalise`` (not when the parser is built, so ``--help`` still works, and a flag
    given on the command line wins over it, as over any ``PET_*`` value)."""


class _RemembersGiven(argparse.Action):
    """Notes on the namespace (``flags_given``) that the flag itself was given, so a
    message can name what the user wrote rather than a ``PET_*`` value."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, option_string)  # type: ignore[misc]
        namespace.flags_given = getattr(namespace, "flags_given", set()) | {self.dest}


class EnvBooleanOptionalAction(_RemembersGiven, argparse.BooleanOptionalAction):
    """``--x`` / ``--no-x`` with torchrun's ``PET_X`` fallback (true or false, in
    ``parse_bool``'s spellings), read when the parser is built, as torch's ``env`` does.
    Another value gives an :class:`InvalidEnvSetting` default."""

    def __init__(self, option_strings, dest, default=None, **kwargs) -> None:
        name = f"PET_{dest.upper()}"
        value = os.environ.get(name)
        if value is not None and value.strip():
            try:
                default = parse_bool(value)
            except argparse.ArgumentTypeError:
                default = InvalidEnvSetting(
                    f"{name}={value!r} is not a boolean: write {name}=true or {name}=false")
        super().__init__(option_strings, dest, default=default, **kwargs)


class EnvFlag(_RemembersGiven, env):
    """torch's ``env`` action (a ``PET_*`` fallback) that remembers it was given."""


def _as_written(args: argparse.Namespace, dest: str, flag: str) -> str:
    """``flag`` if the command line gave it, else ``PET_<DEST>=value``, when the setting
    came from the environment."""
    name = f"PET_{dest.upper()}"
    value = os.environ.get(name, "").strip()
    if value and dest not in getattr(args, "flags_given", ()):
        return f"{name}={value}"
    return flag


def _from_environment(setting: str) -> bool:
    """Whether a setting as ``_as_written`` wrote it came from a ``PET_*`` variable."""
    return setting.startswith("PET_")


def build_parser() -> argparse.ArgumentParser:
    parser = get_args_parser()
    parser.prog = "tierrun"

    def one_line(message: str) -> None:  # (argparse prints the whole usage first: dozens of lines)
        parser.exit(2, f"tierrun: error: {message} (tierrun --help lists the flags)\n")

    parser.error = one_line  # type: ignore[method-assign]
    parser.description = (
        "Launch distributed PyTorch training: torchrun's and torch_npu_run's flags, "
        "on tierrun's store. `tierrun store --help` runs a store on its own."
    )
    # (None: neither the flag nor its PET_ variable; normalise chooses as torchrun would)
    backend = os.environ.get("PET_RDZV_BACKEND", "").strip() or None
    parser.set_defaults(rdzv_backend=backend)
    for action in parser._actions:
        if action.dest == "node_rank" and not os.environ.get("PET_NODE_RANK", "").strip():
            action.default = None  # (normalise: 0, noting that no node rank was given)
        if action.dest == "rdzv_backend":
            action.__class__ = EnvFlag  # (torch's env action, remembering it was given: _as_written)
            action.default = backend
            action.help = (
                "Rendezvous backend: tierrun (elastic; c10d means this too), "
                "parallel (fixed nodes, node rank given; static means this too), "
                "tierrun-etcd (elastic, membership in etcd: survives the loss of any node; "
                "--rdzv_endpoint lists etcd's client URLs), "
                "torch-c10d or torch-static (torch's own), etcd, etcd-v2. "
                "Default, as torchrun's (static): parallel when --node_rank is given with a fixed "
                "--nnodes N > 1 (and --master_addr/--master_port, or an --rdzv_endpoint HOST:PORT); "
                "otherwise tierrun, which needs no node rank."
            )
    parser.add_argument(
        "--enable-tiered-parallel-tcpstore",
        "--enable_tiered_parallel_tcpstore",
        action=EnvFlag,
        type=parse_npu_flag,
        default=None,
        help="torch_npu_run's flag: tiered store wire-up (a store proxy per node), true or false "
        "(any other value is false, as torch_npu_run reads it). "
        "Unset: chosen from --nnodes (see --tiered).",
    )
    parser.add_argument(
        "--tiered",
        action=EnvBooleanOptionalAction,
        default=None,
        help="Tiered store wire-up: a store proxy per node, which alone links to the store host "
        "(tierrun's spelling of --enable_tiered_parallel_tcpstore true; --no-tiered: false). "
        "Also $PET_TIERED=true/false. Unset, backends tierrun/c10d and parallel tier jobs of 32 "
        "nodes or more (--nnodes MAX), in a tree of fanout 8 from 64 nodes. Across nodes, give every node the same secret in a "
        "file named by $TIERRUN_TOKEN_FILE (or in $TIERRUN_TOKEN) to authenticate the links; "
        "without one, a token derived from --rdzv_id and the store port guards against "
        "accidents only.",
    )
    parser.add_argument(
        "--store-workers",
        "--store_workers",
        action=env,
        type=int,
        default=1,
        help="Flat wire-up: N front-end processes on the store host serve the training "
        "workers' store connections (sharing each port with SO_REUSEPORT), so their "
        "requests are parsed on several cores; the agents stay on the store's own process. "
        "Default 1: one process does everything. No effect with --tiered (workers talk to "
        "their node's proxy).",
    )
    parser.add_argument(
        "--store-fanout",
        "--store_fanout",
        action=EnvFlag,
        type=int,
        default=None,
        help="Tiered wire-up (backends parallel and tierrun/c10d) with the node proxies stacked in "
        "a tree of at most F links per proxy, so the store host sees F links instead of one per "
        "node; an elastic job builds each round's tree from its members. A node with children "
        "takes their links on its --local_addr (or the address it reaches the store host from). "
        "0: every proxy links to the store host. Unset: chosen from --nnodes (see --tiered).",
    )
    parser.add_argument(
        "--progress",
        action=env,
        default="auto",
        choices=("auto", "bar", "log", "off"),
        help="Rendezvous progress on the store host's stderr: a bar on a terminal, plain "
        "lines otherwise (auto, the default), or always bar / log, or off.",
    )
    parser.add_argument(
        "--progress-interval",
        "--progress_interval",
        action=env,
        type=float,
        default=5.0,
        help="Seconds between progress lines, and before the missing nodes are named.",
    )
    parser.add_argument(
        "--timeline",
        action=env,
        default=None,
        help="Write the wire-up timeline (per node and phase) to this JSON file on the store "
        "host when the job ends; `tierrun timeline FILE` draws it as a PNG.",
    )
    return parser


def _has_port(endpoint: str) -> bool:
    try:
        return parse_rendezvous_endpoint(endpoint, default_port=-1)[1] != -1
    except ValueError:
        return False


def _node_counts(nnodes: str) -> tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX`` as (MIN, MAX). Raises UsageError."""
    parts = nnodes.split(":")
    try:
        nmin, nmax = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        raise UsageError(f"--nnodes '{nnodes}' is not a number: write --nnodes N or --nnodes MIN:MAX") from None
    if len(parts) > 2 or not 0 < nmin <= nmax:
        raise UsageError(f"--nnodes '{nnodes}' is not valid: write --nnodes N or --nnodes MIN:MAX with 0 < MIN <= MAX")
    return nmin, nmax


def normalise(args: argparse.Namespace) -> argparse.Namespace:
    """Map backend aliases and check flags that contradict each other. Raises UsageError."""
    if isinstance(args.tiered, InvalidEnvSetting):
        raise UsageError(str(args.tiered))
    rank_given = args.node_rank is not None
    if not rank_given:
        args.node_rank = 0
    nmin, nmax = _node_counts(args.nnodes)
    if nmax == 1 and args.rdzv_backend in (None, "static") and not args.rdzv_endpoint and args.master_port is None:
        args.standalone = True  # (as torchrun: a store of its own on a free port, so two such jobs never meet)
    if args.rdzv_backend is None:
        # torchrun's default is static, which honours --node_rank: tierrun's parallel, for
        # torchrun's static command (--master_addr/--master_port, or --rdzv_endpoint
        # HOST:PORT). With no node rank every node would claim rank 0, and MIN:MAX or an
        # endpoint with no port (static refuses it; c10d's default port is 29400) says
        # elastic: tierrun's elastic backend, which needs none.
        static = (rank_given and nmin == nmax > 1 and not args.standalone
                  and (not args.rdzv_endpoint or _has_port(args.rdzv_endpoint)))
        args.rdzv_backend = "parallel" if static else "tierrun"
    backend = args.rdzv_backend
    named = _as_written(args, "rdzv_backend", f"--rdzv_backend {backend}")  # (or PET_RDZV_BACKEND=...)
    if backend.startswith("torch-"):
        args.rdzv_backend = backend[len("torch-"):]
    else:
        args.rdzv_backend = BACKEND_ALIASES.get(backend, backend)
    known = TIERRUN_BACKENDS + TORCH_BACKENDS + tuple(BACKEND_ALIASES)
    if backend not in known:
        raise UsageError(
            f"unknown {named}: write one of {', '.join(known)}"
        )
    if args.monitor_interval <= 0:  # (torch's agent asserts it, with no message)
        raise UsageError(f"--monitor_interval {args.monitor_interval:g}: write a number of seconds above 0")
    if args.standalone and nmax > 1:
        raise UsageError(
            f"--standalone runs one node but --nnodes is {args.nnodes}: drop --standalone "
            "and give --rdzv_endpoint, or write --nnodes 1"
        )
    if args.rdzv_backend == "parallel":
        if nmin != nmax:  # (torchrun's static and torch_npu_run's parallel run MAX nodes: so does tierrun, saying so)
            log.warning("%s is not elastic: --nnodes %s runs as --nnodes %d (as torchrun's static and "
                        "torch_npu_run's parallel backends run it); for an elastic job use --rdzv_backend tierrun",
                        named, args.nnodes, nmax)
            args.nnodes = str(nmax)
        if not 0 <= args.node_rank < nmax:
            raise UsageError(
                f"--node_rank {args.node_rank} is outside 0..{nmax - 1} for --nnodes {nmax}"
            )
    if args.rdzv_backend == "tierrun-etcd" and not args.rdzv_endpoint:
        raise UsageError(
            "--rdzv_backend tierrun-etcd needs --rdzv_endpoint: etcd's client endpoints, "
            "comma-separated (HOST:PORT or http(s)://HOST:PORT)"
        )
    _choose_tiering(args, nmax, backend)
    if args.store_workers > 1 and args.rdzv_backend not in TIERRUN_BACKENDS:
        raise UsageError(
            f"--store-workers needs a tierrun rendezvous backend, not {named}"
        )
    cores = len(os.sched_getaffinity(0))  # (the cores this process may run on)
    if not 1 <= args.store_workers <= 4 * cores:  # (a process each, to use the store host's cores)
        raise UsageError(f"--store-workers {args.store_workers}: write 1 to {4 * cores} (4 per core this node "
                         f"may use: {cores})")
    if args.max_restarts < 0:
        raise UsageError(f"--max_restarts {args.max_restarts} is negative: write 0 or more")
    return args


def _choose_tiering(args: argparse.Namespace, max_nodes: int, backend: str) -> None:
    """Set ``args.tiered``, ``args.store_fanout`` and ``args.tiering`` (a
    ``tiering.Tiering``) from the settings, or from the job's size if they say nothing.
    ``--rdzv_conf tiered=...`` and ``store_fanout=...`` are settings as the flags are
    (the handlers read them; ``prepare`` passes them what was chosen): read as the
    handlers read them, and checked against the flags. ``backend``: as the user wrote
    it. Raises UsageError for a wrong value or two settings that disagree."""
    try:
        conf = _parse_rendezvous_config(args.rdzv_conf or "")
        conf_tiered = conf_flag(conf, "tiered")
    except RendezvousSettingError as e:
        raise UsageError(str(e)) from None
    except ValueError as e:  # (torch's parser: a key with no value)
        raise UsageError(f"--rdzv_conf {args.rdzv_conf}: {e}") from None
    said: dict[str, bool] = {}  # setting as written -> whether it tiers
    if args.tiered is not None:
        said[_as_written(args, "tiered", "--tiered" if args.tiered else "--no-tiered")] = args.tiered
    npu = args.enable_tiered_parallel_tcpstore
    if npu is not None:
        flag = _as_written(args, "enable_tiered_parallel_tcpstore",
                           f"--enable_tiered_parallel_tcpstore {npu if isinstance(npu, NotABoolean) else str(npu).lower()}")
        if isinstance(npu, NotABoolean):
            log.warning("%s is not true: read as false (no tiering), as torch_npu_run reads every value but true; "
                        "write true (or --tiered) to tier", flag)
            npu = args.enable_tiered_parallel_tcpstore = False
        said[flag] = npu
    if conf_tiered is not None:
        said[f"--rdzv_conf tiered={conf['tiered']}"] = conf_tiered
    # the command line wins over PET_* values (defaults, as torchrun reads them): those
    # count only when no flag or --rdzv_conf key says anything
    if any(not _from_environment(setting) for setting in said):
        said = {setting: on for setting, on in said.items() if not _from_environment(setting)}
    if len(set(said.values())) > 1:
        raise UsageError(f"{' and '.join(said)} disagree: give one of them")
    tiered = next(iter(said.values()), None)
    if tiered and args.rdzv_backend not in TIERRUN_BACKENDS:
        raise UsageError(
            f"{' and '.join(said)} needs a tierrun rendezvous backend, which starts the node proxies, not "
            f"--rdzv_backend {backend} (torch's own): use tierrun (elastic; c10d maps to it), parallel (fixed "
            "nodes) or tierrun-etcd, or drop it")
    fanout, fanout_setting = args.store_fanout, _as_written(args, "store_fanout", f"--store-fanout {args.store_fanout}")
    if "store_fanout" in conf:
        raw = conf["store_fanout"]
        try:
            given = int(raw)
        except ValueError:
            raise UsageError(f"--rdzv_conf store_fanout={raw} is not a whole number: write store_fanout=F "
                             "(2 or more; 0: no tree)") from None
        if fanout is not None and given != fanout and not _from_environment(fanout_setting):
            raise UsageError(f"{fanout_setting} and --rdzv_conf store_fanout={raw} disagree: give one of them")
        if fanout is None or _from_environment(fanout_setting):
            fanout, fanout_setting = given, f"--rdzv_conf store_fanout={raw}"
    if fanout:
        if fanout < 2:
            raise UsageError(f"{fanout_setting}: write 2 or more (or 0: no tree)")
        if args.rdzv_backend not in ("parallel", "tierrun"):
            raise UsageError(
                f"{fanout_setting} needs a backend that builds a tree of node proxies, not --rdzv_backend "
                f"{backend}: use tierrun (elastic; c10d maps to it) or parallel (fixed nodes)")
        if tiered is False:
            off = [setting for setting, on in said.items() if not on]
            env_off = all(_from_environment(setting) for setting in off)
            if _from_environment(fanout_setting) and not env_off:
                fanout = None  # (the command line turns tiering off: a PET_* fanout does not apply)
            elif env_off and not _from_environment(fanout_setting):
                tiered = None  # (the command line asks for a tree: a PET_* "not tiered" does not apply)
            else:
                raise UsageError(f"{fanout_setting} stacks the node proxies of tiered wire-up in a tree, but "
                                 f"{' and '.join(off)} turns tiering off: drop one of them")
    args.tiering = choose(args.rdzv_backend, max_nodes, tiered, fanout, args.store_workers)
    args.tiered = args.tiering.tiered
    args.store_fanout = args.tiering.fanout
