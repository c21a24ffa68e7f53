"""The torch TCPStore wire protocol, sans I/O: bytes in, requests out, replies to bytes."""

from .limits import Limits
from .opcodes import Op
from .parser import LimitExceeded, ProtocolError, Request, RequestParser

__all__ = ["LimitExceeded", "Limits", "Op", "ProtocolError", "Request", "RequestParser"]
