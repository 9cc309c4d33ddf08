"""How the ``jspec`` command ends: one line on stderr and an exit code, never a traceback.

- bad input (any :class:`jspec.JspecError`, an option argparse refuses, a file the system
  will not read, a run that does not fit in memory): ``jspec: error: ...``, exit 2;
- Ctrl-C (SIGINT) at any moment after start-up, whatever JAX is doing (loading, compiling, in
  a device loop, in a garbage-collection callback): ``jspec: interrupted``, exit 130;
- a bug: ``jspec: internal error: ...``, exit 1 (``JSPEC_DEBUG=1`` re-raises for the traceback).

Ctrl-C does not go through ``KeyboardInterrupt``: raised inside a callback it is printed as
"Exception ignored" and lost, and the run goes on. Instead the signal is forwarded, by
Python's C-level handler, to a pipe (``signal.set_wakeup_fd``) that a watcher thread reads;
the watcher writes the line with ``os.write`` and leaves with ``os._exit(130)``, so it works
while the main thread is blocked in a long XLA call. Files are written atomically (temporary
name, then rename), so an interrupted run leaves no half-written checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable

EXIT_BUG, EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 1, 2, 130, 141
MAX_MESSAGE = 2000

_exiting = threading.Lock()


def one_line(message: str) -> str:
    """The first non-empty line of ``message``, cut to a readable length."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 3] + "..."


def fail(message: str) -> int:
    print(f"jspec: error: {one_line(message)}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _exit_interrupted() -> None:
    if not _exiting.acquire(blocking=False):
        return  # another thread is already leaving
    try:
        os.write(2, b"jspec: interrupted\n")
    except OSError:
        pass
    os._exit(EXIT_INTERRUPTED)


def _watch(read_fd: int) -> None:
    try:
        while True:
            data = os.read(read_fd, 512)
            if not data:  # the write end closed: the guarded call returned
                return
            if signal.SIGINT in data:
                _exit_interrupted()
    finally:
        os.close(read_fd)


@contextlib.contextmanager
def interrupts():
    """Within this block, SIGINT prints one line and exits 130 (see the module docstring).
    Outside the main thread (where signals cannot be handled) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    old_handler = signal.signal(signal.SIGINT, lambda signum, frame: _exit_interrupted())
    old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read_fd,), daemon=True, name="jspec-sigint").start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGINT, old_handler)
        os.close(write_fd)


def _oserror_message(e: OSError) -> str:
    what = e.strerror or str(e) or type(e).__name__
    return f"{e.filename}: {what}" if e.filename else what


def run(fn: Callable[[], int]) -> int:
    """``fn()`` with every way out mapped to an exit code and at most one line on stderr."""
    from jspec.errors import JspecError

    with interrupts():
        try:
            return fn()
        except SystemExit as e:  # argparse: --help (0) or a refused option (2, its line printed)
            return 0 if e.code is None else e.code if isinstance(e.code, int) else fail(str(e.code))
        except JspecError as e:
            return fail(str(e) or type(e).__name__)
        except KeyboardInterrupt:  # only where the handler could not be installed
            print("jspec: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except BrokenPipeError:  # `jspec generate ... | head`: the reader left
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_BROKEN_PIPE
        except MemoryError as e:
            return fail(f"out of memory{': ' + str(e) if str(e) else ''}")
        except OSError as e:
            return fail(_oserror_message(e))
        except Exception as e:
            if "RESOURCE_EXHAUSTED" in str(e):  # XLA ran out of device memory
                return fail(f"out of device memory ({one_line(str(e))})")
            if os.environ.get("JSPEC_DEBUG"):
                raise
            print(f"jspec: internal error: {type(e).__name__}: {one_line(str(e))} "
                  "(a bug; set JSPEC_DEBUG=1 for the traceback)", file=sys.stderr)
            return EXIT_BUG
