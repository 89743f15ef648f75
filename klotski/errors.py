"""The exceptions that mean "the user has something to fix": the CLI prints them as one
line (what, where, how to fix) instead of a traceback. Anything else is our bug."""
from klotski.config import ConfigError
from placement.store import CheckpointError


class ModelNotFound(Exception):
    """`--model` names nothing that can be opened (or built); the message says what to do."""


class UserError(Exception):
    """Raised by the engine for conditions the user can fix (e.g. an unwritable output)."""


class RunStopped(Exception):
    """A run that stopped midway; the message says why, where the finished records are and
    that rerunning the same command resumes."""


def _user_errors():
    from klotski.io.jobs import JobFileError
    errors = [ConfigError, ModelNotFound, CheckpointError, JobFileError, UserError]
    try:
        from planner.solve import Infeasible
        errors.append(Infeasible)
    except ImportError:
        pass
    return tuple(errors)


USER_ERRORS = _user_errors()
