from clozax.hostmem import keep_freed_memory

__version__ = "0.1.0"

# Before JAX starts its CPU threads: see clozax.hostmem (one page-fault storm per step avoided).
keep_freed_memory()
