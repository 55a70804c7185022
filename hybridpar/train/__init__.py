"""Config-driven training runs: the typed config and the data of `hybridpar run`."""

from hybridpar.train.configs.config import Config, ConfigError, load_config
from hybridpar.train.data import default_corpus, make_batches

__all__ = ["Config", "ConfigError", "default_corpus", "load_config", "make_batches"]
