"""Stopping a run on request: SIGTERM and SIGINT, and JAX's preemption sync point.

A scheduler that preempts a job (SLURM, Kubernetes, a spot VM) sends SIGTERM and waits a grace
period before SIGKILL; a person sends SIGINT (Ctrl-C). Either way the run saves the step it is
at, waits for the checkpoint to commit, says so in one line and exits with ``128 + signal``
(``EXIT_CODES``: 143 for SIGTERM, 130 for SIGINT), which launchers read as "requeue", never as
success. The loop asks ``Interrupts.reached(step)`` after every step:

- one process: the handlers below only set a flag, read after the step that was running;
- several processes (``jax.distributed``): JAX's preemption service has its own SIGTERM
  handler, which notifies every process; ``reached_preemption_sync_point(step)``, asked by
  every process at every step, turns true at one step everywhere (the largest step any process
  had reached, plus one), so all save that same step together. SIGINT on any process is made
  the same notice (the process sends itself SIGTERM).

A second SIGINT gets the default handler back, so it ends the process at once (the checkpoint
being written is lost; the last committed one stays).

Every instant of a job has its answer:

- **before the first step** (set-up, restore, the first compile; ``early_exit``): nothing new
  is there to save, so the process exits at once with the signal's code. Python runs signal
  handlers on the main thread between bytecodes, which a compile of minutes never reaches; the
  signal's wake-up byte (``signal.set_wakeup_fd``) is read by a watcher thread instead, which
  runs while XLA compiles (it releases the GIL). A grace period must cover one step and a
  save, not a compile. ``arm()`` hands the signals to the loop once the first step is done;
- **between steps**: the loop saves the step and stops (above);
- **after the last sync point** (the final save, the final evaluation): the command finishes
  that save and then exits with the signal's code (``pending``), instead of going on;
- **between stages or jobs** (``clozax demo``, ``clozax finetune``): the command stops at the
  next stage or job boundary, what is finished kept (``raise_if_requested``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from clozax.core import locks

EXIT_CODES = {"SIGTERM": 128 + signal.SIGTERM, "SIGINT": 128 + signal.SIGINT}


class Interrupted(Exception):  # noqa: N818  (a request, not a failure)
    """A command stopped on a signal, what it finished kept; ``exit_code`` for the launcher.
    Training's: after saving ``step`` in ``run_dir``; another command's: ``message``."""

    def __init__(self, signal_name: str, step: int | None = None, run_dir=None,
                 message: str | None = None):
        self.signal_name, self.step = signal_name, step
        self.exit_code = EXIT_CODES.get(signal_name, EXIT_CODES["SIGTERM"])
        super().__init__(f"stopped by {signal_name}: {message}" if message is not None else
                         f"stopped by {signal_name} at step {step}: the checkpoint of step "
                         f"{step} is saved in {run_dir}; run the same command to resume")


class Interrupts:
    """Signal handling for the duration of a ``with`` block (see the module docstring)."""

    def __init__(self, processes: int, say=None, early_exit: bool = False):
        self.multi = processes > 1
        self.say = say or (lambda message: print(message, file=sys.stderr, flush=True))
        self.signal_name: str | None = None
        self.armed = not early_exit  # before arm(): a signal exits at once
        self._previous: dict[int, object] = {}
        self._wakeup: tuple[int, int] | None = None  # (write end, the previous wake-up fd)

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is not threading.main_thread():
            return self  # Python takes signals on its main thread only
        # With several processes SIGTERM is JAX's preemption service's (a C handler).
        wanted = (signal.SIGINT,) if self.multi else (signal.SIGINT, signal.SIGTERM)
        for number in wanted:
            self._previous[number] = signal.signal(number, self._handle)
        if not self.armed:
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._wakeup = (write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
            threading.Thread(target=self._watch, args=(read, set(wanted)), daemon=True,
                             name="clozax-early-signals").start()
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()
        if self._wakeup is not None:
            write, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write)  # the watcher reads the end of the pipe and goes
            self._wakeup = None

    def arm(self) -> None:
        """From now on a signal is the loop's: it saves the step it stopped at."""
        self.armed = True

    def _watch(self, read: int, wanted: set[int]) -> None:
        """Before ``arm()``: a signal's wake-up byte exits the process with its code, even
        while the main thread is inside a compile."""
        with os.fdopen(read, "rb", buffering=0) as pipe:
            while byte := pipe.read(1):
                if self.armed or byte[0] not in wanted:
                    continue
                name = signal.Signals(byte[0]).name
                self.say(f"{name} before the first step: nothing new to save; exiting (code "
                         f"{EXIT_CODES[name]})")
                sys.stdout.flush()
                sys.stderr.flush()
                locks.release_held()  # os._exit runs no finally: the run's lock goes first
                os._exit(EXIT_CODES[name])

    def raise_if_requested(self, message: str) -> None:
        """Between stages or jobs: ``Interrupted`` with ``message`` if a signal arrived."""
        if self.signal_name is not None:
            raise Interrupted(self.signal_name, message=message)

    def _handle(self, number: int, frame) -> None:
        name = signal.Signals(number).name
        if self.signal_name is not None or not self.armed:
            return  # not armed: the watcher is exiting the process
        self.signal_name = name
        if number == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends it at once
        self.say(f"{name}: saving the current step, then exiting (code "
                 f"{EXIT_CODES[name]}){'; Ctrl-C again to exit at once' if number == 2 else ''}")
        if self.multi:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's notice: every process stops together

    def reached(self, step: int) -> bool:
        """Whether the run should save ``step`` and stop (every process agrees on the step)."""
        if not self.multi:
            return self.signal_name is not None
        from jax.experimental import multihost_utils

        try:
            reached = multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # jax_enable_preemption_service is off: a signal ends the process
            return False
        if reached:
            self.signal_name = self.signal_name or "SIGTERM"
        return reached
