"""Error types for user mistakes. Each message is one line that names the problem
and the fix; launch/train.py prints it without a traceback."""


class SeekspeedError(ValueError):
    """A mistake in the user's input (config, data, command line)."""


class ConfigError(SeekspeedError):
    """The JSON config or the command line asks for something invalid."""


class DataError(SeekspeedError):
    """The training data is missing, empty or unusable."""
