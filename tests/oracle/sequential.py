"""Sequential histories: one client acts at a time; every target must answer byte for
byte as torch's server does, close the same connections at the same steps, and stay up.

Running a history on torch's server gives the reference :class:`Trace`: per step, what
each client received (replies cut per request, LIST_KEYS as a set) and whether its
connection is closed. A step is over once the acting client's burst is answered (all
but a WAIT or BARRIER that may block), then a probe through the same front-end has been
answered and nothing more arrives for ``slack`` seconds (so a wake-up of another
client is seen at the step that caused it). A client whose WAIT is still pending when
it acts again first cancels it (CANCEL_WAIT), as torch's client does
after its timeout (and reads its answer before it writes the burst). Running it on tierrun replays what torch's run sent, waits (up to
a deadline) for as many answers as torch gave, then settles the same way.
"""

from __future__ import annotations

import select
import time
from dataclasses import dataclass, field

from tierrun.protocol import Op

from .history import History
from .targets import ClosedError, Conn, Target
from .wire import op_name, request_size, short

#: Settling: how long nothing more must arrive after the probe's answer.
SLACK = 0.003
FINAL_SLACK = 0.03
#: How long tierrun may take to give the answers torch gave at a step (seconds, plus
#: one per 4 MiB the step writes).
DEADLINE = 3.0
#: A write at least this long is read by the server in many reads: wait until it has
#: read all of it before probing.
BIG_WRITE = 64 * 1024
#: ... and settle at least this long after it: a server that has read it may still be
#: executing it (torch's copying a 5 MiB APPEND while it answers the probe on another
#: connection) when a short slack ends, and a WAIT behind it would be answered after
#: the step on a loaded machine only (seen in CI).
BIG_WRITE_SLACK = 0.1


@dataclass
class StepRecord:
    sent: tuple | None  # what the acting client wrote (None: its connection was closed)
    seen: dict[int, tuple[tuple, bool]]  # client -> (replies completed at this step, closed)
    cancel: bool = False  # its WAIT was pending: it sent CANCEL_WAIT first (and read the answer)


@dataclass
class Trace:
    target: str
    steps: list[StepRecord] = field(default_factory=list)
    final: dict = field(default_factory=dict)
    alive: bool = True
    death: str = ""
    error: str = ""  # the runner could not run it (a connection refused, ...)
    seconds: float = 0.0


@dataclass
class Mismatch:
    history: History
    target: str
    step: int  # index of the first step that differs; len(steps): at the end
    expected: str
    got: str

    def __str__(self) -> str:
        return (f"{self.target}: step {self.step}: torch {self.expected}\n"
                f"{' ' * len(self.target)}  {'' if self.step < 0 else ' ' * len(f'step {self.step}: ')}"
                f"tierrun {self.got}")


def _wait(conns: list[Conn], done, deadline: float) -> bool:
    while not done():
        left = deadline - time.monotonic()
        open_ = [c for c in conns if not c.closed]
        if left <= 0 or not open_:
            return done()
        r, _, _ = select.select(open_, [], [], min(left, 0.5))
        for c in r:
            c.pump()
    return True


def _drain(conns: list[Conn], slack: float) -> None:
    while True:
        open_ = [c for c in conns if not c.closed]
        if not open_:
            return
        r, _, _ = select.select(open_, [], [], slack)
        if not r:
            return
        for c in r:
            c.pump()


def _settle(target: Target, entry: int, conns: list[Conn], slack: float) -> None:
    try:
        target.probe(entry).call((Op.GETNUMKEYS,), timeout=10)
    except (OSError, ClosedError, TimeoutError):
        target.drop_probes()  # (the front-end died: what the clients saw tells)
    _drain(conns, slack)


def _deadline(burst) -> float:
    """Time for a burst's answers: more when it moves megabytes."""
    size = sum(request_size(r) for r in burst or ())
    return DEADLINE + size / (4 << 20)


def run(history: History, target: Target, reference: Trace | None = None, stop_at_mismatch: bool = True,
        slack: float = SLACK) -> Trace:
    """Run ``history`` on ``target``: the reference run (``reference`` None, on torch's
    server) or a run to compare with it. The target is not cleaned here."""
    t0 = time.monotonic()
    trace = Trace(target.name)
    entries = target.entries
    where = [(history.where[i] if i < len(history.where) else i) % len(entries) for i in range(history.clients)]
    conns: list[Conn] = []
    try:
        for i in range(history.clients):
            conns.append(Conn(entries[where[i]], nonce=0x1000 + i))
    except (OSError, ClosedError) as e:
        trace.error = f"cannot connect: {e}"
        for c in conns:
            c.close()
        trace.alive, trace.death = target.alive(), target.describe_death()
        return trace
    marks = [0] * history.clients
    try:
        for s, (client, burst) in enumerate(history.steps):
            c = conns[client]
            if reference is not None:
                if s >= len(reference.steps):
                    break
                sent, cancel = reference.steps[s].sent, reference.steps[s].cancel
            else:
                sent = None if c.closed else burst
                cancel = sent is not None and c.reader.waiting
            if cancel and not c.closed:  # (its own write, answered before the burst)
                c.send([(Op.CANCEL_WAIT,)])
                _wait(conns, lambda: c.closed or not c.reader.pending, time.monotonic() + _deadline(()))
            step_slack = slack
            if sent is not None and not c.closed:
                c.send(sent)
                if sum(request_size(r) for r in sent) > BIG_WRITE:
                    c.consumed()  # (the probe below must not overtake the end of it)
                    step_slack = max(slack, BIG_WRITE_SLACK)
            if reference is None:
                _wait(conns, lambda: c.closed or c.reader.answered, time.monotonic() + 10 + _deadline(sent))
            else:
                want = reference.steps[s].seen

                def done():  # (a closed connection gets nothing more: done, whatever it got)
                    return all(conns[j].closed or (len(conns[j].reader.tokens) - marks[j] >= len(want[j][0])
                                                   and not want[j][1]) for j in want)

                _wait(conns, done, time.monotonic() + _deadline(sent))
            _settle(target, where[client], conns, step_slack)
            seen = {}
            for j, cj in enumerate(conns):
                new = tuple(cj.reader.tokens[marks[j]:])
                marks[j] = len(cj.reader.tokens)
                seen[j] = (new, cj.closed)
            trace.steps.append(StepRecord(sent, seen, cancel))
            if reference is not None and stop_at_mismatch and not all(
                    _same(reference.steps[s].seen[j], seen[j]) for j in seen):
                break
        else:
            _drain(conns, FINAL_SLACK)
            for j, cj in enumerate(conns):
                trace.final[j] = (tuple(cj.reader.tokens[marks[j]:]), bytes(cj.reader.buf),
                                  len(cj.reader.pending), cj.closed)
    except TimeoutError as e:  # (a server that stopped reading a request)
        trace.error = f"step {len(trace.steps)}: {e}"
    finally:
        for c in conns:
            c.close()
    trace.alive, trace.death = target.alive(), target.describe_death()
    trace.seconds = time.monotonic() - t0
    return trace


def _final(f) -> str:
    if f is None:
        return "nothing"
    tokens, partial, pending, closed = f
    return (f"answers {[short(b, 24) for _, b in tokens]}, partial {short(partial, 24)}, "
            f"{pending} unanswered{', CLOSED' if closed else ''}")


def _describe(seen: dict, sent, client: int) -> str:
    parts = []
    for j in sorted(seen):
        tokens, closed = seen[j]
        if not tokens and not closed:
            continue
        answers = " ".join(short(b, 24) for _, b in tokens)
        parts.append(f"c{j}[{answers}{' CLOSED' if closed else ''}]")
    return ", ".join(parts) or "nothing"


#: Answers at least this long that torch's server queued just before it closed the
#: connection may be lost: libuv's uv_close cancels pending writes.
LOST_ON_CLOSE = 1 << 20


def _same(ref: tuple, got: tuple) -> bool:
    """One client's answers at one step agree. Where torch closed the connection right
    after queueing a long answer, it may have cancelled that write (and everything after
    it): tierrun delivering them in full is not a difference."""
    if ref == got:
        return True
    (rt, rc), (gt, gc) = ref, got
    return (rc and gc and len(gt) > len(rt) and gt[:len(rt)] == rt
            and len(gt[len(rt)][1]) >= LOST_ON_CLOSE)


def compare(history: History, ref: Trace, got: Trace) -> Mismatch | None:
    """The first difference between a tierrun trace and torch's, or None."""
    def mm(step, e, g):
        return Mismatch(history, got.target, step, e, g)

    if ref.error:
        return None  # (the reference itself did not run: not tierrun's fault; the caller retries)
    if got.error:
        return mm(-1, "ran", got.error + (f" ({got.death})" if got.death else ""))
    for s, (r, g) in enumerate(zip(ref.steps, got.steps)):
        if r.seen != g.seen and not all(_same(r.seen[j], g.seen[j]) for j in r.seen):
            client, burst = history.steps[s]
            what = ("CANCEL_WAIT; " if r.cancel else "") + " ".join(op_name(q) for q in (r.sent or burst))
            e = f"after c{client} {what}: {_describe(r.seen, r.sent, client)}"
            g_ = _describe(g.seen, g.sent, client)
            if not got.alive:
                g_ += f" ({got.death})"
            return mm(s, e, g_)
    if len(got.steps) < len(ref.steps):
        return mm(len(got.steps), "more steps", "stopped")
    for j, r in ref.final.items():
        g = got.final.get(j)
        # (a connection torch closed may hold part of an answer it cancelled: see _same)
        if g is None or (g[3] != r[3] if r[3] else g != r):
            return mm(len(ref.steps), f"at the end c{j}: {_final(r)}", _final(g))
    if ref.alive and not got.alive:
        return mm(len(ref.steps), "server up", got.death)
    return None
