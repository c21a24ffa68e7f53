"""Shrink a history that makes a target differ from torch's server to a small one that
still does, the same way (same target, same kind of difference): fewer steps, fewer
requests per burst, fewer clients, plainer keys and values."""

from __future__ import annotations

from dataclasses import replace

from tierrun.protocol import Op

from .history import History
from .sequential import Mismatch
from .wire import RAW, Big


def kind(m: Mismatch | None) -> str | None:
    """What sort of difference: tierrun answered less, more, otherwise, or died."""
    if m is None:
        return None
    if "exited" in m.got or "died" in m.got:
        return "died"
    if m.got == "nothing" or "CLOSED" in m.got and "CLOSED" not in m.expected:
        return "less"
    if m.expected.endswith("nothing") or "CLOSED" in m.expected and "CLOSED" not in m.got:
        return "more"
    return "other"


def _drop_unused_clients(h: History) -> History:
    used = sorted({c for c, _ in h.steps})
    renumber = {c: i for i, c in enumerate(used)}
    where = tuple(h.where[c] for c in used) if h.where else ()
    return replace(h, clients=max(len(used), 1), steps=[(renumber[c], b) for c, b in h.steps], where=where)


def _simpler_args(req: tuple):
    """Plainer versions of one request (each a candidate)."""
    op = req[0]
    if op == RAW:
        return
    for i, a in enumerate(req[1:], 1):
        if isinstance(a, Big):
            for n in (a.n // 2, 1 << 20):  # (a limit's value must stay past it: tried, kept if still failing)
                if n < a.n:
                    yield req[:i] + (Big(n, a.fill),) + req[i + 1:]
        elif isinstance(a, bytes) and a not in (b"/a", b"1", b""):
            for plain in (b"/a", b"1", b""):
                yield req[:i] + (plain,) + req[i + 1:]
        elif isinstance(a, tuple) and len(a) > 1 and op != Op.MULTI_SET:
            yield req[:i] + (a[: len(a) // 2],) + req[i + 1:]
            yield req[:i] + (a[1:],) + req[i + 1:]


def minimize(history: History, failing, max_tries: int = 300) -> History:
    """``failing(h) -> bool``: h still fails the same way. Greedy, one change at a time."""
    h = _drop_unused_clients(history)
    tries = 0

    def attempt(candidate: History) -> bool:
        nonlocal tries
        if tries >= max_tries:
            return False
        tries += 1
        return failing(candidate)

    changed = True
    while changed and tries < max_tries:
        changed = False
        # whole steps, in chunks then one by one
        chunk = max(len(h.steps) // 2, 1)
        while chunk >= 1:
            i = 0
            while i < len(h.steps):
                cand = replace(h, steps=h.steps[:i] + h.steps[i + chunk:])
                if cand.steps and attempt(cand):
                    h, changed = cand, True
                else:
                    i += chunk
            chunk //= 2
        # requests within bursts
        for s in range(len(h.steps)):
            j = 0
            while s < len(h.steps) and j < len(h.steps[s][1]):
                client, burst = h.steps[s]
                if len(burst) > 1:
                    cand = replace(h, steps=h.steps[:s] + [(client, burst[:j] + burst[j + 1:])] + h.steps[s + 1:])
                    if attempt(cand):
                        h, changed = cand, True
                        continue
                j += 1
        # fewer clients: fold client c into an earlier one
        for c in range(h.clients - 1, 0, -1):
            for into in range(c):
                cand = _drop_unused_clients(replace(h, steps=[(into if x == c else x, b) for x, b in h.steps]))
                if attempt(cand):
                    h, changed = cand, True
                    break
        # plainer arguments
        for s in range(len(h.steps)):
            client, burst = h.steps[s]
            for j in range(len(burst)):
                for simpler in _simpler_args(h.steps[s][1][j]):
                    b = h.steps[s][1]
                    cand = replace(h, steps=h.steps[:s] + [(client, b[:j] + (simpler,) + b[j + 1:])] + h.steps[s + 1:])
                    if attempt(cand):
                        h, changed = cand, True
                        break
    return _drop_unused_clients(h)


def minimize_mismatch(oracle, m: Mismatch, max_tries: int = 300) -> History:
    """Shrink ``m.history`` on ``m.target`` with ``oracle`` (a driver.Oracle)."""
    want = kind(m)

    def failing(h: History) -> bool:
        got = oracle.mismatch_of(h, m.target)
        return got is not None and kind(got) == want

    return minimize(m.history, failing, max_tries)


def minimize_concurrent(history, failing, max_tries: int = 200):
    """The same greedy shrinking for a concurrent history (``failing(h) -> bool`` should
    try a few runs: interleavings vary): whole bursts, requests, whole clients."""
    from .concurrent import ConcurrentHistory

    h = history
    tries = 0

    def attempt(c) -> bool:
        nonlocal tries
        if tries >= max_tries or not any(c.scripts):
            return False
        tries += 1
        return failing(c)

    def make(scripts, pauses, where):
        keep = [i for i, s in enumerate(scripts) if s]
        return ConcurrentHistory([scripts[i] for i in keep], [pauses[i] for i in keep],
                                 tuple(where[i] for i in keep), h.seed)

    changed = True
    while changed and tries < max_tries:
        changed = False
        for i in range(len(h.scripts) - 1, -1, -1):  # whole clients
            if i < len(h.scripts):
                scripts = h.scripts[:i] + [[]] + h.scripts[i + 1:]
                cand = make(scripts, h.pauses, h.where)
                if attempt(cand):
                    h, changed = cand, True
        for i in range(len(h.scripts)):  # bursts
            j = 0
            while i < len(h.scripts) and j < len(h.scripts[i]):
                scripts = [list(s) for s in h.scripts]
                pauses = [list(p) for p in h.pauses]
                del scripts[i][j]
                del pauses[i][j]
                cand = make(scripts, pauses, h.where)
                if attempt(cand):
                    h, changed = cand, True
                else:
                    j += 1
        for i in range(len(h.scripts)):  # requests
            for j in range(len(h.scripts[i])):
                k = 0
                while k < len(h.scripts[i][j]) and len(h.scripts[i][j]) > 1:
                    scripts = [list(s) for s in h.scripts]
                    b = scripts[i][j]
                    scripts[i][j] = b[:k] + b[k + 1:]
                    cand = make(scripts, h.pauses, h.where)
                    if attempt(cand):
                        h, changed = cand, True
                    else:
                        k += 1
    return h
