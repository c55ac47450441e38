"""Which of the launcher's environment variables reach agents and workers, and env files."""

from __future__ import annotations

import fnmatch
import os
import signal
import subprocess
from collections.abc import Iterable, Mapping

__all__ = [
    "DEFAULT_ENV_VARS",
    "FORWARDED_SIGNALS",
    "EnvFileError",
    "env_words",
    "matching_env",
    "source_env_file",
    "user_env",
]

# Signals SLURM sends ahead of a time limit (`--signal=USR1@60`): they are for the workers.
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)

DEFAULT_ENV_VARS: tuple[str, ...] = (
    "PATH",
    "LD_LIBRARY_PATH",
    "LD_PRELOAD",
    "LIBRARY_PATH",
    "PYTHON*",
    "CUDA*",
    "CUDNN*",
    "NVIDIA*",
    "TORCH*",
    "PYTORCH*",
    "NCCL*",
    "GLOO*",
    "UCX*",
    "OMP_*",
    "MKL_*",
    "OPENBLAS_*",
    "HF_*",
    "TRANSFORMERS_*",
    "TOKENIZERS_*",
    "WANDB_*",
    "TRITON_*",
    "ACCELERATE_*",  # what `accelerate launch` would export (mixed precision, ...)
    "SUBMITIT_*",  # submitit's JobEnvironment() asks SUBMITIT_EXECUTOR which cluster it is on
    "XDG_*",
    "VIRTUAL_ENV",
    "CONDA_*",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LC_*",
    "TZ",
    "TMPDIR",
    "TERM",
)
"""fnmatch patterns of variables copied from the launcher to agents and workers by default."""

ENV_FILE_TIMEOUT = 60.0


class EnvFileError(RuntimeError):
    """Sourcing the env file failed."""


def env_words(extra: Iterable[str] | Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """`extra_env_vars` as its patterns and the variables it sets.

    A mapping sets its variables; in a tuple, a ``NAME=value`` word sets NAME (no variable's
    name has a ``=``, so such a word could match nothing as a pattern) and any other word
    is an fnmatch pattern of the launcher's variables to pass on.
    """
    if isinstance(extra, Mapping):
        return [], dict(extra)
    words = list(extra)
    values = dict(w.split("=", 1) for w in words if "=" in w)
    return [w for w in words if "=" not in w], values


def matching_env(environ: Mapping[str, str], patterns: Iterable[str]) -> dict[str, str]:
    """The variables of `environ` whose names match any of the fnmatch `patterns`."""
    pats = list(patterns)
    return {k: v for k, v in environ.items() if any(fnmatch.fnmatchcase(k, p) for p in pats)}


def user_env(
    default: Iterable[str],
    extra: Iterable[str] | Mapping[str, str],
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The user's part of what agents and workers get: the matching variables, the given ones.

    Args:
        default: `Options.default_env_vars`, fnmatch patterns of variables to pass on.
        extra: `Options.extra_env_vars`: more patterns, and ``NAME=value`` words (`env_words`).
        environ: the variables to match (``os.environ`` if None). A warm launcher reads them
            again at every run (`slurmrun.launcher.warm`).
    """
    environ = os.environ if environ is None else environ
    patterns, values = env_words(extra)
    env = matching_env(environ, [*default, *patterns])
    env.update(values)
    return env


def source_env_file(
    path: str, environ: Mapping[str, str], timeout: float = ENV_FILE_TIMEOUT
) -> dict[str, str]:
    """Sources `path` with bash in `environ` and returns the variables it set or changed.

    Raises:
        EnvFileError: bash failed (with bash's message), or took longer than `timeout`.
    """
    script = 'set -a; source "$1" || exit $?; exec env -0'
    try:
        out = subprocess.run(
            ["bash", "-c", script, "slurmrun-env-file", path],
            env=dict(environ),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise EnvFileError(f"sourcing env_file {path} took longer than {timeout:.0f} s") from e
    except FileNotFoundError as e:
        raise EnvFileError("bash is needed to source env_file, and it was not found") from e
    if out.returncode != 0:
        message = out.stderr.decode(errors="replace").strip() or f"exit code {out.returncode}"
        raise EnvFileError(f"sourcing env_file {path} failed: {message}")
    new: dict[str, str] = {}
    for item in out.stdout.split(b"\0"):
        if b"=" not in item:
            continue
        key, _, value = item.decode(errors="replace").partition("=")
        if key in ("_", "SHLVL", "PWD", "OLDPWD"):
            continue
        if environ.get(key) != value:
            new[key] = value
    return new


def env_file_problem(path: str | os.PathLike[str] | None) -> str | None:
    """Why `path` cannot be an env file, checked in the launcher before anything starts."""
    if path is None:
        return None
    if not os.path.isfile(path):
        return f"env_file {os.fspath(path)!r} does not exist or is not a file"
    if not os.access(path, os.R_OK):
        return f"env_file {os.fspath(path)!r} is not readable"
    return None
