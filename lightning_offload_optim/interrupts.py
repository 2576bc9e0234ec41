"""Ctrl-C during an update waits for the update to finish.

A ``KeyboardInterrupt`` between two chunks would leave a step half applied, which cannot be
undone cheaply: the optimizer would then refuse to be saved, and Lightning's graceful shutdown
(``OnExceptionCheckpoint``) would save nothing. torch's fused AdamW is a single kernel call that
Python cannot interrupt, so its state is always whole; holding SIGINT for the few hundred
milliseconds an update takes gives this optimizer the same property.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

#: A second SIGINT this soon after the first is the same Ctrl-C, sent twice (launchers such as
#: ``pixi run`` forward the terminal's signal to a child that received it too).
SAME_PRESS_SECONDS = 0.5

_depth = 0  # blocks holding SIGINT now (main thread only): an inner one holds nothing itself


@dataclass
class HeldInterrupt:
    """What a block held: whether a Ctrl-C arrived, and whether it was delivered already."""

    arrived: bool = False
    delivered: bool = False


def deliver_sigint(handler: Any) -> None:
    """Deliver SIGINT now to ``handler`` (``signal.getsignal``'s answer), as if it had just
    arrived: a Python handler is called (Python's default raises ``KeyboardInterrupt``), the
    default action is taken; an ignored one, or one set outside Python, is dropped. Called, not
    sent again: an event loop's wakeup file descriptor heard of it once already."""
    if callable(handler):
        handler(signal.SIGINT, sys._getframe(1))
    elif handler is signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)


@contextlib.contextmanager
def keyboard_interrupts_held(deliver: bool = True) -> Iterator[HeldInterrupt]:
    """Hold SIGINT until the block ends, then deliver it (:func:`deliver_sigint`) to the
    handler it was meant for; with ``deliver=False`` the caller delivers it later, when
    :attr:`HeldInterrupt.arrived` says one came (unless the block raised).

    A second SIGINT inside the block, :data:`SAME_PRESS_SECONDS` or more after the first, is
    delivered at once (the user insists). Nothing is held outside the main thread (only it
    receives signals in Python), where SIGINT is ignored or handled outside Python, or inside
    another such block.

    Example:
        >>> with keyboard_interrupts_held():
        ...     pass  # a Ctrl-C here is raised when the block ends
    """
    global _depth
    held = HeldInterrupt()
    meant_for = signal.getsignal(signal.SIGINT)
    if (
        _depth
        or meant_for is None
        or meant_for is signal.SIG_IGN
        or threading.current_thread() is not threading.main_thread()
    ):
        yield held
        return
    first = 0.0

    def hold(signum: int, frame: Any) -> None:
        nonlocal first
        if not held.arrived:
            held.arrived, first = True, time.monotonic()
        elif time.monotonic() - first >= SAME_PRESS_SECONDS:
            signal.signal(signal.SIGINT, meant_for)
            held.delivered = True
            deliver_sigint(meant_for)

    signal.signal(signal.SIGINT, hold)
    _depth += 1
    failed = False
    try:
        yield held
    except BaseException:
        failed = True  # the caller will not deliver it then
        raise
    finally:
        _depth -= 1
        now = signal.getsignal(signal.SIGINT)
        if now is hold:
            signal.signal(signal.SIGINT, meant_for)
            now = meant_for
        if (deliver or failed) and held.arrived and not held.delivered:
            held.delivered = True
            deliver_sigint(now)  # to whoever handles it now (code in the block may have set one)
