"""The exceptions that mean "the user has something to fix": the CLI prints them as one
line (what, where, how to fix) instead of a traceback. Anything else is our bug."""
from placement.store import CheckpointError


class ConfigError(ValueError):
    """A flag or setting that cannot work; the message says which and what to use."""


class ModelNotFound(Exception):
    """`--model` names nothing that can be opened (or built); the message says what to do."""


class UserError(Exception):
    """Raised by the engine for conditions the user can fix (e.g. an unwritable output)."""


def require(module: str, *, extra: str, needed_by: str):
    """`module` imported, or a UserError in one line naming the extra that installs it (every
    optional package is in one of pyproject.toml's extras: tests/test_extras.py checks both)."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = (e.name or module).split(".")[0]
        raise UserError(f"{needed_by} needs the {missing} package, which is not installed: "
                        f"pip install 'klotski[{extra}]'") from None


class JobFileError(Exception):
    """A problem with a whole file (missing, unreadable, locked); one line for the CLI."""


class RunStopped(Exception):
    """A run that stopped midway; the message says why, where the finished records are and
    that rerunning the same command resumes."""


# (The planner's Infeasible is not among them: klotski/planning.py turns it into BudgetRefused,
# a UserError, at the one place it calls the planner.)
USER_ERRORS = (ConfigError, ModelNotFound, CheckpointError, JobFileError, UserError)
