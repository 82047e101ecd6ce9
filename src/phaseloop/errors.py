"""User-facing errors: the CLI prints these as one line and exits with status 2."""


class PhaseloopError(Exception):
    """A problem with the user's input (config, argument, data, checkpoint).

    The message names the problem and the fix, in one line.
    """


class ConfigError(PhaseloopError, ValueError):
    """An invalid configuration value or combination; names the field."""

    @classmethod
    def invalid(cls, message: str, section: str = "config") -> "ConfigError":
        """The error of an invalid setting, in the one spelling every config uses:
        ``invalid config: NAME=VALUE: why, and the fix`` (``section``: "train config",
        "model config", ... for the others)."""
        return cls(f"invalid {section}: {message}")


class DataError(PhaseloopError):
    """A missing, empty or unreadable data source."""


class CheckpointError(PhaseloopError):
    """An unreadable, mismatched or missing checkpoint / run folder."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler preempting the job, ``kill``): handled as Ctrl-C is, so a
    trainer stops at a step boundary keeping its checkpoint; the command exits 143."""


def raise_terminated(signum, frame):
    """A SIGTERM handler: ``signal.signal(signal.SIGTERM, raise_terminated)``."""
    raise Terminated()


def was_terminated(e: BaseException) -> bool:
    """Did this interruption (or the one it was raised while handling) come from SIGTERM?"""
    return isinstance(e, Terminated) or isinstance(e.__context__, Terminated)
