"""An interrupt (Ctrl-C in the REPL) that arrives while a kernel launch holds numba's pool leaves
the pool free: the next launch runs instead of waiting for ever."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from vindex3.codecs import threads

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="needs POSIX signals (SIGUSR1)")


class _Interrupt(BaseException):
    """What the test's signal handler raises (KeyboardInterrupt would stop pytest itself if it
    landed outside the test's own handler)."""


def test_an_interrupt_during_a_launch_leaves_the_pool_free():
    a = np.random.default_rng(3).standard_normal((2000, 2000)).astype(np.float32)
    with threads.launch():  # numba imported, the count applied: the measured launch is a product only
        pass
    t0 = time.perf_counter()
    a @ a
    took = time.perf_counter() - t0

    def interrupt(signum, frame):
        raise _Interrupt

    old = signal.signal(signal.SIGUSR1, interrupt)
    try:
        for _ in range(3):
            sent = threading.Event()

            def send(sent=sent):
                os.kill(os.getpid(), signal.SIGUSR1)
                sent.set()

            # one C call that takes 4x the delay: the signal lands while it runs, and Python
            # raises the handler's exception at the next bytecode check, i.e. as the with
            # statement leaves (a Python __exit__'s entry would be that check)
            timer = threading.Timer(took / 4, send)
            interrupted = False
            try:
                timer.start()
                with threads.launch():
                    _ = a @ a  # the work the signal interrupts (no loop: a loop's jump is a check)
                while not sent.is_set():  # a late signal lands here, not in pytest
                    pass
                for _ in range(1000):
                    pass
            except _Interrupt:
                interrupted = True
            timer.join()
            assert interrupted
            assert not threads._LOCK.locked(), "an interrupt left the launch lock held: the next launch would wait for ever"
    finally:
        signal.signal(signal.SIGUSR1, old)
        if threads._LOCK.locked():  # leave the process usable for the tests after this one
            threads._LOCK.release()
