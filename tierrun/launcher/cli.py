"""``tierrun [flags] script.py [args]``: torchrun's launcher on tierrun's store."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import uuid

from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args

from .. import rendezvous
from ..link.auth import load_token, new_token
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
    if args.tiered:
        if load_token() is None:
            if args.standalone or args.nnodes.split(":")[-1] == "1":
                os.environ["TIERRUN_TOKEN"] = new_token()  # one node: nobody else needs it
            else:
                # torch_npu_run's flags carry no secret; stay drop-in, but say what it costs
                identity = f"tierrun:{args.rdzv_id}:{args.rdzv_endpoint}"
                os.environ["TIERRUN_TOKEN"] = hashlib.sha256(identity.encode()).hexdigest()
                log.warning(
                    "no job token: the store links are keyed by the job's endpoint and id, "
                    "which stops mistakes, not attackers. Set TIERRUN_TOKEN to the same secret "
                    "on every node (or TIERRUN_TOKEN_FILE) to authenticate them."
                )
        conf = "tiered=1"
        args.rdzv_conf = f"{args.rdzv_conf},{conf}" if args.rdzv_conf else conf
    rendezvous.register()
    return config_from_args(args)


@record
def main(argv: list[str]) -> int:
    logging.basicConfig(format="[tierrun] %(levelname)s %(message)s")
    logging.getLogger("tierrun").setLevel(os.environ.get("TIERRUN_LOG_LEVEL", "WARNING").upper())
    try:
        config, entrypoint, cmd_args = prepare(argv)
    except UsageError as e:
        print(f"tierrun: error: {e}", file=sys.stderr)
        return 2
    elastic_launch(config=config, entrypoint=entrypoint)(*cmd_args)
    return 0
