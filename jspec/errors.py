"""Typed exceptions of jspec.

Every error a user can cause derives from :class:`JspecError`, so a caller (and the CLI, which
turns them into one line on stderr and exit code 2) can tell bad input from a bug. The classes
also derive from the matching built-in where one fits, so ``except ValueError`` keeps working.
"""


class JspecError(Exception):
    """Base class of every error jspec raises on bad input."""


class ConfigError(JspecError, ValueError):
    """A configuration value is out of range or inconsistent."""


class CheckpointError(JspecError, ValueError):
    """A checkpoint is missing, truncated, corrupt or does not match its config."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A model name or path resolves to nothing."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint describes an architecture or format jspec does not run."""


class PromptError(JspecError, ValueError):
    """A prompt is empty or does not fit the model's context."""


class DraftMismatchError(JspecError, ValueError):
    """A draft does not fit its target (vocabulary, card, layer count)."""


class InsufficientMemoryError(JspecError, MemoryError):
    """A load or a run would need more memory than the machine has available (checked before
    anything is allocated; the message names both numbers)."""
