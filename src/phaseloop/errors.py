"""User-facing errors: the CLI prints these as one line and exits with status 2."""


class PhaseloopError(Exception):
    """A problem with the user's input (config, argument, data, checkpoint).

    The message names the problem and the fix, in one line.
    """


def state_dict_error(e: BaseException, limit: int = 120) -> str:
    """What ``load_state_dict``'s RuntimeError says past its header line ("Error(s) in loading
    state_dict for M:", which names nothing): its first key's line, cut as ``first_line``."""
    lines = [line.strip() for line in str(e).strip().splitlines()]
    detail = next((line for line in lines[1:] if line), None)
    return first_line(detail if detail and lines[0].startswith("Error(s) in loading") else e, limit)


def first_line(e: BaseException | str, limit: int | None = None) -> str:
    """The first line of an error's message (its type's name when it has none), cut at
    the last word boundary within ``limit`` characters with an ellipsis, never inside a
    word; None: not cut."""
    text = (str(e).strip().splitlines() or [""])[0] or (type(e).__name__ if isinstance(e, BaseException) else "")
    if limit is None or len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0] if " " in text[:limit] else text[:limit]
    return cut.rstrip(" ,;:(") + " …"


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
