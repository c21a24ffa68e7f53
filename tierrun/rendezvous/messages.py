"""What the elastic backends (``tierrun``, ``tierrun-etcd``) say when a rendezvous times
out, or finds no store: one line, with who arrived, what was missing and what to do."""

from __future__ import annotations


def join_timeout_message(run_id: str, node_addr: str, join_timeout: float, arrived: list[str],
                         min_nodes: int, max_nodes: int,
                         no_host: list[tuple[str, str]] | None = None) -> str:
    """What a node that waited ``join_timeout`` for a round that did not close reports.
    ``arrived``: the addresses of the nodes that joined it; ``no_host`` (``tierrun-etcd``,
    whose rounds need a node that may host their store): (address, why it may not) of
    each arrived node that may not host it."""
    head = (f"rendezvous '{run_id}' timed out after {join_timeout:.0f} s on node {node_addr}: "
            f"{len(arrived)} node(s) arrived ({', '.join(arrived)})")
    nnodes = f"--nnodes {min_nodes}:{max_nodes}"
    missing = min_nodes - len(arrived)
    if no_host and len(no_host) == len(arrived):  # (whoever else came, a round could not close)
        why = "; ".join(f"{addr}: {reason}" for addr, reason in no_host)
        need = f"enough for {nnodes}" if missing <= 0 else f"{missing} fewer than {nnodes} needs"
        return (f"{head}, {need}, but none of them may host the round's store ({why}). One node must "
                "host it: on one node leave --rdzv_conf is_host unset (or set is_host=true), with a free "
                "--rdzv_conf store_port (0, the default, takes any free port).")
    if missing <= 0:
        return (f"{head}, enough for {nnodes}, but the round did not close before the timeout. Raise "
                "--rdzv_conf join_timeout=SECONDS (above last_call_timeout, which a round waits for "
                "more nodes once it has the minimum).")
    return (f"{head}, at least {min_nodes} needed ({nnodes}); {missing} more missing. Start tierrun on "
            "the missing nodes with the same --rdzv_endpoint and --rdzv_id, lower --nnodes, or raise "
            "--rdzv_conf join_timeout=SECONDS.")


def closed_while_waiting(run_id: str, node: str, r: int) -> str:
    return (f"rendezvous '{run_id}' was closed while node {node} waited for round {r}: another node ended the "
            "job (its workers failed past --max-restarts, or it was stopped); its output says why")


#: What ends the message of a one-node job whose store port is taken.
ALONE_HINT = (": a job of one node hosts its store itself, and another job or program on this machine uses "
              "that port.")


def unreachable_hint(host: str, is_host: bool | None) -> str:
    """What a node that does not host the store, and found none, should do."""
    if is_host is False:
        return ("this node does not host it (--rdzv_conf is_host=false). One node must host the store: set "
                "is_host=true on the endpoint's node, or leave is_host unset so the endpoint's host is inferred.")
    return (f"this node does not host it (the endpoint names another machine). Start tierrun on {host}, or "
            "raise --rdzv_conf join_timeout if it is late; if the endpoint's name is not that node's own (a "
            "Kubernetes Service, a DNS alias), set --rdzv_conf is_host=true on the node that should host it.")


#: What to check when something takes connections on the store's port and never answers.
SILENT_HINT = ("the store host may be overloaded or frozen (stopped, swapping), or another program holds that port. "
               "Check node rank 0 / the --rdzv_endpoint host, and that nothing else listens on the store port.")


def token_refused(node: str, upstream: str, is_store_host: bool) -> str:
    """What a node says when ``upstream`` (the store host, or its parent in the store
    tree) refused its job token."""
    what = "the store host" if is_store_host else "its parent node in the store tree"
    return (f"{node}: {what} {upstream} refused this node's job token. Every node of the "
            "job needs the same secret: check that TIERRUN_TOKEN_FILE names a file with the same "
            "contents on every node (or that TIERRUN_TOKEN is the same); with no secret, the "
            "token is derived from --rdzv_id and the store port, which must then be the same.")


def other_layout(node: str, store_host: str, host_tiered: bool) -> str:
    """What a node says whose store layout (flat or tiered) is not the store host's:
    every node decides it alone, from its own flags and its tierrun's rule."""
    host = ("tiered wire-up (its port takes node links only), but this node's store is flat" if host_tiered
            else "a flat store (it takes no node links), but this node is tiered")
    return (f"{node}: the job's store host {store_host} runs {host}: the nodes chose different "
            "store layouts. Give every node the same --nnodes, --tiered or --no-tiered, --store-fanout and "
            "--store-workers (with none of them, a job of 32 nodes or more is tiered), and the same tierrun "
            "version.")
