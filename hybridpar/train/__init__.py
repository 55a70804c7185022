"""Config-driven training runs: the typed config of `hybridpar run` (trainer to follow)."""

from hybridpar.train.config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "load_config"]
