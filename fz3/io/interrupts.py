"""A rank that a signal interrupts in the middle of a multi-rank save tells the others before it
stops, so they raise an error naming it and its signal instead of a raw transport error.

    save step raises KeyboardInterrupt (SIGINT)  --caught-->  the rank reports SIGINT to the
    or Interrupted (SIGTERM, inside `raising`)                others (fz3/interpreters/agree.py
                                                              outcomes), then `resume`s: raises
                                                              KeyboardInterrupt again / ends by
                                                              SIGTERM, as it would have

[Note: interrupted saves] Python turns SIGINT into KeyboardInterrupt, so a rank hit by Ctrl-C
while it writes its shard unwinds; SIGTERM's default handler (the one torchrun and most job
schedulers send first) ends the process at once, telling no one. Either way its peers then
failed in their next collective with gloo's "Connection closed by peer", which names neither
the rank nor why. During fz3's save, SIGTERM (where its handler is the default and this is the
main thread, where Python runs handlers) raises `Interrupted` instead; the save catches both,
every rank learns the code (100 + the signal's number), and the interrupted rank then stops as
the signal would have stopped it: KeyboardInterrupt raised again, or SIGTERM sent to itself again
under its default handler. The handler is put back when the save returns: a library leaves the
process's signal handling as it found it. SIGKILL (and a SIGTERM whose default handler could not
be replaced) cannot be caught: the peers name that rank as gone (its connection closed).
DeepSpeed: nothing; its peers wait in the next collective until the group's timeout.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator, NoReturn

INTERRUPTED = 100
"""A rank's outcome code for a signal: INTERRUPTED + its number (an error is 1, success 0)."""


class Interrupted(BaseException):
    """SIGTERM (or another signal `raising` catches) delivered inside `raising`: a BaseException,
    as KeyboardInterrupt is, so code that catches Exception does not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} received")
        self.signum = signum


@contextlib.contextmanager
def raising(signums: tuple[int, ...] = (signal.SIGTERM,)) -> Iterator[None]:
    """Inside the block, each of `signums` whose handler is the default raises Interrupted; on
    the way out the handlers are put back. Off the main thread, nothing changes (Python runs
    handlers on the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    def handler(signum, frame):
        raise Interrupted(signum)
    old = {s: signal.getsignal(s) for s in signums}
    for s, h in old.items():
        if h is signal.SIG_DFL:
            signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in old.items():
            if h is signal.SIG_DFL:
                signal.signal(s, h)


def signal_of(e: BaseException | None) -> int | None:
    """The signal an exception stands for: SIGINT for KeyboardInterrupt, Interrupted's own; None
    for anything else."""
    if isinstance(e, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(e, Interrupted):
        return e.signum
    return None


def code_of(e: BaseException | None) -> int:
    """A rank's outcome code: 0 (no exception), INTERRUPTED + the signal, or 1 (an error)."""
    if e is None:
        return 0
    s = signal_of(e)
    return 1 if s is None else INTERRUPTED + int(s)


def words(code: int) -> str:
    """'interrupted by SIGINT (KeyboardInterrupt)' for an outcome code above INTERRUPTED."""
    name = signal.Signals(code - INTERRUPTED).name
    return f"interrupted by {name}" + (" (KeyboardInterrupt, Ctrl-C)" if name == "SIGINT" else "")


def resume(e: BaseException) -> NoReturn:
    """Stop as the signal would have: KeyboardInterrupt raised again; a signal Interrupted stood
    for sent again under its default handler (the process ends with its status)."""
    if isinstance(e, Interrupted):
        signal.signal(e.signum, signal.SIG_DFL)
        os.kill(os.getpid(), e.signum)
    raise e
