"""Benchmark: what the SHA-256 beside each file of a folder checkpoint costs.

One process (DCP alone, as a one-rank run writes): the same state saved as a folder through
hpc_ddp's writer (which hashes each file it wrote before ``.metadata`` commits the folder)
and through DCP's own writer without hashing, alternating; then the check a resume makes
(every file read and hashed) on the folder. Files on the home folder's disk; the hashing
reads the files just written, so mostly from the page cache.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import median, write_result
from bench.sharded import state_of

SIZES_MB = (256, 1024)
REPEATS = 3


def _plain_save(state: dict[str, Any], folder: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    save(state, storage_writer=FileSystemWriter(folder, sync_files=True), no_dist=True)


def _one_size(megabytes: int) -> dict[str, Any]:
    from hpc_ddp.runtime.checkpoint.checksums import SUFFIX, check_checksums
    from hpc_ddp.runtime.checkpoint.sharded.writing import write_folder

    state = {"objects": {"model": state_of(megabytes)}}
    times: dict[str, list[float]] = {"with_checksums": [], "without": [], "check": []}
    for repeat in range(REPEATS):
        with tempfile.TemporaryDirectory(dir=Path.home(), prefix="bench-checksum-") as where:
            ours, plain = Path(where) / "ours", Path(where) / "plain"
            for name, save, folder in (
                ("with_checksums", lambda f: write_folder(state, f, None), ours),
                ("without", lambda f: _plain_save(state, f), plain),
            )[:: 1 if repeat % 2 == 0 else -1]:
                started = time.perf_counter()
                save(folder)
                times[name].append(time.perf_counter() - started)
            names = [p.name for p in ours.iterdir() if p.name.endswith(".distcp")]
            assert all((ours / f"{name}{SUFFIX}").is_file() for name in names)
            started = time.perf_counter()
            check_checksums(ours, names)
            times["check"].append(time.perf_counter() - started)
            shutil.rmtree(plain)
    row = {"size_mb": megabytes, **{f"{key}_s": median(value) for key, value in times.items()}}
    row["added_share"] = row["with_checksums_s"] / row["without_s"] - 1
    print(
        f"{megabytes} MB: save {row['without_s']:.2f} s without checksums, "
        f"{row['with_checksums_s']:.2f} s with ({100 * row['added_share']:+.0f}%); "
        f"the resume's check {row['check_s']:.2f} s",
        flush=True,
    )
    return row


def run() -> dict[str, Any]:
    result = {"rows": [_one_size(megabytes) for megabytes in SIZES_MB], "repeats": REPEATS}
    write_result("checksum_cost", result)
    return result


if __name__ == "__main__":
    run()
