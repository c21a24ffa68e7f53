"""Size limits: what one client may send (torch's libuv server uses the same defaults),
and the budgets of what the store holds and answers (torch's server has none)."""

from __future__ import annotations

from dataclasses import dataclass, replace

MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    #: Longest key, in bytes.
    max_key_bytes: int = 8 * 1024
    #: Longest value, in bytes (an APPEND's resulting value too).
    max_value_bytes: int = 8 * MiB
    #: Most keys in one CHECK / WAIT / MULTI_GET / MULTI_SET.
    max_keys_per_request: int = 128 * 1024
    #: Most bytes one request may occupy in total: bounds what a client can make the
    #: server hold for a single unfinished request.
    max_request_bytes: int = 256 * MiB
    #: Store-wide budget: bytes of keys and values (queued values included) the store
    #: holds. A write past it is refused (its client is closed, as torch's server
    #: closes a client whose request fails); the store and every other client go on.
    max_store_bytes: int = 1024 * MiB
    #: Store-wide budget: keys, plus queues and their queued values, plus the keys WAITs
    #: and BARRIERs wait for while they wait (a 2 MiB WAIT on 131,072 missing keys held
    #: ~40 MB before they counted, for as long as it waited). Bounds the memory
    #: the store spends per key besides its bytes (~200 B in CPython), and the time of a
    #: full scan (LIST_KEYS: about 1 s per million keys on a busy core).
    max_store_keys: int = 1024 * 1024
    #: Largest answer to one request (MULTI_GET, LIST_KEYS), measured before it is
    #: built: a request whose answer would be larger is refused (its client closed).
    #: At least a value's answer (a GET or QUEUE_POP of the largest value); by default
    #: 17 values of the largest size: a proxy folds up to 16 GETs into one MULTI_GET.
    max_reply_bytes: int = 136 * MiB
    #: Per client connection, at the store host and at every proxy: bytes of answers the
    #: client has not read, plus the answers held for it (an invalidation round), plus
    #: what its requests still on their way upstream may bring back (each counted at
    #: its largest). Past ~1 MiB of them its next requests wait until it reads (flow
    #: control); past this budget it is closed. At least ``max_reply_bytes`` + 1 MiB.
    max_unread_bytes: int = 144 * MiB
    #: Per front-end process (the store host, a proxy): bytes held for requests being
    #: received and not complete yet, all connections together. Past it, the
    #: connections whose unfinished requests began longest ago are closed until the
    #: total is within it (a client that sends most of a large request and stops holds
    #: its bytes: one MULTI_SET may be ``max_request_bytes``). At least ``max_request_bytes``.
    max_unfinished_bytes: int = 512 * MiB
    #: Per front-end process: bytes of answers written and not read by their clients,
    #: all connections together (each counted once it holds more than the socket's
    #: buffer: 64 KiB). Past it, the connections that stopped reading longest ago (2 s
    #: or more: ``frontend.connection.UNREAD_GRACE``) are closed at once (what they hold is freed): one client that does not read is held
    #: to ``max_unread_bytes``, this holds them all. At least ``max_reply_bytes`` + 1 MiB.
    max_unread_total_bytes: int = 512 * MiB

    def within(self, other: Limits) -> Limits:
        """Each size limit the smaller of this one's and ``other``'s: what a front-end
        whose requests go on to a store with limits ``other`` may accept."""
        return replace(self, max_key_bytes=min(self.max_key_bytes, other.max_key_bytes),
                       max_value_bytes=min(self.max_value_bytes, other.max_value_bytes),
                       max_keys_per_request=min(self.max_keys_per_request, other.max_keys_per_request),
                       max_request_bytes=min(self.max_request_bytes, other.max_request_bytes),
                       max_reply_bytes=min(self.max_reply_bytes, other.max_reply_bytes))

    def problem(self) -> str | None:
        """What is inconsistent in these limits, for a person to fix; None if nothing."""
        for name, value in vars(self).items():
            if value < 1:
                return f"{_flag(name)} {value}: write a positive number"
        if self.max_reply_bytes < self.max_value_bytes + 64:
            return (f"{_flag('max_reply_bytes')} {self.max_reply_bytes} is below the answer to a GET of the "
                    f"largest value ({_flag('max_value_bytes')} {self.max_value_bytes}, plus 64): raise it")
        if self.max_unfinished_bytes < self.max_request_bytes:
            return (f"{_flag('max_unfinished_bytes')} {self.max_unfinished_bytes} is below one request's "
                    f"({_flag('max_request_bytes')} {self.max_request_bytes}): raise it")
        if self.max_unread_total_bytes < self.max_reply_bytes + MiB:
            return (f"{_flag('max_unread_total_bytes')} {self.max_unread_total_bytes} leaves no room for the "
                    f"largest answer ({_flag('max_reply_bytes')} {self.max_reply_bytes}) plus 1 MiB: raise it")
        if self.max_unread_bytes < self.max_reply_bytes + MiB:
            return (f"{_flag('max_unread_bytes')} {self.max_unread_bytes} leaves no room for the largest "
                    f"answer ({_flag('max_reply_bytes')} {self.max_reply_bytes}) plus 1 MiB: raise it")
        return None


def _flag(field_name: str) -> str:
    """The command-line flag of a field: ``max_store_bytes`` -> ``--max-store-bytes``."""
    return "--" + field_name.replace("_", "-")
