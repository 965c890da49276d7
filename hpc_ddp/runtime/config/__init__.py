"""The runtime's settings: the sections every run has, whatever it trains.

``run`` (identity and output), ``dist`` (process group and devices), ``checkpoint``,
``preempt`` (stop signals and requeue), ``tracking`` (MLflow), ``checks`` (before the
first step) and ``monitor`` (where the time goes). :func:`hpc_ddp.start`
takes them as keyword arguments, a YAML file and/or dotted overrides; the built-in
trainer's config adds its own sections to these (:mod:`hpc_ddp.trainer.config`).
"""

from hpc_ddp.runtime.config.resolve import (
    LOCAL_COMMAND_VARIABLE,
    OVERRIDES_VARIABLE,
    RuntimeConfig,
    Section,
    default_run_name,
    environment_overrides,
    resolve_config,
)
from hpc_ddp.runtime.config.saving import CheckpointConfig, PreemptConfig
from hpc_ddp.runtime.config.watching import ChecksConfig, MonitorConfig, TrackingConfig
from hpc_ddp.runtime.config.where import DistConfig, RunConfig

__all__ = [
    "LOCAL_COMMAND_VARIABLE",
    "OVERRIDES_VARIABLE",
    "CheckpointConfig",
    "ChecksConfig",
    "DistConfig",
    "MonitorConfig",
    "PreemptConfig",
    "RunConfig",
    "RuntimeConfig",
    "Section",
    "TrackingConfig",
    "default_run_name",
    "environment_overrides",
    "resolve_config",
]
