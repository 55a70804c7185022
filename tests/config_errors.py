"""`error_of`: the one-line ConfigError a config file (with overrides) raises."""

from __future__ import annotations

import pytest

from hybridpar.train import ConfigError, load_config


def error_of(path, *overrides) -> str:
    """The message of the ConfigError `load_config(path, overrides)` raises: one line, naming
    the file first."""
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path))
    return message
