"""``tierrun [flags] script.py [args]``: torchrun's launcher on tierrun's store."""

from __future__ import annotations

import logging
import sys
import uuid

from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args

from .. import rendezvous
from .args import UsageError, build_parser, normalise
from .devices import resolve_nproc_per_node

log = logging.getLogger("tierrun")


def prepare(argv: list[str]):
    """Parse and check the flags; return torch's (LaunchConfig, entrypoint, args)."""
    args = normalise(build_parser().parse_args(argv))
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
    if args.enable_tiered_parallel_tcpstore:
        log.warning(
            "--enable_tiered_parallel_tcpstore: node front-ends are not available in this "
            "version; every process connects to the store host directly"
        )
    rendezvous.register()
    return config_from_args(args)


@record
def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="[tierrun] %(levelname)s %(message)s")
    try:
        config, entrypoint, cmd_args = prepare(argv)
    except UsageError as e:
        print(f"tierrun: error: {e}", file=sys.stderr)
        return 2
    elastic_launch(config=config, entrypoint=entrypoint)(*cmd_args)
    return 0
