"""Keyword arguments checked by name: a misspelt option names the call and the closest option.

``launch(f, worker_per_host=2)`` would otherwise fail in a dataclass's ``__init__``, naming a
class the user never called (``Options.__init__() got an unexpected keyword argument``).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

from slurmrun.errors import OptionsTypeError

__all__ = ["check_keywords"]


def check_keywords(
    call: str,
    given: Iterable[str],
    allowed: Iterable[str],
    elsewhere: Mapping[str, str] | None = None,
) -> None:
    """Raises if a keyword of `given` is not one of `allowed`, naming `call` and the closest.

    Args:
        call: the call the user wrote (``"launch"``, ``"Launcher"``, ``"submit"``).
        given: the keyword arguments' names.
        allowed: the names `call` takes.
        elsewhere: names `call` does not take that belong elsewhere, with where to put them
            (``{"workers_per_host": "launcher=slurmrun.Launcher(workers_per_host=...)"}``).

    Raises:
        OptionsTypeError: a name is not allowed (a TypeError, as Python's own).
    """
    names = list(allowed)
    for name in given:
        if name in names:
            continue
        message = f"{call}() got an unexpected keyword argument {name!r}"
        if elsewhere and name in elsewhere:
            raise OptionsTypeError(f"{message}: it belongs to {elsewhere[name]}")
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        if close:
            raise OptionsTypeError(f"{message}: did you mean {close[0]}?")
        raise OptionsTypeError(f"{message}; its options are: {', '.join(names)}")
