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
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def keyboard_interrupts_held() -> Iterator[None]:
    """Hold SIGINT until the block ends, then deliver it to the handler it was meant for.

    A second SIGINT inside the block is delivered at once (the user insists). Nothing is held
    outside the main thread (only it receives signals in Python) or where SIGINT is ignored or
    handled outside Python.

    Example:
        >>> with keyboard_interrupts_held():
        ...     pass  # a Ctrl-C here is raised when the block ends
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    meant_for = signal.getsignal(signal.SIGINT)
    if meant_for is None or meant_for is signal.SIG_IGN:
        yield
        return
    held = False

    def deliver() -> None:
        signal.signal(signal.SIGINT, meant_for)
        signal.raise_signal(signal.SIGINT)

    def hold(signum: int, frame: object) -> None:
        nonlocal held
        if held:
            deliver()
        held = True

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is hold:  # not yet given back by a second Ctrl-C
            signal.signal(signal.SIGINT, meant_for)
            if held:
                signal.raise_signal(signal.SIGINT)
