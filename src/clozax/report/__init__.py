"""The report layer: renders what a run directory holds (``clozax report``); no inference."""
