"""bench/README.md's section on folder checkpoints and FSDP2, from bench/results/sharded.json."""

from __future__ import annotations

from typing import Any

#: A 7B model in fp32 with AdamW: parameters + two moments, 4 bytes each.
PROJECTED_PARAMETERS = 7e9
PROJECTED_BYTES = PROJECTED_PARAMETERS * 12
PROJECTED_RANKS = 64
#: Assumed: one client writes 2 GB/s to a parallel file system, 64 clients together 40 GB/s;
#: a GPU copies to pinned host memory at 20 GB/s.
CLIENT_GBPS, AGGREGATE_GBPS, STAGING_GBPS = 2.0, 40.0, 20.0


def _blocked(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| state | single file (rank 0 writes, others wait) | folder, sync | folder, async: "
        "blocked | async / sync | async: on disk after | first async save |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['size_mb']} MB | {row['single_file_s']:.2f} s | {row['sync_s']:.2f} s | "
            f"{row['async_s']:.3f} s | {100 * row['async_blocked_share']:.0f}% | "
            f"{row['async_written_s']:.2f} s | {row['async_first_s']:.2f} s |"
        )
    return lines


def _written(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| ranks | MB each rank wrote (wchar) |", "|---:|---|"]
    for row in rows:
        shares = ", ".join(f"{mb:.0f}" for mb in row["written_mb"])
        lines.append(f"| {row['world_size']} | {shares} (of {row['state_mb']} MB) |")
    return lines


def _memory(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| strategy | ranks | parameters + gradients + AdamW state per rank | peak RSS per rank |",
        "|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['strategy']} | {row['world_size']} | {row['held_gb']:.2f} GB | "
            f"{row['peak_rss_gb']:.2f} GB |"
        )
    return lines


def _materialised(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| built on | ranks | model | its shards | one block | grown by building and wrapping "
        "| peak RSS |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['built_on']} | {row['world_size']} | {row['model_gb']:.2f} GB | "
            f"{row['shard_gb']:.3f} GB | {row['block_gb']:.3f} GB | {row['grown_gb']:.3f} GB | "
            f"{row['peak_rss_gb']:.2f} GB |"
        )
    return lines


def _projection() -> list[str]:
    total_gb = PROJECTED_BYTES / 1e9
    single = total_gb / CLIENT_GBPS
    share = total_gb / PROJECTED_RANKS
    folder = max(share / CLIENT_GBPS, total_gb / AGGREGATE_GBPS)
    staged = share / STAGING_GBPS
    return [
        f"**Projection: a 7B model at W={PROJECTED_RANKS}** (fp32 weights and AdamW's two "
        f"moments: {total_gb:.0f} GB; assumed: {CLIENT_GBPS:.0f} GB/s per client and "
        f"{AGGREGATE_GBPS:.0f} GB/s in all to a parallel file system, {STAGING_GBPS:.0f} GB/s "
        "from a GPU to pinned host memory). One file written by rank 0: about "
        f"{single:.0f} s with every rank waiting, at each save (a third of a 120 s warning). "
        "A folder: each rank writes "
        f"{share:.1f} GB, about {folder:.1f} s (the file system's total bandwidth bounds it). "
        f"In the background: training waits about {staged:.2f} s for the copy, as each rank "
        "copies only what it writes (its shard under FSDP2, its 1/W of a replicated state "
        "under DDP).",
    ]


def _why(worst: float) -> str:
    if worst <= 0.15:
        return "Each rank copies only the half it writes, at memory speed."
    return (
        "Here the copy runs at memory speed on 2 shared cores while the synchronous write "
        "lands in the page cache at nearly the same speed."
    )


def _control(data: dict[str, Any]) -> str:
    control = data.get("overhead_control")
    if control is None:
        return ""
    low, high = control["ratio_ci95"]
    return (
        f" Control, the hand-written loop against its own copy ({control['rounds']} rounds): "
        f"{control['ratio']:.3f} (95% CI {low:.3f}-{high:.3f})."
    )


def sharded_section(data: dict[str, Any]) -> str:
    blocked = data["blocked"]
    large = [row for row in blocked if row["size_mb"] >= 256]
    worst = max(row["async_blocked_share"] for row in large)
    met = "met" if worst <= 0.15 else "not met on this machine"
    factors = [1 / row["async_blocked_share"] for row in large]
    overhead = data["overhead"]
    low, high = overhead["ratio_ci95"]
    lines = [
        "## Folder checkpoints (torch.distributed.checkpoint) and FSDP2",
        "",
        "`python -m bench.sharded`. **Training blocked per checkpoint**, 2 ranks, the same "
        "state (16 tensors) written three ways, median of 4 saves (async: of the 3 after the "
        "first): the single "
        "file of checkpoint.save_mode=single_file, the folder written at once (sync), and in "
        "the background (async: blocked until the state is copied; the copy's buffers are "
        "kept from save to save, so the first background save, which allocates them, is "
        "shown apart). Both folders go through the writer a run uses: each rank copies and "
        "writes only its share of a replicated state, about 1/W of it. The disk here is "
        "fast and the page cache takes the writes, which "
        "favours the synchronous saves: on a parallel file system a write takes longer and "
        "the copy does not.",
        "",
        *_blocked(blocked),
        "",
        f"Target (async blocked at most 15% of sync from 256 MB): {met} (worst "
        f"{100 * worst:.0f}%). {_why(worst)} The default is async, which blocks "
        f"{min(factors):.1f}-{max(factors):.0f}x less than sync from 256 MB.",
        "",
        "**Bytes each rank writes**, one folder of a replicated 256 MB state (DCP writes a "
        "replicated tensor once, spread over the ranks):",
        "",
        *_written(data["written"]),
        "",
        "**Per-rank memory, DDP against FSDP2**: 16 Linear(4096, 4096) blocks (268 M "
        "parameters: an AdamW state of 2.1 GB), two AdamW steps through `run.wrap` "
        "(dist.strategy=ddp or fsdp). What each rank holds falls as 1/W under FSDP2; DDP "
        "holds it all on every rank (at 4 ranks that would need about 20 GB, more than this "
        "machine has).",
        "",
        *_memory(data["memory"]),
        "",
        "**A model built on the meta device**: the same blocks (fp32 weights, 1 GB) sharded by "
        "`run.wrap` under dist.strategy=fsdp, built whole on every rank or under "
        "`torch.device('meta')`; what each rank's resident set grew by, the largest over the "
        "ranks, measured once wrapped (`python -m bench.sharded --materialised`). On meta, "
        "run.wrap gives each rank storage for its shards only and sets them module by module "
        "from a whole copy of that module's reset_parameters(). Target: on meta, the rank's "
        "shards plus one block, and what the code and allocator add (the rows built whole "
        "grow about 0.05-0.07 GB beyond the weights).",
        "",
        *_materialised(data.get("materialised", [])),
        "",
        f"**FSDP2 per-step cost**: hpc_ddp's loop (dist.strategy=fsdp) against a hand-written "
        f"FSDP2 loop on the same model, batches and step, in turn inside one pair of ranks "
        f"(`bench.interleaved --fsdp`, {overhead['rounds']} rounds, the compute-bound MLP): "
        f"ratio {overhead['ratio']:.3f} (95% CI {low:.3f}-{high:.3f}; target >= 0.99: "
        f"{'met' if overhead['ratio'] >= 0.99 else 'not met'}).{_control(data)} The step's "
        "order matters here, whoever writes the loop: the same loop letting go of its "
        "gradients after the optimizer step instead of just before backward read 0.98-0.99 "
        "against the hand-written one (its gradients' memory is freed a whole step before "
        "it is needed again).",
        "",
        *_projection(),
    ]
    return "\n".join(lines) + "\n\n"


def checksum_section(data: dict[str, Any]) -> str:
    rows = "".join(
        f"| {row['size_mb']:,} MB | {row['without_s']:.2f} s | {row['with_checksums_s']:.2f} s "
        f"| {100 * row['added_share']:+.0f}% | {row['check_s']:.2f} s |\n"
        for row in data["rows"]
    )
    return (
        "### The SHA-256 beside each file of a folder checkpoint\n\n"
        "`python -m bench.checksum_cost`: one process, the same state saved as a folder "
        "through hpc_ddp's writer (it hashes each file it wrote before `.metadata` commits "
        "the folder) and through DCP's own writer, alternating, median of "
        f"{data['repeats']}; then the check a resume makes of the folder (every file read "
        "and hashed, 8 files at once).\n\n"
        "| state | save without | save with checksums | added | resume's check |\n"
        "|---:|---:|---:|---:|---:|\n"
        f"{rows}\n"
        "Each rank hashes the bytes of its own files as it writes them (1/W of a "
        "replicated state), never reading them back. A background save "
        "(`checkpoint.save_mode=async`, the default) hashes on its writer's thread, not in "
        "the step; a synchronous one (`save_mode=sync`) pays it in full. At a resume the "
        "ranks share the check, each reading and hashing every W-th file of the folder; "
        "the column above is one process checking all of it.\n\n"
    )
