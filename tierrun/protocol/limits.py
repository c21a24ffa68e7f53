"""Size limits on what one client may send (torch's libuv server uses the same defaults)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    #: Longest key, in bytes.
    max_key_bytes: int = 8 * 1024
    #: Longest value, in bytes.
    max_value_bytes: int = 8 * 1024 * 1024
    #: Most keys in one CHECK / WAIT / MULTI_GET / MULTI_SET.
    max_keys_per_request: int = 128 * 1024
    #: Most bytes one request may occupy in total: bounds what a client can make the
    #: server hold for a single unfinished request.
    max_request_bytes: int = 256 * 1024 * 1024

    def within(self, other: "Limits") -> "Limits":
        """Each limit the smaller of this one's and ``other``'s: what a front-end whose
        requests go on to a store with limits ``other`` may accept."""
        return Limits(min(self.max_key_bytes, other.max_key_bytes), min(self.max_value_bytes, other.max_value_bytes),
                      min(self.max_keys_per_request, other.max_keys_per_request),
                      min(self.max_request_bytes, other.max_request_bytes))
