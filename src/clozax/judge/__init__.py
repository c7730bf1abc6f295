"""The judge layer: everything that reads a trained run and measures it (evaluate, probe,
audit, fill, the report's probability panel, the headline claims)."""
