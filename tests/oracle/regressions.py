"""Every difference the oracle found, minimized, as a table the CI test runs
(tests/test_oracle.py); KNOWN_BUGS: the ones that are tierrun's bugs, not yet fixed;
KNOWN_DEVIATIONS: where tierrun differs from torch's server and torch's behaviour is the
odd one (a decision to take, either way).

A case whose ``bug`` is in KNOWN (either list) is expected to fail on the targets in its
``fails_on`` (pytest.mark.xfail(strict=True): it turns red the day it passes, so that
the entry is removed from KNOWN_BUGS with the fix); on every other target it must pass.
The generators also keep away from the patterns of KNOWN (history.Profile.avoid),
so that the seeded histories of the CI test stay green while a bug is known; remove a
bug from KNOWN_BUGS and the random histories draw its pattern again.

Targets: flat (clients on the store), tiered (on a proxy), tree (on a proxy linked to a
proxy), mixed (each client on the front-end ``where`` names: 0 the store, 1 the tiered
proxy, 2 the upper tree proxy, 3 the lower one).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from tierrun.protocol import Op
from tierrun.protocol.opcodes import VALIDATION_MAGIC

from .concurrent import ConcurrentHistory
from .history import History
from .wire import I64_MAX, I64_MIN, KEYS_LIMIT, RAW, Big, raw_claim

_u64 = struct.Struct("<Q").pack
MiB = 1 << 20
PROXIES = ("tiered", "tree", "mixed")
ALL = ("flat",) + PROXIES

#: tierrun's bugs the oracle found, not fixed yet: name -> what goes wrong. Remove an
#: entry with its fix: its cases below must then pass (strict xfail), and the random
#: histories of the CI test draw its pattern again.
KNOWN_BUGS: dict[str, str] = {}  # (none known now)


#: Where tierrun differs from torch's server on input no torch client sends, by
#: decision: torch's behaviour there is the defect (or tierrun's budgets forbid it).
#: Each case names the step and what tierrun answers there (``Case.deviates``): it must
#: differ exactly so; a deviation matched since (validate-midstream, multi-set-partial)
#: leaves this list and its cases pass on every target.
KNOWN_DEVIATIONS = {
    "append-past-value-limit": "by design (issue 33's budgets): an APPEND whose result would pass the value "
                               "limit (8 MiB) is refused and its client closed; torch's server grows the value "
                               "without bound",
    "multi-set-atomic": "a MULTI_SET takes effect once it has arrived whole; torch's server sets each pair as "
                        "it reads it, so another client may see the first pairs of a MULTI_SET still arriving "
                        "(and keep them if its client never sends the rest)",
    "wait-on-queue-key": "a WAIT on several keys, one of them a non-empty queue's: tierrun counts the queue as "
                         "present (as CHECK does, and as torch does when every key is present) and waits for the "
                         "others; torch registers every key missing from its key-value map, the queue's too, and "
                         "also waits for a write to it",
    "queue-push-wait-count": "a WAIT with a key repeated, then a QUEUE_PUSH and a write to that key: torch counts "
                             "the key once per occurrence, and its QUEUE_PUSH takes one from every waiter it passes "
                             "without dropping them, so the write wakes the WAIT with other keys still missing; "
                             "tierrun keeps waiting",
}

#: Everything the generators keep away from (a known bug's or deviation's pattern).
KNOWN = {**KNOWN_BUGS, **KNOWN_DEVIATIONS}


@dataclass
class Case:
    name: str
    history: History
    fails_on: tuple[str, ...] = ()  # targets where ``bug`` shows
    bug: str | None = None  # a KNOWN_BUGS name (None: every target must pass)
    note: str = ""
    runs: int = 1  # a difference in any of this many runs is a failure (timing-dependent merges)
    heavy: bool = False  # moves hundreds of megabytes: run only with ORACLE_HEAVY=1
    #: A KNOWN_DEVIATIONS case: the step where tierrun differs, and what tierrun's
    #: clients get there (the deviation as decided; any other difference fails).
    deviates: tuple[int, str] | None = None


@dataclass
class ConcurrentCase:
    name: str
    history: ConcurrentHistory
    fails_on: tuple[str, ...] = ()
    bug: str | None = None
    runs: int = 40  # a failure in any of this many runs is a failure
    note: str = ""


def H(*steps, clients: int | None = None, where=()) -> History:
    n = clients or max(c for c, _ in steps) + 1
    return History(n, list(steps), tuple(where) or tuple(range(n)))


CASES = [
    # -- tierrun's bugs ------------------------------------------------------------------------
    Case("set-then-malformed-in-one-write",
         H((0, ((Op.SET, b"/a", b"1"), raw_claim(Op.GET, 1 << 40))), (1, ((Op.GET, b"/a"),))),
         ALL, "bad-after-good", "torch: c1 reads b'1'; tierrun: the SET was dropped, c1 reads b''"),
    Case("answer-then-too-many-keys",
         H((0, ((Op.ADD, b"/a", 0), (RAW, bytes((Op.CHECK,)) + _u64(KEYS_LIMIT + 1)))),),
         ALL, "bad-after-good", "torch answers the ADD, then closes; tierrun closes without the answer"),
    Case("validate-after-the-handshake",
         H((0, ((Op.VALIDATE, VALIDATION_MAGIC), (Op.GET, b"/a"))),),
         ALL, "validate-midstream"),
    Case("ping-after-add", H((0, ((Op.ADD, b"/p", 1), (Op.PING, 322675247))), where=(1,)),
         PROXIES, "reply-order", "torch: the ADD's answer, then the nonce; a proxy: the nonce first"),
    Case("cancel-wait-after-add", H((0, ((Op.ADD, b"", I64_MAX - 1), (Op.CANCEL_WAIT,))), where=(3,)),
         PROXIES, "reply-order"),
    Case("answer-then-a-value-past-the-limit",
         H((0, ((Op.ADD, b"/a", I64_MIN + 1), (Op.COMPARE_SET, b"", b"", Big(8 * MiB + 1, b"v")))),),
         note="(the fuzzer's: closed with 8 MiB unread, the store's socket reset the connection and the ADD's "
              "answer was lost; a dropped client's connection now closes lingering)"),
    Case("held-answer-then-a-value-past-the-limit",
         H((1, ((Op.GET, b"/a"),)), (0, ((Op.ADD, b"/a", 1), (Op.COMPARE_SET, b"", b"", Big(8 * MiB + 1, b"v")))),
           where=(0, 1)),
         note="(the suite's: a proxy's client watches /a, so the ADD's answer waits for an invalidation round; "
              "the client was dropped meanwhile and that answer discarded: the FIN now waits for it)"),
    Case("requests-after-a-slowly-read-answer",
         History(clients=5, where=(0, 0, 0, 1, 2), steps=[
             (0, ((Op.SET, b'', b'2'), (Op.LIST_KEYS,),)),
             (2, ((Op.COMPARE_SET, b'/a/0', b'', b'-9223372036854775809'),)),
             (0, ((Op.SET, b'/b', b'1'), (Op.PING, 1), (Op.GET, b'/b'),)),
             (0, ((Op.ADD, b'/a', 9223372036854775806), (Op.ADD, b'/a', 9223372036854775806), (Op.ADD, b'/a', 0),)),
             (2, ((Op.COMPARE_SET, b'/a/0', b'-9223372036854775809', Big(8388608, b'w')),)),
             (3, ((Op.SET, b'/a', b'0'), (Op.GET, b'/a/0'),)),
             (1, ((Op.GET, b'/a'),)),
             (1, ((Op.SET, b'/a', b'\x00'), (Op.GETNUMKEYS,),)),
             (2, ((Op.SET, b'', b'\x00'), (Op.LIST_KEYS,),)),
             (2, ((Op.CHECK, (b'', b'/a', b'/a')), (Op.QUEUE_LEN, b'/q'), (Op.COMPARE_SET, b'/a/0', b'', b'-9223372036854775808'), (Op.DELETE_KEY, b'/a'),)),
             (3, ((Op.MULTI_GET, (b'/a', b'/a', b'/a/0')), (Op.DELETE_KEY, b''),)),
             (3, ((Op.CANCEL_WAIT,), (Op.PING, 1424511232), (Op.CHECK, (b'/a', b'/a')), (Op.QUEUE_LEN, b'/q'),)),
             (4, ((Op.QUEUE_POP, b'/q'), (Op.WAIT, (b'/a', b'/a')),)),
             (2, ((Op.CANCEL_WAIT,),)),
             (4, ((Op.SET, b'/a', b'0x10'), (Op.PING, 1), (Op.GET, b'/a'),)),
             (1, ((Op.ADD, b'', -3), (Op.QUEUE_POP, b'/q'),)),
             (1, ((Op.QUEUE_POP, b'/q'),)),
         ]),
         note="(the fuzzer's, 1 in ~10 runs on tiered: the client read an 8 MiB answer slowly, the request "
              "behind it was served while the proxy's writing was paused, and reading was never resumed)"),
    Case("answers-before-a-failure-while-a-long-request-comes",
         H((0, ((Op.APPEND, b"/n", b"/a"),)),
           (0, ((Op.CHECK, (b"/n",)), (Op.ADD, b"/n", -5), (Op.COMPARE_SET, b"/a", Big(4 * MiB, b"w"), b"/a")))),
         note="(the fuzzer's: torch closes at the failed ADD with 4 MiB unread, a reset; the oracle's client, "
              "its send refused, closed without reading the CHECK's answer already received)"),
    Case("answer-before-an-out-of-range-add-while-a-long-set-comes",
         H((0, ((Op.MULTI_SET, (b"/b", b"/a", b""), (b"-", b"2", b"-9223372036854775809")),)),
           (0, ((Op.COMPARE_SET, b"/a", b"/a", b"1"), (Op.ADD, b"", 3), (Op.SET, b"/a", Big(4 * MiB, b"v"))))),
         note="(the fuzzer's, the same with std::stoll's out of range)"),
    Case("push-then-ping", H((1, ((Op.QUEUE_PUSH, b"/q", b"1"), (Op.PING, 1))), (0, ((Op.QUEUE_POP, b"/q"),)),
                             where=(0, 3)),
         note="(the fuzzer's: the PING's answer came before the push reached the store)"),
    Case("empty-multi-set", H((0, ((Op.MULTI_SET, (), ()), (Op.GETNUMKEYS,))),),
         ("tiered", "tree"), "empty-multi-set",
         "(mixed's client 0 is on the store itself: no proxy in the way)"),
    Case("add-overflow-merged",
         H((0, ((Op.ADD, b"/a", I64_MAX), (Op.ADD, b"/a", 1))), (1, ((Op.GETNUMKEYS,),)), where=(1, 1)),
         PROXIES, "add-overflow-merge", "torch wraps: I64_MAX, then I64_MIN"),
    Case("add-overflow-merged-negative",
         H((0, ((Op.ADD, b"/n", I64_MIN), (Op.ADD, b"/n", -1), (Op.ADD, b"/n", 0))), where=(3,)),
         PROXIES, "add-overflow-merge"),
    Case("appends-merged-past-the-value-limit",
         H((1, ((Op.APPEND, b"/a", b"x"), (Op.GETNUMKEYS,))),
           (0, ((Op.APPEND, b"/a", Big(5 * MiB, b"p")), (Op.APPEND, b"/a", Big(5 * MiB, b"q")), (Op.GETNUMKEYS,))),
           (1, ((Op.GET, b"/b"),)), where=(1, 1)),
         ALL, "append-past-value-limit",
         "torch stores 10 MiB + 1; tierrun refuses the second APPEND (its result passes the value limit) and "
         "closes c0, the store and c1 carry on; through the tree too (the relay answers the refused write's "
         "request id: it once passed there by accident, c0 left open). (c1's write first makes /a contended: the "
         "proxy holds c0's first APPEND for the next, as it does a barrier's ADDs, so both go up in one batch; "
         "APPENDs are never merged)", runs=3, deviates=(1, "c0[ CLOSED]")),
    Case("pipelined-sets-past-the-unacked-bytes",
         H((1, ((Op.SET, b"/h0", b"x"), (Op.GETNUMKEYS,))),
           (0, tuple((Op.SET, b"/h%d" % i, Big(8 * MiB, b"h")) for i in range(40)) + ((Op.GETNUMKEYS,),)),
           (1, ((Op.GETNUMKEYS,),)), where=(1, 1)),
         note="torch: 40 keys. A proxy once pushed all 320 MiB onto its link before the store host's next ACK, "
              "past its 256 MiB bound of unacknowledged frames, and dropped every client (1 run in 3): a client's "
              "write now waits while a link holds 16 MiB (max_unacked_bytes / 16) unacknowledged or queued, "
              "so at most one 8 MiB write beyond that; a relaying proxy stops reading a node's link meanwhile",
         runs=4, heavy=True),
    Case("wait-with-a-queue-key",
         H((0, ((Op.QUEUE_PUSH, b"/a", b"1"), (Op.WAIT, (b"/a", b"/b")))), (1, ((Op.COMPARE_SET, b"/b", b"", b"/a"),))),
         ALL, "wait-on-queue-key", "torch: client 0's WAIT is not answered; tierrun answers it",
         deviates=(1, "c0[b'\\x00'], c1[b'\\x02\\x00\\x00\\x00\\x00\\x00\\x00\\x00/a']")),
    Case("queue-push-and-a-repeated-wait-key",
         H((1, ((Op.WAIT, (b"/a", b"/a", b"/a/0", b"/c")),)), (0, ((Op.QUEUE_PUSH, b"/a", b"/a"), (Op.ADD, b"/a", 4)))),
         ALL, "queue-push-wait-count", "torch answers client 1's WAIT though /a/0 and /c are missing",
         deviates=(1, "c0[b'\\x04\\x00\\x00\\x00\\x00\\x00\\x00\\x00']")),
    Case("set-after-failed-add",
         H((1, ((Op.APPEND, b"/a", b"/a"), (Op.GETNUMKEYS,))), (0, ((Op.ADD, b"/a", 1), (Op.SET, b"/a", b"1"))),
           (1, ((Op.MULTI_GET, (b"/a",)),)), where=(3, 0)),
         PROXIES, "after-failure-executed", "torch: /a still b'/a'; through a proxy the SET took effect"),
    Case("barrier-after-failed-add",
         H((0, ((Op.SET, b"/b", b"/a"), (Op.GETNUMKEYS,))), (0, ((Op.ADD, b"/b", 0), (Op.BARRIER, b"/a", 3))),
           (1, ((Op.GETNUMKEYS,),)), where=(1, 0)),
         PROXIES, "after-failure-executed"),
    Case("barrier-count-overflows",
         H((0, ((Op.SET, b"/n", b"9223372036854775807"), (Op.GETNUMKEYS,))), (0, ((Op.BARRIER, b"/n", 3),)),
           (1, ((Op.GET, b"/n"),))),
         ALL, "barrier-overflow"),
    Case("multi-set-with-a-key-past-the-limit",
         H((0, ((Op.MULTI_SET, (b"/a", Big(8193, b"k"), b"/b"), (b"1", b"2", b"3")),)), (1, ((Op.GET, b"/a"),))),
         ALL, "multi-set-partial", "torch: /a is b'1' (set before the bad key), /b unset; tierrun: neither"),
    Case("multi-set-read-in-part",
         H((0, ((RAW, bytes((Op.MULTI_SET,)) + _u64(2) + _u64(2) + b"/a" + _u64(1) + b"1" + _u64(2) + b"/b"),)),
           (1, ((Op.CHECK, (b"/a",)),))),
         ALL, "multi-set-atomic", "torch: /a is READY while c0's MULTI_SET is still arriving; tierrun: NOT_READY",
         deviates=(1, "c1[b'\\x01']")),
    Case("multi-set-with-a-value-past-the-limit",
         H((0, ((Op.MULTI_SET, (b"", b"/b", b""), (b"-", b"-", Big(8 * MiB + 1))),)), (1, ((Op.DELETE_KEY, b""),))),
         ALL, "multi-set-partial"),

    # -- oracle artifacts fixed on the way, and edges that pass: every target must pass ---------
    Case("long-answer-then-close",
         H((0, ((Op.SET, b"/a", Big(8 * MiB)), (Op.GETNUMKEYS,))), (0, ((Op.COMPARE_SET, b"/a", b"", b"/a"),
                                                                        (Op.ADD, b"/a", 100)))),
         note="torch queues the 8 MiB answer, then closes: libuv cancels the write, the client gets nothing; "
              "tierrun sends it, then closes (accepted: sequential.LOST_ON_CLOSE)"),
    Case("long-write-then-wait",
         H((0, ((Op.SET, b"/b", b"/a"), (Op.APPEND, b"1", Big(5 * MiB)), (Op.WAIT, (b"/b",)))),),
         note="torch reads the 5 MiB in 4 KiB reads and answered the probe on another connection before the "
              "WAIT: its answer came after the step (the runner now waits until the server read the write, "
              "then settles 0.1 s: read is not yet executed, and a loaded CI machine saw the answer late)"),
    Case("multi-get-of-no-keys", H((0, ((Op.MULTI_GET, ()), (Op.GETNUMKEYS,))),),
         note="answered with no bytes (the reply reader once waited for one)"),
    Case("list-keys-order",
         H((0, ((Op.SET, b"/b", b"1"), (Op.SET, b"/a", b"2"), (Op.SET, b"", b"3"), (Op.LIST_KEYS,))),),
         note="torch lists keys in its hash table's order: compared as a set"),
    Case("add-wraps-at-int64",
         H((0, ((Op.ADD, b"/a", I64_MAX),)), (1, ((Op.ADD, b"/a", 1),)), (0, ((Op.ADD, b"/a", I64_MIN),)),
           (1, ((Op.ADD, b"/a", -1),))),
         note="one ADD per step: nothing to merge, the store host wraps as torch does"),
    Case("add-to-numbers-torch-parses",
         H((0, ((Op.SET, b"/a", b" 12"), (Op.ADD, b"/a", 1))), (0, ((Op.SET, b"/b", b"12abc"), (Op.ADD, b"/b", 1))),
           (0, ((Op.SET, b"/c", b"9223372036854775808"), (Op.ADD, b"/c", 1))), (1, ((Op.GET, b"/c"),))),
         note="std::stoll: leading blanks, trailing junk; out of range closes the connection"),
    Case("compare-set-on-missing-key-wakes",
         H((0, ((Op.WAIT, (b"/a",)),)), (1, ((Op.COMPARE_SET, b"/a", b"x", b"y"),)), (0, ((Op.GET, b"/a"),))),
         note="torch answers the WAIT although the key stays missing"),
    Case("delete-during-wait",
         H((0, ((Op.WAIT, (b"/a", b"/b")),)), (1, ((Op.SET, b"/a", b"1"), (Op.DELETE_KEY, b"/a"))),
           (1, ((Op.SET, b"/b", b"1"), (Op.GETNUMKEYS,))), (0, ((Op.CHECK, (b"/a", b"/b")),))),
         note="the WAIT counts keys as they appear: answered though /a is gone again"),
    Case("barrier-of-three",
         H((0, ((Op.BARRIER, b"/bar", 3),)), (1, ((Op.BARRIER, b"/bar", 3),)), (2, ((Op.GET, b"/bar"),)),
           (2, ((Op.BARRIER, b"/bar", 3),)), (0, ((Op.BARRIER, b"/bar", 0),)), where=(0, 1, 3))),
    Case("queue-and-key-of-one-name",
         H((0, ((Op.QUEUE_PUSH, b"/a", b"q1"), (Op.SET, b"/a", b"v"), (Op.QUEUE_LEN, b"/a"))),
           (1, ((Op.QUEUE_POP, b"/a"), (Op.QUEUE_POP, b"/a"), (Op.GET, b"/a"), (Op.GETNUMKEYS,))), where=(1, 2))),
    Case("values-at-the-limits",
         H((0, ((Op.SET, Big(8192, b"k"), Big(8 * MiB)), (Op.GET, Big(8192, b"k")))),
           (1, ((Op.SET, b"/a", Big(8 * MiB + 1)),)), (0, ((Op.GETNUMKEYS,),)), where=(2, 1))),
    Case("multi-get-of-128-ki-keys",
         H((0, ((Op.MULTI_GET, (b"/never",) * KEYS_LIMIT),)), (0, ((Op.MULTI_GET, (b"/never",) * (KEYS_LIMIT + 1)),)))),
    Case("wait-cancelled",
         H((0, ((Op.WAIT, (b"/a",)),)), (1, ((Op.GETNUMKEYS,),)), (0, ((Op.GET, b"/a"),)),
           (1, ((Op.SET, b"/a", b"1"), (Op.GETNUMKEYS,))), where=(3, 0)),
         note="client 0 cancels its pending WAIT before its GET (the runner does, as torch's client)"),
]

CONCURRENT = [
    ConcurrentCase(
        "tree-get-then-wait",
        ConcurrentHistory(
            [[((Op.ADD, b"/k2", 3),), ((Op.COMPARE_SET, b"/k3", b"", b"1"),),
              ((Op.GET, b"/k2"), (Op.WAIT, (b"/k0", b"/k1")))],
             [((Op.SET, b"/k1", b"3"),)],
             [((Op.SET, b"/k0", b"2"), (Op.WAIT, (b"/k0",))), ((Op.WAIT, (b"/k0", b"/k1")),)]],
            [[0.0] * 3, [0.0], [0.0] * 2], (0, 0, 0)),
        ("tree",), "tree-reply-order",
        note="client 0 gets the WAIT's b'\\x00' before its GET's answer in about 1 run of 5 (never with the "
             "GET in a burst of its own)"),
]
