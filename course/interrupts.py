"""Ctrl-C, SIGTERM and SIGHUP (a closed terminal): how every command stops (given).

main.py turns each into a KeyboardInterrupt that names it, so one clean-up serves all three:
forked ranks are killed and their folder removed (course/launch.py), grade's pytest is killed
with its ranks (course/grade.py), and the command ends in one line that says what stopped it.
Nothing heavy is imported here: the handlers are in place before torch is.
"""
from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def interrupt_on_signals(under_torchrun: bool):
    """SIGTERM and SIGHUP stop a command as Ctrl-C does. The first one counts: later ones (a second
    Ctrl-C) are ignored, so they cannot cut the clean-up short. Under torchrun, SIGTERM and SIGHUP
    are torchrun's way of stopping a rank: they keep their default."""
    signals = (signal.SIGINT,) if under_torchrun else SIGNALS

    def interrupt(signum, frame):
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt("Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name)

    for s in signals:
        signal.signal(s, interrupt)


def interruption(exc: KeyboardInterrupt) -> str:
    """What interrupted: 'Ctrl-C', or the signal interrupt_on_signals named ('SIGTERM')."""
    return str(exc.args[0]) if exc.args else "Ctrl-C"


@contextlib.contextmanager
def signals_deferred():
    """A block that must not be cut short (starting processes, cleaning up after them): Ctrl-C,
    SIGTERM and SIGHUP that arrive meanwhile are delivered again once it is done, to their usual
    handler."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread handles signals
        return
    received = []
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)
