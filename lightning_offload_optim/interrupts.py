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
from typing import Any

#: A second SIGINT this soon after the first is the same Ctrl-C, sent twice (launchers such as
#: ``pixi run`` forward the terminal's signal to a child that received it too).
SAME_PRESS_SECONDS = 0.5


def deliver_sigint(handler: Any) -> None:
    """Deliver SIGINT now to ``handler`` (``signal.getsignal``'s answer), as if it had just
    arrived: a Python handler is called (Python's default raises ``KeyboardInterrupt``), the
    default action is taken; an ignored one, or one set outside Python, is dropped. Called, not
    sent again: an event loop's wakeup file descriptor heard of it once already."""
    if callable(handler):
        handler(signal.SIGINT, sys._getframe(1))
    elif handler is signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)


class SigintHold:
    """Holds SIGINT from :meth:`start` to :meth:`end`, which delivers it to the handler it was
    meant for.

    A second SIGINT, :data:`SAME_PRESS_SECONDS` or more after the first, is delivered at once
    (the user insists). Nothing is held outside the main thread (only it receives signals in
    Python), where SIGINT is ignored or handled outside Python, or while another hold holds it.
    A hold whose end never comes (an exception in between) is undone when its handler is
    replaced, as Lightning's teardown restores the handlers it found at the start of ``fit``.
    """

    def __init__(self) -> None:
        self.arrived = False
        self._delivered = False
        self._first = 0.0
        self._meant_for: Any = None
        self._handler: Any = None

    @property
    def holding(self) -> bool:
        return self._handler is not None and signal.getsignal(signal.SIGINT) is self._handler

    def start(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        meant_for = signal.getsignal(signal.SIGINT)
        if meant_for in (None, signal.SIG_IGN) or getattr(meant_for, "holds_sigint", False):
            return
        self.arrived, self._delivered, self._meant_for = False, False, meant_for
        self._handler = self._hold  # one bound method: what getsignal() gives back
        signal.signal(signal.SIGINT, self._handler)

    def _hold(self, signum: int, frame: Any) -> None:
        if not self.arrived:
            self.arrived, self._first = True, time.monotonic()
        elif time.monotonic() - self._first >= SAME_PRESS_SECONDS:
            self._delivered = True
            signal.signal(signal.SIGINT, self._meant_for)
            deliver_sigint(self._meant_for)

    _hold.holds_sigint = True  # type: ignore[attr-defined]

    def end(self) -> None:
        """Give SIGINT back to its handler and deliver a held one to it."""
        if not self.holding:
            self._handler = None
            return
        self._handler = None
        signal.signal(signal.SIGINT, self._meant_for)
        if self.arrived and not self._delivered:
            self._delivered = True
            deliver_sigint(self._meant_for)


@contextlib.contextmanager
def keyboard_interrupts_held() -> Iterator[None]:
    """Hold SIGINT in the block (:class:`SigintHold`); a held one is raised when it ends.

    Example:
        >>> with keyboard_interrupts_held():
        ...     pass  # a Ctrl-C here is raised when the block ends
    """
    hold = SigintHold()
    hold.start()
    try:
        yield
    finally:
        hold.end()
