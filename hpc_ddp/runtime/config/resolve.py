"""The runtime's settings as one object, and how a run resolves them: a YAML file or an
object, keyword sections, ``$HPC_DDP_OVERRIDES``, then dotted overrides."""

from __future__ import annotations

import copy
import dataclasses
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.runtime import configfile
from hpc_ddp.runtime.config.saving import CheckpointConfig, PreemptConfig
from hpc_ddp.runtime.config.watching import ChecksConfig, MonitorConfig, TrackingConfig
from hpc_ddp.runtime.config.where import DistConfig, RunConfig
from hpc_ddp.runtime.configfile import section
from hpc_ddp.runtime.errors import HpcDdpError
from hpc_ddp.runtime.yamlread import load_raw

#: Dotted settings from the environment (``HPC_DDP_OVERRIDES="run.id=a tracking.enabled=false"``):
#: a script's run settings changed without touching its code or its arguments.
OVERRIDES_VARIABLE = "HPC_DDP_OVERRIDES"

#: What followed ``hpc-ddp local`` on its command line (shell-quoted): the ranks name the
#: exact command that continues a stopped run.
LOCAL_COMMAND_VARIABLE = "HPC_DDP_LOCAL_COMMAND"


@dataclass(frozen=True)
class RuntimeConfig:
    """The runtime sections of a run."""

    run: RunConfig = section(RunConfig, "Identity and output.")
    dist: DistConfig = section(DistConfig, "Distribution.")
    tracking: TrackingConfig = section(TrackingConfig, "MLflow tracking.")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "Checkpoints and resume.")
    preempt: PreemptConfig = section(PreemptConfig, "Preemption and requeue.")
    checks: ChecksConfig = section(ChecksConfig, "Checks before the first step.")
    monitor: MonitorConfig = section(MonitorConfig, "Where the run's time goes.")

    def __post_init__(self) -> None:
        if self.preempt.stop_at_step is not None and not self.checkpoint.enabled:
            raise HpcDdpError(
                f"preempt.stop_at_step={self.preempt.stop_at_step} with "
                "checkpoint.enabled=false: the rehearsed stop would save nothing to resume from",
                "turn checkpoints on, or leave preempt.stop_at_step out",
            )


Section = (
    Mapping[str, Any]
    | RunConfig
    | DistConfig
    | CheckpointConfig
    | PreemptConfig
    | TrackingConfig
    | ChecksConfig
    | MonitorConfig
)


def environment_overrides(environ: Mapping[str, str]) -> list[str]:
    """The dotted settings in $HPC_DDP_OVERRIDES (space-separated, shell quoting)."""
    text = environ.get(OVERRIDES_VARIABLE, "")
    try:
        return shlex.split(text)
    except ValueError as error:
        raise HpcDdpError(
            f"${OVERRIDES_VARIABLE}={text!r}: {error}",
            f"set {OVERRIDES_VARIABLE} to space-separated section.key=value settings",
        ) from None


def check_keys(section: str, given: Mapping[str, object]) -> None:
    """Refuse a key ``hpc_ddp.start(section={...})`` does not know, naming where it came from
    (its values are judged with the rest, after the overrides)."""
    known = [field.name for field in dataclasses.fields(getattr(RuntimeConfig(), section))]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise HpcDdpError(
            f"hpc_ddp.start({section}=...): unknown key '{section}.{unknown[0]}'"
            f"{configfile.nearest(unknown[0], known, f'{section}.')}",
            f"valid keys in '{section}': {', '.join(known)}",
        )


def resolve_config(
    config: RuntimeConfig | str | Path | None,
    overrides: Sequence[str],
    sections: Mapping[str, Section | None],
    environ: Mapping[str, str],
) -> RuntimeConfig:
    """The runtime settings: ``config`` (an object, a YAML file or the defaults), then the
    sections given as keyword arguments, then the dotted settings in ``$HPC_DDP_OVERRIDES``
    (space-separated, shell quoting), then the dotted ``overrides`` (which win).

    Under submitit, preemption arrives as USR2 and SIGTERM is ignored, as submitit does it."""
    if isinstance(config, RuntimeConfig):
        raw, source = configfile.to_dict(config), "<config>"
    elif isinstance(config, str | Path):
        raw, source = load_raw(config), str(config)
    elif config is None:
        raw, source = {}, "<defaults>"
    else:
        raise HpcDdpError(
            f"hpc_ddp.start(config=...) got {type(config).__name__}: expected a YAML file's path "
            "or a RuntimeConfig",
            "pass dotted settings such as checkpoint.every_steps=100 as overrides=[...]",
        )
    if isinstance(overrides, str):
        raise HpcDdpError(
            f"hpc_ddp.start(overrides={overrides!r}) got one string",
            "pass a list of dotted settings, e.g. overrides=['checkpoint.every_steps=100']",
        )
    for name, value in sections.items():
        if value is None:
            continue
        if not isinstance(value, Mapping) and not (
            dataclasses.is_dataclass(value) and not isinstance(value, type)
        ):
            kind = "".join(part.title() for part in name.split("_")) + "Config"
            raise HpcDdpError(
                f"hpc_ddp.start({name}={value!r}): expected a mapping of {name} settings or "
                f"a {kind}, not a {type(value).__name__}",
                f"e.g. hpc_ddp.start({name}={{...}}); `hpc-ddp config` lists every key",
            )
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            raw[name] = dataclasses.asdict(value)
        else:
            given = dict(value)  # type: ignore[arg-type]
            check_keys(name, given)
            raw.setdefault(name, {}).update(given)
    sections_known = configfile.section_names(RuntimeConfig)
    text = configfile.text_keys(RuntimeConfig)
    from_environ = environment_overrides(environ)
    try:
        if from_environ:
            configfile.apply_overrides(raw, from_environ, sections_known, text)
            configfile.from_dict(RuntimeConfig, copy.deepcopy(raw), source)  # unknown keys
    except (ValueError, HpcDdpError) as error:
        raise HpcDdpError(
            f"${OVERRIDES_VARIABLE}={environ[OVERRIDES_VARIABLE]!r}: {error}",
            f"set {OVERRIDES_VARIABLE} to space-separated section.key=value settings",
        ) from None
    configfile.apply_overrides(raw, overrides, sections_known, text)
    keywords = [f"{name}=..." for name, value in sections.items() if value is not None]
    if keywords:  # a wrong value may come from them: say so
        start = f"hpc_ddp.start({', '.join(keywords)})"
        source = start if config is None else f"{source} with {start}"
    settings = configfile.from_dict(RuntimeConfig, raw, source)
    if environ.get("SUBMITIT_EXECUTOR"):
        preempt = dataclasses.replace(settings.preempt, signal="USR2", stop_on_sigterm=False)
        settings = dataclasses.replace(settings, preempt=preempt)
    return settings


def default_run_name() -> str:
    """The started script's (or module's) name: ``train`` for ``train.py``."""
    started = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-m") else ""
    return Path(started).stem or "run"
