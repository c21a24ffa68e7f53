"""Opcodes and reply codes of torch's TCPStore wire protocol.

Requests are normalised to the torch 2.2+ numbering (`Op`). A torch 2.1 client numbers
every opcode one lower and has no VALIDATE; the parser translates per connection.
"""

from enum import IntEnum


class Op(IntEnum):
    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18


#: The first request of every torch >= 2.2 connection is VALIDATE with this magic.
VALIDATION_MAGIC = 0x3C85F7CE

#: torch 2.1 knew SET (0) … CANCEL_WAIT (11): one lower than today.
TORCH21_MAX_OPCODE = Op.CANCEL_WAIT - 1

# Single-byte replies.
CHECK_READY = b"\x00"
CHECK_NOT_READY = b"\x01"
STOP_WAITING = b"\x00"
WAIT_CANCELED = b"\x01"

#: Requests the torch client sends without waiting for an answer.
NO_REPLY_OPS = frozenset({Op.VALIDATE, Op.SET, Op.APPEND, Op.MULTI_SET, Op.QUEUE_PUSH})
#: Answered when the store changes, maybe much later: the only requests a store defers.
WAITING_OPS = frozenset({Op.WAIT, Op.BARRIER})
#: Reads a front-end may answer from a watch of their one key (a link's WATCH entry).
WATCHABLE_OPS = frozenset({Op.CHECK, Op.GET, Op.WAIT})
