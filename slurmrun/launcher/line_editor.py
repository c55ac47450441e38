"""GNU readline at the debugger's prompt: line editing, history and Tab, one key at a time.

Python's `readline` module offers readline only through ``input()``, which holds the terminal
until a line is done: a session that ends while its prompt is up (the rank died, the run was
cut short) could never take the prompt back, and the terminal would stay in readline's mode
after the launcher exits. So `LineEditor` drives readline's callback interface
(``rl_callback_handler_install``, ``rl_callback_read_char``), which that module leaves out,
through ctypes in the very library the module is linked to: one state, shared with it. The
console's reader thread feeds it a key whenever the terminal has one, and can stop between
keys (the terminal is then put back as it was). History is readline's own (the session's
lines, across every breakpoint of the process); the user's ``~/.inputrc`` applies; Tab calls
a completer given with the prompt, which asks the rank's pdb.

Only GNU readline (Linux's Python) has this interface as used here; elsewhere (libedit, no
readline), or when stdin or stdout is no terminal, `LineEditor.load` gives None and the
console reads plain lines.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Completer", "LineEditor"]

# text, line, begidx, endidx -> the completions of `text` (readline's completer, in one call)
Completer = Callable[[str, str, int, int], list[str]]

# pdb's own word breaks (Python 3.13's): "." is none, so ``p obj.attr`` completes as one
# expression, nor "$" (pdb's convenience variables, ``$_exitcode``)
PDB_DELIMS = " \t\n`@#%^&*()=+[{]}\\|;:'\",<>?"

_LINE_FUNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_editor: LineEditor | None = None
_loaded = False
_load_lock = threading.Lock()


class LineEditor:
    """readline's callback interface: one line at a time, on one thread (see the module).

    Args:
        lib: the readline library (its symbols, through Python's readline module).
        readline: Python's readline module (history, completer, line buffer).
    """

    def __init__(self, lib: ctypes.CDLL, readline: Any) -> None:
        self._lib = lib
        self._rl = readline
        self._free = ctypes.CDLL(None).free
        self._free.argtypes = [ctypes.c_void_p]
        lib.rl_callback_handler_install.argtypes = [ctypes.c_char_p, _LINE_FUNC]
        lib.rl_set_prompt.argtypes = [ctypes.c_char_p]
        lib.rl_replace_line.argtypes = [ctypes.c_char_p, ctypes.c_int]
        self._on_line = _LINE_FUNC(self._line_done)  # (kept: readline holds the pointer)
        self._prompt = b""
        self._line: str | None = None
        self._done = False
        self._active = False
        self._saved: tuple[Any, str, Any] | None = None
        self._complete: Completer | None = None
        self._matches: list[str] = []

    @staticmethod
    def load() -> LineEditor | None:
        """The process's editor; None without GNU readline, or without a terminal on 0 and 1."""
        global _editor, _loaded  # noqa: PLW0603 - readline's state is the process's: one editor
        with _load_lock:
            if not _loaded:
                _loaded = True
                _editor = _load()
            if _editor is None or not _terminal_on_stdio():
                return None
            return _editor

    @property
    def active(self) -> bool:
        """Whether a prompt is up (between `start` and the line, or `stop`)."""
        return self._active

    def start(self, prompt: str, complete: Completer | None) -> None:
        """Shows `prompt` and edits a line from now on (the terminal in readline's mode)."""
        rl = self._rl
        self._saved = (rl.get_completer(), rl.get_completer_delims(), self._catching(0))
        self._complete = complete
        rl.set_completer(self._completer)
        rl.set_completer_delims(PDB_DELIMS)
        rl.parse_and_bind("tab: complete")  # (Python's readline binds Tab to insert a tab)
        self._prompt = prompt.encode(errors="replace")
        self._line, self._done, self._active = None, False, True
        self._lib.rl_callback_handler_install(self._prompt, self._on_line)

    def feed(self) -> bool:
        """Takes the key the terminal has (call when stdin is readable); True: a line is done.

        The line is then `line` (None: end of input, Ctrl-D on an empty line).
        """
        self._lib.rl_callback_read_char()
        return self._done

    @property
    def line(self) -> str | None:
        """The line typed (without its newline), once `feed` said it is done."""
        return self._line

    def interject(self, text: str) -> None:
        """Writes `text` (whole lines) above the prompt, then shows the prompt and line again."""
        if not self._active:
            _write(text)
            return
        lib, rl = self._lib, self._rl
        typed = rl.get_line_buffer().encode(errors="surrogateescape")
        point = ctypes.c_int.in_dll(lib, "rl_point").value
        lib.rl_set_prompt(b"")
        lib.rl_replace_line(b"", 0)
        lib.rl_redisplay()  # (an empty line: readline erases what it drew, wrapped lines too)
        _write("\r" + text)
        lib.rl_set_prompt(self._prompt)
        lib.rl_replace_line(typed, 0)
        ctypes.c_int.in_dll(lib, "rl_point").value = point
        lib.rl_on_new_line()
        lib.rl_redisplay()

    def stop(self) -> None:
        """Ends the line in progress (the prompt's line is left as it is); puts back the rest."""
        if self._active:
            self._active = False
            self._lib.rl_callback_handler_remove()  # (the terminal is put back as it was)
            _write("\n")
        self._restore()

    def _line_done(self, pointer: int | None) -> None:
        """The line handler: readline has the line (NULL: end of input)."""
        if pointer:
            self._line = ctypes.string_at(pointer).decode(errors="surrogateescape")
            self._free(pointer)
            history = self._rl.get_current_history_length()
            if self._line.strip() and self._rl.get_history_item(history) != self._line:
                self._rl.add_history(self._line)
        else:
            self._line = None
            _write("\n")  # (Ctrl-D leaves the cursor after the prompt)
        self._done, self._active = True, False
        self._lib.rl_callback_handler_remove()
        self._restore()

    def _completer(self, text: str, state: int) -> str | None:
        """Python readline's completer: asks `complete` once per Tab, then hands out the list."""
        if state == 0:
            rl = self._rl
            complete = self._complete
            self._matches = []
            if complete is not None:
                self._matches = complete(
                    text, rl.get_line_buffer(), rl.get_begidx(), rl.get_endidx()
                )
        return self._matches[state] if state < len(self._matches) else None

    def _catching(self, value: int) -> tuple[int, int]:
        """Sets whether readline catches signals; returns what it was.

        Off while editing: Ctrl-C is the launcher's (its main thread's), and readline's handlers
        would run on whichever thread the signal meets.
        """
        signals = ctypes.c_int.in_dll(self._lib, "rl_catch_signals")
        winch = ctypes.c_int.in_dll(self._lib, "rl_catch_sigwinch")
        old = (signals.value, winch.value)
        signals.value = winch.value = value
        return old

    def _restore(self) -> None:
        saved, self._saved = self._saved, None
        if saved is not None:
            completer, delims, catching = saved
            self._rl.set_completer(completer)
            self._rl.set_completer_delims(delims)
            ctypes.c_int.in_dll(self._lib, "rl_catch_signals").value = catching[0]
            ctypes.c_int.in_dll(self._lib, "rl_catch_sigwinch").value = catching[1]
        self._complete = None


def _load() -> LineEditor | None:
    try:
        import readline  # noqa: PLC0415 - only for a debugger's prompt
    except ImportError:
        return None
    if getattr(readline, "backend", "readline") != "readline" or "libedit" in (
        readline.__doc__ or ""
    ):
        return None
    try:
        lib = ctypes.CDLL(readline.__file__)  # (its symbols include the library it links)
        for name in ("rl_callback_handler_install", "rl_callback_read_char", "rl_redisplay"):
            getattr(lib, name)
        ctypes.c_int.in_dll(lib, "rl_catch_signals")
        return LineEditor(lib, readline)
    except (OSError, AttributeError, ValueError):
        return None


def _terminal_on_stdio() -> bool:
    """Whether readline's streams (descriptors 0 and 1) are sys.stdin's and sys.stdout's ttys."""
    try:
        return (
            sys.stdin.fileno() == 0 and sys.stdout.fileno() == 1 and os.isatty(0) and os.isatty(1)
        )
    except (AttributeError, ValueError, OSError):
        return False


def _write(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.write(text)
        sys.stdout.flush()
