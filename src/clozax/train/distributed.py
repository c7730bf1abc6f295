"""Several processes, one run: joining JAX's own multi-controller runtime (``jax.distributed``).

A single process is the default and needs nothing. A multi-process job starts one ``clozax
train`` per host (or per GPU) with the same arguments plus either explicit coordinates
(``--coordinator HOST:PORT --num-processes N --process-id I``, or the environment variables
``CLOZAX_COORDINATOR``, ``CLOZAX_NUM_PROCESSES``, ``CLOZAX_PROCESS_ID``) or ``--distributed auto``,
which lets ``jax.distributed.initialize()`` read the launcher (SLURM, Open MPI, a TPU VM slice,
Kubernetes indexed jobs). Every process then sees every device of the job; the ``data`` mesh
axis spans all of them.

If a process dies, the coordination service stops hearing its heartbeat and ends the others
after ``HEARTBEAT_SECONDS`` (``CLOZAX_HEARTBEAT_SECONDS``) instead of letting them wait in a
collective for hours; the last complete checkpoint stays loadable and the same launch resumes.
A process that fails (any exception) prints its line and leaves at once (``clozax.app.cli``), so
its peers' heartbeat ends the job the same way. Why 20 s rather than JAX's 100: the heartbeat
is sent by the runtime's own thread, so neither a compilation nor a save delays it (the test
suite's 2-process jobs compile and save with a 5 s heartbeat), while a job on a crashed host is
told 80 s sooner; a network that drops a host's packets for longer than 20 s ends the job,
which then resumes from its last checkpoint.
"""

from __future__ import annotations

import os

ENV_COORDINATOR = "CLOZAX_COORDINATOR"
ENV_PROCESSES = "CLOZAX_NUM_PROCESSES"
ENV_PROCESS_ID = "CLOZAX_PROCESS_ID"
ENV_HEARTBEAT = "CLOZAX_HEARTBEAT_SECONDS"
HEARTBEAT_SECONDS = 20
_joined = False  # this process is part of a multi-process job


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, auto: bool = False) -> bool:
    """Join a multi-process job when asked to (arguments, else the environment); returns
    whether this process is part of one. Must run before JAX computes anything."""
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    if num_processes is None and os.environ.get(ENV_PROCESSES):
        num_processes = _int_env(ENV_PROCESSES)
    if process_id is None and os.environ.get(ENV_PROCESS_ID):
        process_id = _int_env(ENV_PROCESS_ID)
    explicit = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(explicit) and not all(explicit):
        raise ValueError("a multi-process job needs all of --coordinator HOST:PORT, "
                         "--num-processes N and --process-id I (or --distributed auto)")
    if not any(explicit) and not auto:
        return False
    if all(explicit):
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(f"--process-id {process_id} must lie in [0, --num-processes "
                             f"{num_processes})")
        if ":" not in coordinator:
            raise ValueError(f"--coordinator {coordinator!r} is not HOST:PORT")
    import jax

    # Simulated and real CPU devices of several processes talk through gloo.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    heartbeat = _int_env(ENV_HEARTBEAT) if os.environ.get(ENV_HEARTBEAT) else HEARTBEAT_SECONDS
    try:
        jax.distributed.initialize(coordinator_address=coordinator,
                                   num_processes=num_processes, process_id=process_id,
                                   heartbeat_timeout_seconds=heartbeat)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"could not join the multi-process job ({str(e).splitlines()[0]}); "
                         "check the coordinator address and that every process was "
                         "started") from None
    global _joined
    _joined = True
    return True


def joined() -> bool:
    """Whether this process joined a multi-process job (``initialize``)."""
    return _joined


def is_primary() -> bool:
    """Process 0 writes the run's files, metrics, progress and TensorBoard events."""
    import jax

    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process got here (no-op for one process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def broadcast(value: int) -> int:
    """Process 0's ``value`` on every process (decisions only the first process makes, such as
    a ``--minutes`` step count, must be the same everywhere)."""
    import jax

    if jax.process_count() == 1:
        return value
    import numpy as np
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int64(value)))


def same_everywhere(digest: str, what: str) -> None:
    """Fail unless every process holds process 0's ``digest`` (a hex hash) of ``what``."""
    import jax

    ours = int(digest[:7], 16)  # 28 bits: ``broadcast`` carries an int32 (JAX without x64)
    if broadcast(ours) != ours:
        raise ValueError(f"process {jax.process_index()} has another {what} than process 0; "
                         "every process needs the same dataset, settings and clozax version")


def _int_env(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r} is not an integer") from None
