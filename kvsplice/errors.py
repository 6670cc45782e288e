"""The exceptions a user of kvsplice can meet. Each says what was wrong and what to do."""


class KvspliceError(Exception):
    """Base of every error kvsplice raises on purpose."""


class ConfigError(KvspliceError, ValueError):
    """An engine setting is out of range or unknown."""


class InvalidRequestError(KvspliceError, ValueError):
    """The request itself is wrong: empty prompt, bad sampling values, bad segment markup."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens to generate) does not fit the model's context."""


class ModelLoadError(KvspliceError):
    """The model cannot be found, read, or is of an architecture kvsplice does not run."""


class OutOfBlocksError(KvspliceError):
    """The KV budget cannot hold what was asked for, even after evicting every unused cache entry."""


class QueueFullError(KvspliceError):
    """More requests are waiting than the engine's `max_waiting` allows: try again later."""
