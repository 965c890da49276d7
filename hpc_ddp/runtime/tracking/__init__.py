"""Tracking on rank 0: the tracker layers (``trackers``), the background MLflow process
(``worker``) behind a guard that never lets MLflow stop training (``guard``), the run's own
record of metrics and status (``journal``) and its replay into MLflow (``sync``)."""
