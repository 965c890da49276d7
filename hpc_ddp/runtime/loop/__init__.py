"""The step boundary: the loop that counts steps over a loader's or any iterable's batches,
the stop all ranks agree on, stop signals, the stall watchdog, requeue, interval metrics."""
