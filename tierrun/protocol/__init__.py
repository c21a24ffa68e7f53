"""The torch TCPStore wire protocol, sans I/O: bytes in, requests out, replies to bytes."""

from .limits import Limits
from .opcodes import Op
from .parser import ProtocolError, Request, RequestParser

__all__ = ["Limits", "Op", "ProtocolError", "Request", "RequestParser"]
