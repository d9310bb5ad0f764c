"""The package's own errors. Each says in one line what is wrong and where (file, line, field), and
`wingspan.cli.main` prints it as `error: ...` with exit status 2 instead of a traceback.

Each also derives from the builtin a Python caller would expect (ValueError, ImportError, RuntimeError).
"""

from __future__ import annotations

import importlib
from types import ModuleType


class WingspanError(Exception):
    """Raised on purpose by wingspan: bad settings, data, files or models, never a bug of its own."""


class ConfigError(WingspanError, ValueError):
    """A config file, override or option that cannot describe a valid run."""


class DataError(WingspanError, ValueError):
    """Input data that cannot be used; the message names the file, the line or index, and the field."""


class ModelError(WingspanError, ValueError):
    """A target or draft that cannot be used as asked: unknown, unsupported, or not made for each other."""


class CheckpointError(WingspanError, ValueError):
    """A checkpoint or draft directory that does not hold what it should."""


class ExportError(WingspanError, ValueError):
    """A draft that cannot be exported faithfully, or an export that does not reproduce its draft."""


class TrainingError(WingspanError, RuntimeError):
    """A run that cannot go on: its loss or gradients stopped being finite."""


class ServerError(WingspanError, RuntimeError):
    """An inference server refused a request for a reason other than the prompt's length."""


class MissingPackageError(WingspanError, ImportError):
    """An optional package that a feature needs; the message says what to install."""


def import_optional(module: str, package: str, needed_for: str) -> ModuleType:
    """Import `module` of the PyPI `package`, or fail with the pip command (all of them: the `eval` extra)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name not in (module, module.partition(".")[0]):
            raise  # the package is there, one of its own dependencies is not: pip's message is the useful one
        raise MissingPackageError(
            f"{needed_for} needs the {package!r} package: pip install {package} (or pip install 'wingspan[eval]')"
        ) from None
