"""What every benchmark shares: medians, the fd limit, and writing its section of
docs/benchmarks.md (between ``<!-- name:start -->`` and ``<!-- name:end -->``)."""

from __future__ import annotations

import json
import resource
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def raise_fd_limit() -> None:
    """Benchmarks open thousands of sockets: lift the soft limit to the hard one."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def write_json(name: str, data: dict) -> None:
    (DOCS / "bench").mkdir(parents=True, exist_ok=True)
    (DOCS / "bench" / f"{name}.json").write_text(json.dumps(data, indent=1))


def write_section(name: str, body: str) -> None:
    doc = DOCS / "benchmarks.md"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body}\n{end}"
    if start in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text += f"\n{block}\n"
    doc.write_text(text)


def rendezvous_all(handlers: list) -> list[int]:
    """Call every handler's ``next_rendezvous()`` at once, one thread each (as that many
    agents would); their ranks, once all have returned."""
    ranks = [-1] * len(handlers)

    def agent(j: int) -> None:
        ranks[j] = handlers[j].next_rendezvous().rank

    threads = [threading.Thread(target=agent, args=(j,), daemon=True) for j in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ranks
