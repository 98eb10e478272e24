"""User-facing errors: each carries one line that names what is wrong and what would be valid.

The CLI prints ``loomrl: error: <message>`` for any :class:`LoomError` and exits with status 2, never a
traceback. Library code raises the most specific subclass.
"""


class LoomError(Exception):
    """Base of every error meant for the user rather than for a developer."""

    recoverable: bool = False
    """Whether a run may get past it by starting its processes anew from its latest checkpoint (a lost worker or
    controller: ``runtime.max_failures``); an error the run itself raised would recur."""


class ConfigError(LoomError):
    """A configuration value, key or file is invalid."""


class DataError(LoomError):
    """A dataset, prompt file, model path or reward function cannot be used."""


class WorkflowError(LoomError):
    """A workflow graph is malformed (cycle, missing producer, duplicate output)."""


class TrainingError(LoomError):
    """Training cannot go on: a numerical fault (NaN or inf) the run was told to stop on."""


class CheckpointError(LoomError):
    """A checkpoint is missing, incomplete or does not match the models it is loaded into."""
