"""``python -m tierrun.launcher.worker_main script.py args`` (or ``-m module args``):
run a worker's script unchanged, but record an uncaught exception in the error file
torch's agent gives every worker (``TORCHELASTIC_ERROR_FILE``), as ``@record`` would.

So the failure report shows the error of a script that does not use ``@record``.
The script runs as ``__main__`` with the ``sys.argv`` and ``sys.path[0]`` Python would
give it; the exit code and the traceback on stderr are Python's own.
"""

from __future__ import annotations

import atexit
import builtins
import json
import os
import pkgutil
import runpy
import signal
import sys
import time
import traceback
import types
import zipfile
from importlib.machinery import SourceFileLoader, SourcelessFileLoader
from types import TracebackType


def _script_frames(tb: TracebackType | None) -> TracebackType | None:
    """The traceback without this module's and runpy's frames: what Python would show."""
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>", runpy.__file__):
        tb = tb.tb_next
    return tb


def _record(exc: BaseException, message: str | None = None, callstack: str | None = None) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):  # the script's own @record already wrote it
        return
    now = time.time()
    data = {"message": {"message": message or f"{type(exc).__name__}: {exc}", "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        if callstack is None else callstack,
        "timestamp": str(int(now)), "tierrun_time": now,
    }}}
    # (whole or not at all: torch's agent parses the file, and an empty one left by a
    # full disk crashed it, where without this wrapper there would be no file)
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as f:
            f.write(json.dumps(data))
        os.replace(partial, path)
    except OSError:
        try:
            os.unlink(partial)
        except OSError:
            pass


_interrupted: list[BaseException] = []


def _die_by_sigint() -> None:
    """Registered before the script runs (atexit runs handlers last-in first-out: this one
    last, after the script's own clean-up), it ends an interrupted worker by SIGINT."""
    if _interrupted:
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


def _run_file(path: str) -> None:
    """Run the script file at ``path`` (absolute) as ``python script`` does: as
    ``__main__`` (which it stays once its body ends: its atexit handlers and threads
    still pickle its classes), ``__file__`` absolute, ``sys.argv[0]`` as written
    (``runpy.run_path`` would make it ``path``); source or compiled (``.pyc``)."""
    with open(path, "rb") as f:
        code = pkgutil.read_code(f)  # (a .pyc of this Python's; else None)
        loader = SourcelessFileLoader if code is not None else SourceFileLoader
        if code is None:
            f.seek(0)  # (bytes: compile reads the source's coding line, as Python does)
            code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __package__=None, __spec__=None, __builtins__=builtins,
                         __loader__=loader("__main__", path), __annotations__={})
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def main() -> None:
    atexit.register(_die_by_sigint)
    args = sys.argv[1:]
    if args[:1] == ["-m"]:
        sys.argv = args[1:]
        run = lambda: runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        script = os.path.abspath(args[0])  # (its __file__, as Python gives it)
        if not os.path.exists(script):  # (Python's message and exit code)
            message = f"can't open file {script!r}: [Errno 2] No such file or directory"
            print(f"{sys.executable}: {message}", file=sys.stderr)
            _record(FileNotFoundError(message), message, "")
            sys.exit(2)
        if os.path.isfile(script) and not zipfile.is_zipfile(script):
            sys.path[0] = os.path.dirname(os.path.realpath(script))  # (symbolic links resolved, as Python does)
            run = lambda: _run_file(script)
        else:  # a directory or zip file with a __main__.py: on sys.path itself, run as Python runs it
            sys.path[0] = script
            run = lambda: runpy._run_module_as_main("__main__", alter_argv=False)  # type: ignore[attr-defined]
    try:
        run()
    except SystemExit as e:
        # timed when called: the process ends later, after Python's and Gloo's clean-up,
        # which fails its peers' collectives first (the report must not blame them); its
        # traceback says where the script exited (Python prints none)
        code = e.code if isinstance(e.code, int) or e.code is None else 1
        if code:
            e.__traceback__ = _script_frames(e.__traceback__)
            _record(e, f"exited with code {code}")
        raise
    except BaseException as e:
        e.__traceback__ = _script_frames(e.__traceback__)
        _record(e)
        sys.excepthook(type(e), e, e.__traceback__)  # as Python would, then its exit code
        if isinstance(e, KeyboardInterrupt):  # (Python ends by SIGINT then, after its clean-up)
            _interrupted.append(e)
        sys.exit(1)


if __name__ == "__main__":
    main()
