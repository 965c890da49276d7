"""Checkpoints: what one holds of the user's objects and random streams (``state``), and the
files on disk, written atomically and loaded safely (``files``)."""
