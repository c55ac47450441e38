#!/usr/bin/env bash
# slurmrun installed the way a user installs it, in fresh virtual environments (no system
# site-packages), running tests/smoke/smoke.py from outside the checkout:
#
#   bash tests/fresh_venv.sh [torch] [py310]     default: both legs
#
#   torch  Python 3 (this machine's python3) with `pip install torch==2.13.0 <slurmrun>`: the
#          declared dependencies and nothing else (no numpy, no pytest). Tensors, a bfloat16
#          tensor, a dict of tensors, plain objects, an exception, a dead worker; then the
#          README's first Python example and every localhost file of examples/, run as a new
#          user runs them, their output checked, and no torch warning about the missing numpy
#          (tests/smoke/examples.py).
#   py310  Python 3.10 (SLURMRUN_PY310, else python3.10 on PATH, else pyenv's) with slurmrun
#          installed --no-deps plus its declared dependencies but torch (PyPI's torch for 3.10
#          is a multi-GB CUDA build): the same launches with backend=None, without tensors.
#
# The dependencies whose version changes what a user sees get both ends of their declared range:
# the torch leg takes the newest (as pip resolves it), the py310 leg the oldest allowed
# (OLDEST_OF: `name>=X` in pyproject.toml is installed as `name==X`). cloudpickle is one: 3.x
# renames the file of functions it pickles by value, and smoke.py checks that a worker's
# traceback still names the script, its line and source.
#
# A dependency that slurmrun uses but pyproject.toml does not declare fails here. Each leg
# prints its time; the script exits non-zero if any leg failed, and removes its venvs.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_PIN=2.13.0
OLDEST_OF=(cloudpickle)
say() { echo "tests/fresh_venv.sh: $*" >&2; }

[ $# -gt 0 ] || set -- torch py310

WORK="$(mktemp -d -t slurmrun-fresh-venv.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT

# Build from a copy of the files the package is made of, so the build writes nothing into the
# checkout (build/, *.egg-info) and uncommitted changes are what gets tested.
SRC="$WORK/src"
mkdir -p "$SRC"
cp -r "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/slurmrun" "$SRC/"
find "$SRC" -name __pycache__ -prune -exec rm -rf {} +
cp "$ROOT/tests/smoke/smoke.py" "$ROOT/tests/smoke/examples.py" "$WORK/"
mkdir -p "$WORK/docs-copy"
cp -r "$ROOT/README.md" "$ROOT/examples" "$WORK/docs-copy/"

# The declared dependencies but torch, read from pyproject.toml (for the leg without torch),
# those named in OLDEST_OF pinned to their declared minimum.
deps_without_torch() {
  python3 - "$SRC/pyproject.toml" "${OLDEST_OF[@]}" <<'EOF'
import re, sys, tomllib
with open(sys.argv[1], "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
for dep in deps:
    name = re.split(r"[\s<>=!~\[;]", dep, maxsplit=1)[0]
    if name in sys.argv[2:]:
        floor = re.fullmatch(re.escape(name) + r"\s*>=\s*([\w.]+)", dep)
        if floor is None:
            sys.exit(f"tests/fresh_venv.sh: {dep!r} in pyproject.toml has no `>=` minimum to pin")
        dep = f"{name}=={floor.group(1)}"
    if name != "torch":
        print(dep)
EOF
}

is_py310() { "$1" -c 'import sys; assert sys.version_info[:2] == (3, 10)' >/dev/null 2>&1; }

find_py310() { # the first interpreter that runs and is 3.10 (pyenv's shims may not run)
  local candidate
  if [ -n "${SLURMRUN_PY310:-}" ]; then
    echo "$SLURMRUN_PY310"
    return
  fi
  for candidate in python3.10 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.10.*/bin/python3.10; do
    if is_py310 "$candidate"; then
      command -v "$candidate"
      return
    fi
  done
}

install_torch() { # VENV: torch pinned, slurmrun with its declared dependencies
  "$1/bin/pip" install -q "torch==$TORCH_PIN" "$SRC"
}

install_py310() { # VENV: the declared dependencies but torch, then slurmrun without them
  local deps listed
  listed="$(deps_without_torch)" || return
  mapfile -t deps <<<"$listed"
  "$1/bin/pip" install -q "${deps[@]}" || return
  "$1/bin/pip" install -q --no-deps "$SRC"
}

# leg NAME PYTHON SMOKE_ARGS [examples]: a fresh venv, install_NAME into it, the smoke run, and
# with `examples` the README's and examples/' scripts (examples.py); then the venv is removed.
leg() {
  local name="$1" python="$2" smoke_args="$3" examples="${4:-}"
  local venv="$WORK/venv-$name" start=$SECONDS rc=0
  say "[$name] fresh venv from $python"
  # `set -e` does not apply inside a subshell on the left of `||`: each step exits on failure
  # itself, and the examples run even when a smoke check failed (both verdicts are wanted).
  (
    "$python" -m venv "$venv" || exit
    export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
    "install_$name" "$venv" || exit
    say "[$name] installed in $((SECONDS - start)) s: $("$venv/bin/pip" list --format=freeze | tr '\n' ' ')"
    cd "$WORK" || exit # outside the checkout: the installed slurmrun is the one imported
    steps=0
    # shellcheck disable=SC2086  # smoke_args is a word list
    env -u PYTHONPATH SLURMRUN_LOG_DIR="$WORK/logs-$name" "$venv/bin/python" smoke.py $smoke_args ||
      steps=$?
    if [ -n "$examples" ]; then
      step_start=$SECONDS
      env -u PYTHONPATH "$venv/bin/python" examples.py "$WORK/docs-copy" || steps=$?
      say "[$name] examples took $((SECONDS - step_start)) s"
    fi
    exit "$steps"
  ) || rc=$?
  rm -rf "$venv"
  if [ "$rc" = 0 ]; then
    say "[$name] passed in $((SECONDS - start)) s"
  else
    say "[$name] FAILED (exit $rc) after $((SECONDS - start)) s"
  fi
  return "$rc"
}

failed=()
for name in "$@"; do
  case "$name" in
    torch)
      leg torch python3 "" examples || failed+=(torch)
      ;;
    py310)
      py310="$(find_py310)"
      if [ -z "$py310" ] || ! is_py310 "$py310"; then
        say "[py310] FAILED: no Python 3.10 found (set SLURMRUN_PY310 to its interpreter)"
        failed+=(py310)
        continue
      fi
      leg py310 "$py310" --no-torch || failed+=(py310)
      ;;
    *)
      say "unknown leg '$name' (known: torch, py310)"
      exit 2
      ;;
  esac
done

if [ ${#failed[@]} -gt 0 ]; then
  say "FAILED legs: ${failed[*]}"
  exit 1
fi
say "all legs passed: $*"
