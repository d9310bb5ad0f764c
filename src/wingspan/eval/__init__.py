"""Evaluation of a draft: prompt sets (prompts.py), speculative vs greedy decoding side by side (runner.py),
results.json / results.md / acceptance.png (report.py). `vllm_referee.py` is a standalone script for the vllm venv.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingPackageError(ImportError):
    """An optional package that a named prompt set or the plot needs; the message says what to install."""


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
