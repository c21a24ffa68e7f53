"""Frames sent on a session but not yet acknowledged, kept to resend after a reconnect.

Sans I/O. Frames are numbered 1, 2, ... in the order sent; the peer acknowledges "all up
to n". O(1) per frame added or acknowledged. The buffer is bounded in bytes: a peer that
stops acknowledging (gone, or a partition longer than the grace period) cannot make us
hold more than ``max_bytes``.
"""

from __future__ import annotations

from collections import deque

from .frames import LinkError


class Outbox:
    def __init__(self, max_bytes: int) -> None:
        self.sent = 0  # number of the last frame added
        self.acked = 0  # the peer has every frame up to this one
        self.bytes = 0
        self.max_bytes = max_bytes
        self._frames: deque[bytes] = deque()  # frames acked+1 .. sent

    def add(self, data: bytes) -> None:
        """Number and keep ``data``. Raises LinkError past ``max_bytes``."""
        self.sent += 1
        self._frames.append(data)
        self.bytes += len(data)
        if self.bytes > self.max_bytes:
            raise LinkError(
                f"{self.bytes} bytes sent and not acknowledged by the peer (limit {self.max_bytes})"
            )

    def ack(self, upto: int) -> None:
        """The peer has received every frame up to ``upto``. Raises LinkError for a count
        we never sent."""
        if upto > self.sent:
            raise LinkError(f"peer acknowledges frame {upto}, only {self.sent} were sent")
        frames = self._frames
        while self.acked < upto:
            self.bytes -= len(frames.popleft())
            self.acked += 1

    def since(self, received: int) -> list[bytes]:
        """After a reconnect: the frames after ``received``, the peer's count. Acknowledges
        up to it. Raises LinkError if the peer claims frames we never sent or lacks
        frames it had acknowledged (it is not the peer of this session)."""
        if received < self.acked:
            raise LinkError(f"peer has {received} frames but had acknowledged {self.acked}")
        self.ack(received)
        return list(self._frames)
