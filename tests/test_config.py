"""Config loading: strict keys and types, dotted overrides, docs, and every shipped file."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from hpc_ddp.cli.train import dry_run
from hpc_ddp.runtime.configfile import flatten
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.trainer.config import Config, config_docs, load_config
from hpc_ddp.trainer.datamake import make_dataset
from tests.helpers import REPO, clean_environ

CONFIG_FILES = sorted((REPO / "configs").glob("*.yaml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_overrides_apply_with_yaml_typed_values(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  epochs: 5\n")
    config = load_config(
        path,
        [
            "train.epochs=3",
            "data.batch_size=128",
            "model.hidden_sizes=[32, 16]",
            "optim.grad_clip_norm=null",
            "optim.lr=1e-3",
            "tracking.enabled=false",
        ],
    )
    assert config.train.epochs == 3
    assert config.data.batch_size == 128
    assert config.model.hidden_sizes == [32, 16]
    assert config.optim.grad_clip_norm is None
    assert config.optim.lr == pytest.approx(1e-3)
    assert config.tracking.enabled is False
    assert load_config(None, ["run.id=1234"]).run.id == "1234"


def test_unknown_key_names_file_key_and_valid_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  epoch: 5\n")
    with pytest.raises(HpcDdpError) as caught:
        load_config(path)
    message = str(caught.value)
    assert str(path) in message
    assert "unknown key 'train.epoch'" in message
    assert "valid keys in 'train': epochs, grad_accum_steps" in message


def test_unknown_section(tmp_path: Path) -> None:
    with pytest.raises(
        HpcDdpError, match=r"(?s)unknown section .trainer.*valid sections: run, data"
    ):
        load_config(write(tmp_path, "trainer: {}\n"))


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.epochs=three", "train.epochs: got 'three' (str), expected int"),
        ("train.precision=fp16", "expected 'fp32' | 'bf16'"),
        ("train.epochs=0", "train.epochs=0 is invalid: expected a positive integer"),
        ("dist.backend=mpi", "expected 'auto' | 'nccl' | 'gloo'"),
        ("tracking.enabled=yes please", "expected bool"),
        ("model.hidden_sizes=[1, x]", "model.hidden_sizes"),
        ("epochs=3", "the key must be section.key"),
        ("train.epochs", "expected section.key=value"),
        ("nope.epochs=3", "unknown section 'nope'"),
        ("data.kind=custom", "data.kind=custom needs data.factory"),
        ("optim.momentum=-1", "optim.momentum=-1.0 is invalid: expected 0 <= x < 1"),
        ("optim.lr=.inf", "optim.lr=inf is invalid: expected a positive finite number"),
        ("optim.lr=.nan", "optim.lr=nan is invalid"),
        ("data.num_classes=1", "data.num_classes=1 is invalid: expected at least 2"),
    ],
)
def test_bad_values_say_what_was_expected(override: str, expected: str) -> None:
    with pytest.raises(HpcDdpError) as caught:
        load_config(None, [override])
    assert expected in str(caught.value)


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(HpcDdpError, match="does not exist"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(HpcDdpError, match="not valid YAML"):
        load_config(write(tmp_path, "train: [\n"))


def test_every_field_is_documented() -> None:
    rows = config_docs()
    assert len(rows) > 30
    undocumented = [key for key, _default, doc in rows if len(doc) < 10]
    assert undocumented == []
    hints = typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        assert hints[section.name].__doc__, f"section {section.name} lacks a docstring"


def test_the_trainer_holds_every_runtime_section_and_hands_each_on_whole() -> None:
    from hpc_ddp.runtime.config import RuntimeConfig
    from hpc_ddp.runtime.configfile import section_names
    from hpc_ddp.trainer.config import RESUME_SAFE_PREFIXES

    config = load_config(None, ["monitor.data_wait_percent=35", "checks.enabled=false"])
    runtime_sections = section_names(RuntimeConfig)
    assert set(runtime_sections) <= set(section_names(Config))
    for name in runtime_sections:
        assert getattr(config.runtime, name) is getattr(config, name)
    assert config.runtime.monitor.data_wait_percent == 35
    # A resume may change how a run goes (every runtime section but run), never what it computes.
    for name in runtime_sections:
        assert (f"{name}." in RESUME_SAFE_PREFIXES) == (name != "run")


def test_flatten_has_dotted_keys() -> None:
    flat = flatten(load_config(None))
    assert flat["train.epochs"] == 5 and flat["data.kind"] == "digits"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_every_shipped_config_loads_and_dry_runs(path: Path, tmp_path: Path) -> None:
    overrides = [f"run.output_dir={tmp_path}"]
    if load_config(path).data.kind == "parquet":
        make_dataset("synthetic", 5000, 1000, tmp_path / "set")
        overrides += [
            f"data.train_path={tmp_path / 'set/train'}",
            f"data.val_path={tmp_path / 'set/val'}",
        ]
    config = load_config(path, overrides)
    report = dry_run(config, {})
    assert report["train_samples"] >= config.data.batch_size
    assert report["logits_shape"][0] == 1 and report["logits_shape"][1] >= 2
    assert report["parameters"] > 0


def test_configs_directory_is_not_empty() -> None:
    names = {path.name for path in CONFIG_FILES}
    assert {"digits.yaml", "synthetic.yaml", "parquet.yaml", "slurm-gpu.yaml"} <= names


def test_settings_from_the_environment_sit_between_sections_and_overrides() -> None:
    from hpc_ddp.runtime.config import resolve_config

    environ = {"HPC_DDP_OVERRIDES": "run.id=from-env 'run.name=with space' tracking.enabled=false"}
    settings = resolve_config(None, ["run.id=explicit"], {"run": {"seed": 7}}, environ)
    assert (settings.run.id, settings.run.name, settings.run.seed) == ("explicit", "with space", 7)
    assert settings.tracking.enabled is False
    assert resolve_config(None, [], {}, {}).run.id is None


@pytest.mark.parametrize("value", ["run.nope=1", "epochs", "run.id='open"])
def test_bad_settings_in_the_environment_name_the_variable(value: str) -> None:
    from hpc_ddp.runtime.config import resolve_config

    with pytest.raises(HpcDdpError) as caught:
        resolve_config(None, [], {}, {"HPC_DDP_OVERRIDES": value})
    assert str(caught.value).startswith(f"$HPC_DDP_OVERRIDES={value!r}: ")
    assert "HINT: set HPC_DDP_OVERRIDES to space-separated section.key=value" in str(caught.value)


def test_text_settings_keep_what_was_written_where_yaml_would_read_anything_but_text() -> None:
    from hpc_ddp.runtime.config import resolve_config

    ids = {value: resolve_config(None, [f"run.id={value}"], {}, {}).run.id for value in
           ("4211", "off", "1e3", "yes")}  # fmt: skip
    assert ids == {"4211": "4211", "off": "off", "1e3": "1e3", "yes": "yes"}
    environ = {"HPC_DDP_OVERRIDES": "run.name=007"}
    assert resolve_config(None, [], {}, environ).run.name == "007"
    config = load_config(None, ["run.id=12", "train.epochs=3"])
    assert (config.run.id, config.train.epochs) == ("12", 3), "numbers stay numbers elsewhere"
    command = "echo 'dimm 3: bad'; exit 3"  # YAML reads a mapping
    assert load_config(None, [f"checks.command={command}"]).checks.command == command
    assert resolve_config(None, ["checks.command=[a, b]"], {}, {}).checks.command == "[a, b]"
    assert resolve_config(None, ["run.name=null"], {}, {}).run.name is None
    negated = "! grep -q bad /proc/driver"  # a YAML tag would take the "!" away
    assert resolve_config(None, [f"checks.command={negated}"], {}, {}).checks.command == negated
    assert resolve_config(None, ['tracking.experiment="x y"'], {}, {}).tracking.experiment == "x y"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"train:\n  1: a\n", "key 1 in section 'train' is a int, not text"),
        (b"1: a\n", "section name 1 is a int, not text"),
        (b"train:\n  epochs: 3\n  epochs: 5\n", "key 'epochs' is written twice (line 3)"),
        (b"run: 5\n", "section 'run' is 5, not a mapping of keys"),
        (b"train:\n  epochs: [3\n", "not valid YAML at line 3"),
        (b"run:\n  name: caf\xe9\n", "not UTF-8 text (byte 0xe9 at position 16)"),
    ],
)
def test_a_config_file_yaml_cannot_read_as_settings_is_one_line_with_a_hint(
    tmp_path: Path, content: bytes, expected: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(HpcDdpError) as caught:
        load_config(path, ["run.name=x"])  # an override must not hide a bad section
    assert expected in str(caught.value) and "\nHINT: " in str(caught.value)


@pytest.mark.e2e
def test_hpc_ddp_local_without_a_config_trains_the_readmes_default(tmp_path: Path) -> None:
    def dry_run(*config: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "hpc_ddp", "local", "--nproc", "1", "--dry-run", *config],
            cwd=REPO, env=clean_environ(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        per_launch = r"local-\d+-\d+-\d+|master=\S+|\"master_port\": \d+|port \d+ is free"
        return re.sub(per_launch, "", result.stdout)

    assert dry_run() == dry_run("--config", "configs/digits.yaml")
    assert '"train_samples": 1438' in dry_run()


def test_crowding_this_machine_is_warned_about() -> None:
    from hpc_ddp.launch.local import RANK_MEMORY_BYTES, available_memory, crowding_warnings

    assert crowding_warnings(2, 2, 8 * 2**30) == []
    cpus, memory = crowding_warnings(64, 2, 4 * 2**30)
    assert cpus.startswith("64 ranks on 2 CPU(s)") and "HINT: --nproc 2 or fewer" in cpus
    assert f"about {64 * RANK_MEMORY_BYTES / 2**30:.1f} GiB" in memory and "4.0 GiB" in memory
    assert crowding_warnings(64, 128, None) == []
    measured = available_memory()
    assert measured is None or measured > 0


def test_hpc_ddp_config_lists_a_scripts_defaults_first_then_the_trainers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A script's run is named after the script (run.name null); only the built-in trainer's
    runs are 'digits-mlp' by default, said in the trainer's part."""
    import argparse

    from hpc_ddp.cli.commands import config

    assert config(argparse.Namespace()) == 0
    scripts, trainers = capsys.readouterr().out.split("\n# The built-in trainer's own settings")
    assert scripts.splitlines()[1] == "run.name (default None)"
    assert "run.name (the trainer's default 'digits-mlp')" in trainers.splitlines()
    assert "data." not in scripts and "\ndata.batch_size (default" in trainers
    assert "\nmonitor.every_s (default" in scripts and "monitor.every_s" not in trainers


@pytest.mark.parametrize(
    ("section", "said"),
    [
        (
            {"every_step": 10},
            "hpc_ddp.start(checkpoint=...): unknown key 'checkpoint.every_step' (did you mean "
            "'checkpoint.every_steps'?)",
        ),
        ({"every_steps": "x"}, "hpc_ddp.start(checkpoint=...): checkpoint.every_steps: got 'x'"),
    ],
)
def test_a_mistake_in_a_section_given_to_start_is_named_there(
    section: dict[str, object], said: str, tmp_path: Path
) -> None:
    """Not '<defaults>' nor the YAML file's name: the keyword argument the key came from."""
    from hpc_ddp.runtime.config import resolve_config

    for config in (None, write(tmp_path, "checkpoint:\n  keep_last: 2\n")):
        with pytest.raises(HpcDdpError) as caught:
            resolve_config(config, [], {"checkpoint": section}, {})
        assert said in str(caught.value)
