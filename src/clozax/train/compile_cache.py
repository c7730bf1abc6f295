"""JAX's persistent compilation cache, on by default for every clozax command that compiles.

Compiling the train step is most of a short command's time (on an H200 the base preset's
unrolled step took ~160 s to compile and ~15 s to train 400 steps). With the cache, a second
start, a resume, ``evaluate`` or ``probe`` of the same shapes loads the compiled program from
disk instead; on GPUs XLA's autotuning results are cached as well. The cache lives under the
user's cache directory (``$XDG_CACHE_HOME/clozax/jax``, else ``~/.cache/clozax/jax``);
``CLOZAX_COMPILATION_CACHE=off`` turns it off and ``CLOZAX_COMPILATION_CACHE=DIR`` moves it.
Programs that compile in under 0.5 s are not stored unless JAX's own
``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` says otherwise (the test suite stores every
program, with ``JAX_COMPILATION_CACHE_MAX_SIZE`` bounding the directory).
The cache is trusted code (JAX's own warning): keep it in a directory only you can write.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "CLOZAX_COMPILATION_CACHE"
OFF = ("off", "0", "false", "no", "none")
MIN_COMPILE_SECONDS = 0.5  # programs that compile faster are not worth a disk round trip
MIN_COMPILE_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def cache_dir() -> Path | None:
    """Where the cache lives, or None when ``CLOZAX_COMPILATION_CACHE`` turns it off."""
    setting = os.environ.get(ENV, "").strip()
    if setting.lower() in OFF:
        return None
    if setting:
        return Path(setting).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "clozax" / "jax"


def enable() -> Path | None:
    """Turn the cache on (before anything compiles); returns its directory, or None when it
    is off or cannot be created (then compiling simply happens every time)."""
    path = cache_dir()
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", str(path))
    if MIN_COMPILE_ENV not in os.environ:  # JAX reads its own variable when it is set
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_persistent_cache_enable_xla_caches",
                      "xla_gpu_per_fusion_autotune_cache_dir")
    return path
