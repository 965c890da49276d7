"""Where a run's time goes: measured on every rank, reduced with the interval metrics."""
