"""The checks of a launch's options and call, before anything starts, and the pickled call."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from slurmrun.environment import env_file_problem, env_words
from slurmrun.errors import OptionsTypeError, OptionsValueError
from slurmrun.launcher.hangs import check_hang_timeout
from slurmrun.logs import log_level
from slurmrun.pickling import dumps, dumps_inband

if TYPE_CHECKING:
    from slurmrun.launcher.options import Options

__all__ = ["BACKENDS", "check_call"]

BACKENDS = ("nccl", "gloo", "mpi", "ucc", "auto", None)


def check_call(
    cfg: Options, func: Callable[..., Any], func_args: Sequence[Any], func_kwargs: dict[str, Any]
) -> bytes:
    """Validates options and the call, and returns the pickled call (before anything starts).

    Raises:
        OptionsValueError, OptionsTypeError: what is wrong, and what to do.
    """
    _validate(cfg, func, func_args, func_kwargs)
    return _pickle_call(func, tuple(func_args), func_kwargs)


def _validate(cfg: Options, func: object, func_args: object, func_kwargs: object) -> None:
    if not callable(func):
        raise OptionsTypeError(
            f"func must be callable (a function or lambda), got {type(func).__name__}"
        )
    if not isinstance(func_args, Sequence) or isinstance(func_args, str | bytes):
        raise OptionsTypeError(f"func_args must be a tuple or list, got {type(func_args).__name__}")
    if not isinstance(func_kwargs, dict) or not all(isinstance(k, str) for k in func_kwargs):
        raise OptionsTypeError("func_kwargs must be a dict with str keys, or None")
    _validate_hostnames(cfg.hostnames)
    _validate_workers(cfg.workers_per_host, cfg.hostnames)
    if cfg.backend not in BACKENDS:
        raise OptionsValueError(f"backend must be one of {BACKENDS}, got {cfg.backend!r}")
    _validate_env_and_logs(cfg)
    _validate_show_ranks(cfg.show_ranks)
    restarts = cfg.max_restarts
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise OptionsValueError(f"max_restarts must be an int >= 0, got {restarts!r}")
    for name in ("heartbeat_timeout", "timeout", "stall_timeout"):
        seconds = getattr(cfg, name)
        if name == "stall_timeout" and seconds is None:
            continue
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds <= 0:
            raise OptionsValueError(f"{name} must be a positive number of seconds, got {seconds!r}")
    _validate_watching(cfg)


def _validate_watching(cfg: Options) -> None:
    if cfg.health_check is not None and (
        not isinstance(cfg.health_check, str) or not cfg.health_check.strip()
    ):
        raise OptionsValueError(
            f"health_check must be a shell command or None, got {cfg.health_check!r}"
        )
    if cfg.gpu_check not in ("auto", "on", "off"):
        raise OptionsValueError(f"gpu_check must be 'auto', 'on' or 'off', got {cfg.gpu_check!r}")
    if not isinstance(cfg.stragglers, bool):
        raise OptionsTypeError(f"stragglers must be True or False, got {cfg.stragglers!r}")
    try:
        check_hang_timeout(cfg.hang_timeout)
    except TypeError as e:
        raise OptionsTypeError(str(e)) from None
    except ValueError as e:
        raise OptionsValueError(str(e)) from None


def _validate_env_and_logs(cfg: Options) -> None:
    for name in ("default_env_vars", "extra_env_vars"):
        patterns = getattr(cfg, name)
        if name == "extra_env_vars" and isinstance(patterns, Mapping):
            _validate_env_mapping(patterns)
            continue
        if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
            raise OptionsTypeError(f"{name} must be a tuple of fnmatch patterns, got {patterns!r}")
        if name == "extra_env_vars":
            _validate_env_mapping(env_words(patterns)[1])  # its NAME=value words
            continue
        for pattern in patterns:
            if "=" in pattern:  # no variable's name has one: the pattern would match nothing
                raise OptionsValueError(
                    f"default_env_vars: {pattern!r} sets a value, but default_env_vars holds "
                    "name patterns: put it in extra_env_vars"
                )
    if cfg.ssh_config_file is not None and not os.path.isfile(cfg.ssh_config_file):
        raise OptionsValueError(f"ssh_config_file={cfg.ssh_config_file!r} is not a file")
    if cfg.on_event is not None and not callable(cfg.on_event):
        raise OptionsTypeError(f"on_event must be callable (or None), got {cfg.on_event!r}")
    problem = env_file_problem(cfg.env_file)
    if problem:
        raise OptionsValueError(f"{problem}: pass the path of a bash file for agents to source")
    if cfg.log_handlers is not None and not all(
        isinstance(h, logging.Handler) for h in cfg.log_handlers
    ):
        raise OptionsTypeError("log_handlers must be a list of logging.Handler objects (or None)")
    try:
        log_level()  # a bad SLURMRUN_LOG_LEVEL is an error before anything starts
    except ValueError as e:
        raise OptionsValueError(str(e)) from None


def _validate_show_ranks(shown: object) -> None:
    if shown == "all":
        return
    if (
        isinstance(shown, str)
        or not isinstance(shown, Sequence)
        or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in shown)
    ):
        raise OptionsValueError(
            f"show_ranks must be 'all' or a tuple of global ranks (ints >= 0), got {shown!r}: "
            "e.g. show_ranks=(0, 3), or --ranks 0,3 on the command line"
        )


def _validate_env_mapping(variables: Mapping[Any, Any]) -> None:
    for name, value in variables.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise OptionsTypeError(
                "extra_env_vars as a mapping must map variable names to str values, got "
                f"{name!r}: {value!r}"
            )
        # Names travel in srun's comma-separated --export list.
        if not name or "=" in name or "," in name or "\0" in name or "\0" in value:
            raise OptionsValueError(
                f"extra_env_vars: {name!r} is not a valid environment variable name"
            )


def _validate_hostnames(h: object) -> None:
    if isinstance(h, str):
        if h not in ("auto", "slurm"):
            raise OptionsValueError(
                f"hostnames must be a list of host names, 'auto' or 'slurm', got {h!r} "
                f"(for one host, pass [{h!r}])"
            )
    elif not isinstance(h, list | tuple) or not h:
        raise OptionsValueError("hostnames is empty: pass a list of host names, 'auto' or 'slurm'")
    elif not all(isinstance(x, str) and x.strip() for x in h):
        raise OptionsValueError(f"hostnames must be non-empty strings, got {h!r}")


def _validate_workers(w: object, h: object) -> None:
    expected = "an int, a list of ints, 'auto' or 'slurm'"
    if isinstance(w, str):
        if w not in ("auto", "slurm"):
            raise OptionsValueError(f"workers_per_host must be {expected}, got {w!r}")
    elif isinstance(w, bool) or not isinstance(w, int | list | tuple):
        raise OptionsTypeError(f"workers_per_host must be {expected}, got {w!r}")
    elif isinstance(w, int):
        if w <= 0:
            raise OptionsValueError(f"workers_per_host must be at least 1, got {w}")
    else:
        if not w or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in w):
            raise OptionsValueError(
                f"workers_per_host must list positive ints (one per host), got {w!r}"
            )
        if isinstance(h, list | tuple) and len(w) != len(h):
            names = "1 host" if len(h) == 1 else f"{len(h)} hosts"
            raise OptionsValueError(
                f"workers_per_host has {len(w)} counts ({' '.join(map(str, w))}) but hostnames "
                f"names {names} ({', '.join(h)}): give one count per host, or one count for "
                f"every host (workers_per_host={w[0]}; on the command line --workers-per-host "
                f"{w[0]})"
            )


def _pickle_call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    try:
        return dumps_inband((func, args, kwargs))
    except Exception as first_error:
        # Say which part could not be pickled (pickling each part again costs only here).
        for what, obj in (("func", func), ("func_args", args), ("func_kwargs", kwargs)):
            try:
                dumps(obj)
            except Exception as e:
                raise OptionsTypeError(
                    f"{what} could not be pickled to send to the workers: {type(e).__name__}: "
                    f"{e}. Everything {what} holds must be picklable by cloudpickle (locks, "
                    "open files, sockets and generators are not); create such objects inside "
                    "func instead."
                ) from e
        raise OptionsTypeError(f"the call could not be pickled: {first_error}") from first_error
