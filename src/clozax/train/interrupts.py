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
"""

from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_CODES = {"SIGTERM": 128 + signal.SIGTERM, "SIGINT": 128 + signal.SIGINT}


class Interrupted(Exception):  # noqa: N818  (a request, not a failure)
    """Training stopped on a signal after saving ``step``; ``exit_code`` for the launcher."""

    def __init__(self, signal_name: str, step: int, run_dir):
        self.signal_name, self.step = signal_name, step
        self.exit_code = EXIT_CODES.get(signal_name, EXIT_CODES["SIGTERM"])
        super().__init__(f"stopped by {signal_name} at step {step}: the checkpoint of step "
                         f"{step} is saved in {run_dir}; run the same command to resume")


class Interrupts:
    """Signal handling for the duration of a ``with`` block (see the module docstring)."""

    def __init__(self, processes: int, say=None):
        self.multi = processes > 1
        self.say = say or (lambda message: print(message, file=sys.stderr, flush=True))
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is not threading.main_thread():
            return self  # Python takes signals on its main thread only
        # With several processes SIGTERM is JAX's preemption service's (a C handler).
        wanted = (signal.SIGINT,) if self.multi else (signal.SIGINT, signal.SIGTERM)
        for number in wanted:
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _handle(self, number: int, frame) -> None:
        name = signal.Signals(number).name
        if self.signal_name is not None:
            return
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
