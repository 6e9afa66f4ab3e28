"""Job configuration: per-component pydantic sections composed into one `JobConfig`."""

from longrun.config.job import JobConfig, cross_section_problems
from longrun.config.loader import ConfigError, apply_override, config_from_dict, load_config

__all__ = [
    "ConfigError",
    "JobConfig",
    "apply_override",
    "config_from_dict",
    "cross_section_problems",
    "load_config",
]
