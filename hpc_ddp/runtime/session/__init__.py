"""One run on this rank: :func:`start` wires the parts in one pass, :class:`Run` is what a
script holds, and how a run resumes, ends and is summed up in summary.json."""
