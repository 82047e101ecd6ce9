"""User-facing errors: the CLI prints these as one line and exits with status 2."""


class PhaseloopError(Exception):
    """A problem with the user's input (config, argument, data, checkpoint).

    The message names the problem and the fix, in one line.
    """


class ConfigError(PhaseloopError, ValueError):
    """An invalid configuration value or combination; names the field."""


class DataError(PhaseloopError):
    """A missing, empty or unreadable data source."""


class CheckpointError(PhaseloopError):
    """An unreadable, mismatched or missing checkpoint / run folder."""
