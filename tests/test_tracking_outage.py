"""A tracking server that is down never stalls, fails or delays training: real ranks, a real
HTTP tracking URI on 127.0.0.1 with nothing listening (and a real `mlflow server` killed in
the middle of a run)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from hpc_ddp.runtime.errors import EXIT_STOPPED
from tests.helpers import (
    REPO,
    Lines,
    clean_environ,
    read_summary,
    run_local_program,
    signal_after,
    start_program,
)

pytestmark = pytest.mark.e2e  # every test here starts processes

PROGRAM = str(REPO / "tests" / "programs" / "regression.py")


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_mlflow_server(directory: Path, port: int) -> subprocess.Popen[bytes]:
    """A real `mlflow server` on 127.0.0.1:``port`` (its store in ``directory``), listening."""
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{directory / 'server.db'}",
         "--default-artifact-root", str(directory / "artifacts"), "--workers", "1"],
        cwd=directory, env=clean_environ(), stdout=subprocess.DEVNULL,
        stderr=(directory / "mlflow-server.log").open("wb"), start_new_session=True,
    )  # fmt: skip
    # A hang guard, not a verdict: the server's start is imports (CPU), so a test that starts
    # it while its own ranks train keeps them mostly idle (--step-pause).
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and server.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            time.sleep(0.5)
    code = server.poll()
    if code is None:
        os.killpg(server.pid, signal.SIGKILL)
    log = (directory / "mlflow-server.log").read_text(errors="replace")[-2000:]
    ended = f"exited with code {code}" if code is not None else "was not listening after 90 s"
    raise AssertionError(f"mlflow server on port {port} {ended}; its log:\n{log}")


def stop_mlflow_server(server: subprocess.Popen[bytes]) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGKILL)  # the server and its workers
        server.wait()


def sync(run_dir: Path, *extra: str) -> str:
    """`hpc-ddp tracking sync RUN_DIR`; returns its one line."""
    result = subprocess.run(
        [sys.executable, "-m", "hpc_ddp", "tracking", "sync", str(run_dir), *extra],
        cwd=REPO, env=clean_environ(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_a_tracking_server_that_is_down_costs_one_warning_and_nothing_else(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{closed_port()}"
    program = [PROGRAM, "--epochs", "2", "--log-interval", "5", f"run.output_dir={tmp_path}"]
    # MLflow's own retries (7, backoff doubling) would hold the run's start and end up for
    # minutes, past run_local_program's 240 s: hpc_ddp's (2, in seconds) end it at once.
    down = run_local_program(2, [*program, "run.id=down", f"tracking.uri={uri}"])
    assert down.returncode == 0, down.stderr[-3000:]
    warnings = [line for line in down.stderr.splitlines() if f"MLflow at {uri}" in line]
    assert len(warnings) == 1, down.stderr[-3000:]
    assert "could not start" in warnings[0] and "training goes on" in warnings[0]
    assert "HINT: check tracking.uri" in warnings[0]
    assert "Traceback" not in down.stderr

    off = run_local_program(2, [*program, "run.id=off", "tracking.enabled=false"])
    assert off.returncode == 0, off.stderr[-3000:]
    facts, reference = (
        read_summary(tmp_path, "regression", "down"),
        read_summary(tmp_path, "regression", "off"),
    )
    assert facts["weights_sha256"] == reference["weights_sha256"], "training untouched"
    assert facts["tracking"].startswith("failed: could not start: ")
    assert reference["tracking"] == "off" and facts["mlflow_run_id"] is None
    lines = (tmp_path / "regression" / "down" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if "interval/mse" in line]
    assert steps == list(range(5, 101, 5)), "the run's own record has every interval"

    # The server is back: the run's record goes into MLflow once, whatever the repeats.
    port = closed_port()
    server = start_mlflow_server(tmp_path, port)
    try:
        server_uri = f"http://127.0.0.1:{port}"
        first = sync(tmp_path / "regression" / "down", "--uri", server_uri)
        again = sync(tmp_path / "regression" / "down", "--uri", server_uri)
        client = MlflowClient(tracking_uri=server_uri)
        run_id = re.search(r"MLflow run (\w+)", first).group(1)  # type: ignore[union-attr]
        run = client.get_run(run_id)
        history = client.get_metric_history(run_id, "interval/mse")
    finally:
        stop_mlflow_server(server)
    points = sum(len(json.loads(line).get("metrics", {})) for line in lines)
    assert f"a new MLflow run {run_id}" in first and f"{points} points added, 0 already" in first
    assert f"0 points added, {points} already there; status FINISHED" in again, again
    assert sorted(metric.step for metric in history) == list(range(5, 101, 5))
    assert run.info.status == "FINISHED" and run.data.params["epochs"] == "2"
    assert run.data.tags["hpc_ddp.world_size"] == "2"


def test_a_stop_is_not_held_up_by_a_tracking_server_that_is_down(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{closed_port()}"
    program = [
        PROGRAM, "--epochs", "3", "--samples", "19200", "--log-interval", "5",
        f"run.output_dir={tmp_path}", "run.id=stopped", f"tracking.uri={uri}",
        "preempt.check_every_steps=1", "--hold-at-step", "30",
    ]  # fmt: skip
    process = start_program(2, program)
    log = signal_after(process, r"HOLDING at step 30 \(rank 0\)", signal.SIGUSR1)
    assert process.returncode == EXIT_STOPPED, log[-3000:]
    assert "checkpoint (stop signal)" in log and "Traceback" not in log
    status = json.loads((tmp_path / "regression" / "stopped" / "status.json").read_text())
    assert status["state"] == "stopped"


def test_an_mlflow_server_killed_mid_run_leaves_training_and_its_record_whole(
    tmp_path: Path,
) -> None:
    port = closed_port()
    server = start_mlflow_server(tmp_path, port)
    try:
        # The ranks hold at step 600 until the server is gone: it dies mid-run whatever the
        # machine's pace.
        released = tmp_path / "server-killed"
        program = [
            PROGRAM, "--epochs", "6", "--samples", "19200", "--log-interval", "5",
            f"run.output_dir={tmp_path}", "run.id=killed", f"tracking.uri=http://127.0.0.1:{port}",
            "--hold-at-step", "600", "--hold-until", str(released),
        ]  # fmt: skip
        process = start_program(2, program)
        # Read on a thread: the kill must follow the server's state, not a backlog of lines.
        seen: list[str] = []
        reader = threading.Thread(target=lambda: seen.extend(process.stderr or []), daemon=True)
        reader.start()
        client = MlflowClient(tracking_uri=f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 240
        while not any("HOLDING at step 600 (rank 0)" in line for line in seen):
            assert process.poll() is None and time.monotonic() < deadline, "".join(seen)[-3000:]
            time.sleep(0.05)
        while not (
            (runs := client.search_runs(["0", "1"], max_results=1)) and runs[0].data.metrics
        ):
            assert time.monotonic() < deadline, "no metric reached the server in 240 s"
            time.sleep(0.2)
        stop_mlflow_server(server)
        released.touch()
        process.wait(timeout=300)
        reader.join(timeout=30)
        log = "".join(seen)
    finally:
        stop_mlflow_server(server)
    assert process.returncode == 0, log[-3000:]
    facts = read_summary(tmp_path, "regression", "killed")
    assert facts["tracking"].startswith("failed: "), facts["tracking"]
    assert facts["mlflow_run_id"], "the run had been created before the server died"
    assert "Traceback" not in log
    assert (
        len([line for line in log.splitlines() if f"MLflow at http://127.0.0.1:{port}" in line])
        == 1
    )
    assert facts["global_step"] == 1200 and facts["replicas_in_sync"] is True
    lines = (tmp_path / "regression" / "killed" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if "interval/mse" in line]
    assert steps == list(range(5, 1201, 5)), "the run's own record is whole"

    # Restarted on its store: the sync completes the SAME MLflow run, without duplicates.
    server = start_mlflow_server(tmp_path, port)
    try:
        synced = sync(tmp_path / "regression" / "killed")
        client = MlflowClient(tracking_uri=f"http://127.0.0.1:{port}")
        run = client.get_run(facts["mlflow_run_id"])
        history = client.get_metric_history(facts["mlflow_run_id"], "interval/mse")
    finally:
        stop_mlflow_server(server)
    assert f"into MLflow run {facts['mlflow_run_id']}" in synced, synced
    already = int(re.search(r"(\d+) already there", synced).group(1))  # type: ignore[union-attr]
    assert already > 0, "the points logged before the server died are not sent twice"
    assert [metric.step for metric in sorted(history, key=lambda m: m.step)] == steps
    assert run.info.status == "FINISHED"


def test_the_attempt_after_one_whose_mlflow_was_down_puts_its_points_in_mlflow(
    tmp_path: Path,
) -> None:
    """Attempt 1 trains to step 30 with the server down, then is stopped; attempt 2 finds
    the server up, resumes, and its MLflow run holds both attempts' points, each once.
    Before, attempt 1's points stayed in metrics.jsonl only (until a `tracking sync`)."""
    port = closed_port()
    uri = f"http://127.0.0.1:{port}"
    program = [
        PROGRAM, "--epochs", "2", "--log-interval", "5", f"run.output_dir={tmp_path}",
        "run.id=behind", f"tracking.uri={uri}", "preempt.check_every_steps=1",
    ]  # fmt: skip
    process = start_program(2, [*program, "--hold-at-step", "30"])
    log = signal_after(process, r"HOLDING at step 30 \(rank 0\)", signal.SIGUSR1)
    assert process.returncode == EXIT_STOPPED, log[-3000:]
    run_dir = tmp_path / "regression" / "behind"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["tracking"].startswith("failed: could not start"), status
    stopped_at = status["global_step"]

    server = start_mlflow_server(tmp_path, port)
    try:
        resumed = run_local_program(2, program)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        facts = read_summary(tmp_path, "regression", "behind")
        client = MlflowClient(tracking_uri=uri)
        run = client.get_run(str(facts["mlflow_run_id"]))
        history = client.get_metric_history(run.info.run_id, "interval/mse")
    finally:
        stop_mlflow_server(server)
    assert "resumed" in resumed.stderr.lower() and "MLflow at" not in resumed.stderr
    assert sorted(metric.step for metric in history) == list(range(5, 101, 5)), "each once"
    assert run.info.status == "FINISHED" and facts["tracking"] == "ok"
    assert run.data.tags["hpc_ddp.attempts"] == "2", "MLflow was away for attempt 1, not unaware"
    assert run.data.tags["hpc_ddp.attempt.1.start_step"] == str(stopped_at)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["attempts"] == 2 and status["tracking"] == "ok"


def test_a_server_that_comes_back_mid_run_gets_the_whole_run_in_the_background(
    tmp_path: Path,
) -> None:
    """Down at the start, up later: the run replays its record into MLflow on its own
    (tracking.retry_s) and tracks on; every point is there once. The run trains until the
    test stops it (SIGUSR1), so the server's start-up time does not matter."""
    port = closed_port()
    uri = f"http://127.0.0.1:{port}"
    program = [
        PROGRAM, "--epochs", "500", "--samples", "19200", "--log-interval", "25",
        f"run.output_dir={tmp_path}", "run.id=back", f"tracking.uri={uri}", "tracking.retry_s=1",
        "preempt.check_every_steps=1",
        # The ranks mostly wait, leaving the CPU to the server starting meanwhile.
        "--step-pause", "0.02",
    ]  # fmt: skip
    process = start_program(2, program)
    output = Lines(process)
    server = None
    try:
        output.wait_for(re.escape(f"MLflow at {uri} failed"))
        for _ in range(11):
            output.wait_for("INFO epoch")  # intervals logged while the server is down
        server = start_mlflow_server(tmp_path, port)
        output.wait_for(re.escape(f"MLflow at {uri} answers again"))
        for _ in range(3):
            output.wait_for("INFO epoch")  # a few intervals logged the usual way
        process.send_signal(signal.SIGUSR1)
        log = output.all(timeout=120)
        assert process.returncode == EXIT_STOPPED, log[-3000:]
        status = json.loads((tmp_path / "regression" / "back" / "status.json").read_text())
        run_id = json.loads((tmp_path / "regression" / "back" / "tracking.json").read_text())
        client = MlflowClient(tracking_uri=uri)
        run = client.get_run(str(run_id["run_id"]))
        history = client.get_metric_history(run.info.run_id, "interval/mse")
    finally:
        if process.poll() is None:
            process.kill()
        if server is not None:
            stop_mlflow_server(server)
    lines = (tmp_path / "regression" / "back" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if "interval/mse" in line]
    assert steps == list(range(25, status["global_step"] + 1, 25)) and len(steps) >= 14
    assert sorted(metric.step for metric in history) == steps, "every point once"
    assert run.info.status == "KILLED" and run.data.tags["hpc_ddp.attempts"] == "1"
    assert run.data.params["epochs"] == "500"


def test_runs_that_open_a_new_sqlite_store_at_once_all_get_their_mlflow_run(
    tmp_path: Path,
) -> None:
    """Four runs at once. Without the store lock, one of two or three runs opening a fresh
    store at once failed in MLflow's schema migration."""
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                PROGRAM,
                "--epochs",
                "1",
                "--samples",
                "960",
                "--log-interval",
                "2",
                f"run.output_dir={tmp_path}",
                f"run.id=r{index}",
            ],
            cwd=REPO,
            env=clean_environ(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(4)
    ]
    for process in processes:
        _out, err = process.communicate(timeout=240)
        assert process.returncode == 0, err[-3000:]
        assert "MLflow at" not in err, err[-3000:]
    facts = [read_summary(tmp_path, "regression", f"r{index}") for index in range(4)]
    assert [fact["tracking"] for fact in facts] == ["ok"] * 4
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    found = {run.info.run_id for run in client.search_runs(experiment_ids=["1"])}
    assert found == {fact["mlflow_run_id"] for fact in facts}


def test_a_sqlite_uri_in_a_missing_folder_creates_no_folders(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'missing' / 'dir' / 'x.db'}"
    result = subprocess.run(
        [sys.executable, PROGRAM, "--epochs", "1", "--log-interval", "5",
         f"run.output_dir={tmp_path / 'runs'}", "run.id=a", f"tracking.uri={uri}"],
        cwd=REPO, env=clean_environ(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (tmp_path / "missing").exists(), "no folders made for a tracking URI"
    assert f"MLflow at {uri} failed could not start" in result.stderr
    assert read_summary(tmp_path / "runs", "regression", "a")["tracking"].startswith(
        "failed: could not start"
    )


def test_a_tag_set_while_mlflow_was_away_reaches_it_with_the_sync(tmp_path: Path) -> None:
    """The idle-GPU alarm tagged the run while MLflow did not answer (a tracker that keeps
    nothing stands for it): the sync (`hpc-ddp tracking sync`, and a running run's recovery)
    sends the tag from the run's record."""
    from hpc_ddp.runtime.tracking.base import NullTracker
    from hpc_ddp.runtime.tracking.journal import JournalTracker
    from hpc_ddp.runtime.tracking.sync import sync_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "regression" / "away"
    tracking = {"uri": uri, "experiment": "regression", "run_name": "regression",
                "artifact_root": str(tmp_path / "mlartifacts"), "params": {},
                "tags": {"hpc_ddp.world_size": "2"}}  # fmt: skip
    journal = JournalTracker(NullTracker(), run_dir, lambda: (5, 0), "7", 2, tracking)
    journal.log_metrics({"loss": 0.5}, 5)
    journal.set_tag("hpc_ddp.idle_gpus", "node1 GPU 1 (rank 1)")
    journal.finish("FINISHED")
    report = sync_run(run_dir)
    run = MlflowClient(tracking_uri=uri).get_run(report.run_id)
    assert run.data.tags["hpc_ddp.idle_gpus"] == "node1 GPU 1 (rank 1)"
    assert run.data.tags["hpc_ddp.world_size"] == "2" and run.data.metrics["loss"] == 0.5
