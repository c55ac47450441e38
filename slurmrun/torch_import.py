"""Importing torch where slurmrun, not the user, imports it: without torch's numpy warning.

torch does not depend on numpy, but ``import torch`` without it warns ``UserWarning: Failed
to initialize NumPy: No module named 'numpy'``. slurmrun imports torch in every node's
spawner (so that workers start with it loaded) and in the launcher when a result holds
tensors; that warning would then be the first line of the launcher's output and of every
agent's log, about a package the user never asked for. Only that warning, and only during
slurmrun's own import, is silenced: a user's own ``import torch`` or use of numpy warns as
torch means it to.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType

NUMPY_WARNING = "Failed to initialize NumPy"


def import_module(name: str) -> ModuleType:
    """`importlib.import_module`, with torch's warning that numpy is missing silenced.

    Args:
        name: the module to import (``"torch"``, or any module the spawner preloads).

    Returns:
        The module.

    Raises:
        ImportError: the module is not installed.
    """
    module = sys.modules.get(name)
    if module is not None:  # no filter change at all once imported (catch_warnings is global)
        return module
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NUMPY_WARNING, category=UserWarning)
        return importlib.import_module(name)


def import_torch() -> ModuleType:
    """``import torch`` as `import_module` does it."""
    return import_module("torch")
