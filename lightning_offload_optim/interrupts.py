"""Ctrl-C, and a scheduler's notice, during an update wait for the update to finish.

A ``KeyboardInterrupt`` between two chunks would leave a step half applied, which cannot be
undone cheaply: the optimizer would then refuse to be saved, and Lightning's graceful shutdown
(``OnExceptionCheckpoint``) would save nothing. torch's fused AdamW is a single kernel call that
Python cannot interrupt, so its state is always whole; holding SIGINT for the few hundred
milliseconds an update takes gives this optimizer the same property.

The same holds for the signals by which cluster schedulers announce a requeue or a preemption
(:data:`NOTICE_SIGNALS`), whose Python handlers save checkpoints: Lightning's SLURM
auto-requeue handler saves one from inside SIGUSR1's handler, and preemptible jobs commonly
save on SIGTERM. Run between two chunks, such a handler would save the step counts of the new
step beside moments and weights of the old one, silently, and the requeued job would resume
from that mix.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # CPython's, which signal wraps
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

#: A second SIGINT this soon after the first is the same Ctrl-C, sent twice (launchers such as
#: ``pixi run`` forward the terminal's signal to a child that received it too).
SAME_PRESS_SECONDS = 0.5

# signal.getsignal and signal.signal wrap each answer in an enum (about 1 and 3.5 µs a call,
# paid several times per update); _signal's, which they wrap, answer the same without it
# (SIG_DFL and SIG_IGN as plain ints: compare them with ==).
_getsignal = _signal.getsignal
_setsignal = _signal.signal

#: Held during updates where a Python handler takes them (not where they end the process at
#: once, as by default: nothing is saved then). SLURM's ``--signal`` and Lightning's
#: ``SLURMEnvironment(requeue_signal=...)`` may name any of them.
NOTICE_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP")
    if hasattr(signal, name)
)


def deliver_sigint(handler: Any) -> None:
    """Deliver SIGINT now to ``handler`` (``signal.getsignal``'s answer), as if it had just
    arrived: a Python handler is called (Python's default raises ``KeyboardInterrupt``), the
    default action is taken; an ignored one, or one set outside Python, is dropped. Called, not
    sent again: an event loop's wakeup file descriptor heard of it once already."""
    if callable(handler):
        handler(signal.SIGINT, sys._getframe(1))
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)


class SigintHold:
    """Holds SIGINT from :meth:`start` to :meth:`end`, which delivers it to the handler it was
    meant for.

    Inside it, updates (:func:`signals_held`) run whole: a second SIGINT,
    :data:`SAME_PRESS_SECONDS` or more after the first (the user insists), is delivered as soon
    as no update runs. Nothing is held outside the main thread (only it receives signals in
    Python), where SIGINT is handled outside Python, or while another hold holds it; an ignored
    SIGINT is held, then dropped.
    ``alive`` says whether the hold's owner still runs: a hold whose end never came (an
    exception in between) gives SIGINT back at the next one, which it delivers at once. So does
    an ended hold that something installed again (a handler saved during the hold, restored).
    """

    def __init__(self, alive: Callable[[], bool] = lambda: True) -> None:
        self.arrived = False
        self.updating = 0  # updates running inside the hold
        self._alive = alive
        self._insisted = False
        self._first = 0.0
        self._meant_for: Any = None
        self._handler: Any = None

    @property
    def holding(self) -> bool:
        return self._handler is not None and _getsignal(signal.SIGINT) is self._handler

    @staticmethod
    def current() -> SigintHold | None:
        """The hold holding SIGINT now, if any; one whose owner stopped is ended here."""
        handler = _getsignal(signal.SIGINT)
        owner = getattr(handler, "__self__", None)
        if not isinstance(owner, SigintHold) or not owner.holding:
            return None
        if not owner._alive():
            owner.end()
            return None
        return owner

    def start(self) -> None:
        meant_for = _getsignal(signal.SIGINT)
        if (
            threading.current_thread() is not threading.main_thread()
            or meant_for is None  # set outside Python: it could not be given back
            or SigintHold.current() is not None
        ):
            return
        self.arrived, self._insisted, self._meant_for = False, False, meant_for
        self._handler = self._hold  # one bound method: what getsignal() gives back
        _setsignal(signal.SIGINT, self._handler)

    def _hold(self, signum: int, frame: Any) -> None:
        if self._handler is None:  # ended, yet installed again (a saved handler restored)
            if _getsignal(signal.SIGINT) == self._hold:
                _setsignal(signal.SIGINT, self._meant_for)
            deliver_sigint(self._meant_for)
        elif not self._alive():
            self.arrived = True
            self.end()
        elif not self.arrived:
            self.arrived, self._first = True, time.monotonic()
        elif time.monotonic() - self._first >= SAME_PRESS_SECONDS:
            self._insisted = True
            if not self.updating:
                self.end()

    def update_ended(self) -> None:
        """An update inside the hold ended: deliver now if the user insisted meanwhile."""
        if self._insisted and not self.updating:
            self.end()

    def end(self, deliver: bool = True) -> None:
        """Give SIGINT back to its handler and deliver a held one to it (unless ``deliver`` is
        false: the press was for something that is over). Where something else gave it back
        first (Lightning restores the handlers it saved when a fit ends, before the module's
        ``teardown``), a held one is still delivered; where another handler took SIGINT over,
        it is not: it was not meant for that one."""
        meant_for, holding = self._meant_for, self.holding
        if holding:
            _setsignal(signal.SIGINT, meant_for)
        given_back = holding or _getsignal(signal.SIGINT) == meant_for
        arrived, self.arrived, self._handler = self.arrived, False, None
        if arrived and deliver and given_back:
            deliver_sigint(meant_for)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Run an update whole: SIGINT waits for the block's end, inside the hold holding it now
    (:class:`SigintHold`) or a hold of the block's own, which raises a held one at the end;
    the :data:`NOTICE_SIGNALS` handled in Python wait too (:class:`NoticeHold`), and their
    handlers run when the block ends, before a held Ctrl-C of the block's own is raised (an
    insisting one is raised at once: the update is over).

    Example:
        >>> with signals_held():
        ...     pass  # a Ctrl-C here is raised when the block ends
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only, and its hold is not this thread's
        return
    hold = SigintHold.current()
    own = hold is None
    if hold is None:
        hold = SigintHold()
        hold.start()
    hold.updating += 1
    try:
        with notices_held():
            try:
                yield
            finally:  # an insisting Ctrl-C in a notice's handler is raised there
                hold.updating -= 1
    finally:
        if own:
            hold.end()
        else:
            hold.update_ended()


@contextlib.contextmanager
def notices_held() -> Iterator[None]:
    """Hold the :data:`NOTICE_SIGNALS` handled in Python (not SIGINT) until the block ends,
    then run their handlers (:class:`NoticeHold`): for a block whose end a handler could wait
    for, such as one holding a staging pool's lock, which a handler's worker thread saving
    the state would need."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    notices = NoticeHold()
    try:  # a Ctrl-C while it takes the handlers over still gives them back
        notices.start()
        yield
    finally:
        notices.end()


class NoticeHold:
    """Holds the :data:`NOTICE_SIGNALS` that have Python handlers from :meth:`start` to
    :meth:`end`, which calls each handler once for each of its signals that arrived (the system,
    too, keeps one pending signal of a kind), in the order they arrived, every one of them even
    if one raises.

    A handler something else installed meanwhile keeps its signal, and nothing is delivered to
    the one it replaced unless that one was given back (Lightning restores the handlers it saved
    when a run ends). ``alive`` says whether the hold's owner still runs: a hold whose end never
    came passes signals on, as does an ended hold still called (installed again, or called by a
    handler that took it over). Holds nest: an inner hold leaves the signals an outer one
    holds to it (a batch's hold around its steps' updates).
    """

    def __init__(self, alive: Callable[[], bool] = lambda: True) -> None:
        self._alive = alive
        self._holding = False
        self._meant_for: dict[int, Callable[[int, Any], Any]] = {}
        self._arrived: list[int] = []

    def start(self) -> None:
        self._holding = True
        for signum in NOTICE_SIGNALS:
            handler = _getsignal(signum)
            outer = getattr(handler, "__self__", None)
            if callable(handler) and not (isinstance(outer, NoticeHold) and outer._holding):
                self._meant_for[signum] = handler  # (an outer hold holding it holds on)
                _setsignal(signum, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        if self._holding and self._alive():
            if signum not in self._arrived:
                self._arrived.append(signum)
            return
        if self._holding:  # its owner stopped: give the signals back, deliver what arrived
            self.end()
        # Ended, yet called: installed again (a saved handler restored) or called by a handler
        # that took this one over and calls it (Lightning composes the handlers it finds).
        handler = self._meant_for[signum]
        if _getsignal(signum) == self._note:
            _setsignal(signum, handler)
        handler(signum, frame)

    def end(self, deliver: bool = True) -> None:
        """Give every held signal back to its handler and deliver those that arrived (unless
        ``deliver`` is false: they were for something that is over)."""
        self._holding = False
        given_back = []
        for signum, handler in self._meant_for.items():
            if _getsignal(signum) == self._note:  # bound methods: equal, not identical
                _setsignal(signum, handler)
            if _getsignal(signum) == handler:
                given_back.append(signum)
        arrived, self._arrived = self._arrived, []
        if deliver:
            _call_each([(self._meant_for[s], s) for s in arrived if s in given_back])


def _call_each(calls: list[tuple[Callable[[int, Any], Any], int]]) -> None:
    """Call each ``(handler, signum)``, all of them even if one raises (the last error wins)."""
    if calls:
        (handler, signum), rest = calls[0], calls[1:]
        try:
            handler(signum, sys._getframe(1))
        finally:
            _call_each(rest)
