"""User-facing errors: one clear message that names the node, op, dtype or file.

The CLIs (``qcompile``, ``qmodel``) print a :class:`QCompileError` as one ``<prog>: error: <message>`` line and exit
with status 2. Any other exception is a bug: one ``<prog>: internal error: <type>: <message>`` line and exit status 1
(``QCOMPILE_DEBUG=1`` prints its stack trace). The checks that run before the expensive work (paths, tools, data
files) are in :mod:`qcompile.checks`; the model's quantization parameters are checked where the QDQ form is built
(:mod:`qcompile.qdq`) and where it is lowered to integers.
"""
import argparse
import functools
import os
import sys
import threading


class QCompileError(Exception):
    """An error in the user's model, input or options (not a bug in qcompile).

    The CLIs print ``qcompile: error: <message>`` and exit with status 2; no TVM stack trace.
    """


class UnsupportedOpError(QCompileError):
    """An operator (or a pattern of them) that qcompile cannot lower to integer compute."""

    def __init__(self, op: str, node: str = "", detail: str = ""):
        where = f" (node '{node}')" if node else ""
        super().__init__(f"unsupported op {op}{where}" + (f": {detail}" if detail else ""))
        self.op, self.node = op, node


# A QCompileError raised inside a TVM pass comes back through TVM's FFI as a RuntimeError; passes
# decorated with ``keeps_user_errors`` stash it so that ``run_pass`` can raise the original.
_pending = threading.local()


def keeps_user_errors(transform_module):
    @functools.wraps(transform_module)
    def wrapped(self, mod, ctx):
        try:
            return transform_module(self, mod, ctx)
        except QCompileError as e:
            _pending.err = e
            raise

    return wrapped


def run_pass(p, mod):
    """Apply pass ``p`` (or any callable on a module, e.g. a ``tvm.compile``) to ``mod``; a QCompileError inside it is
    re-raised as itself."""
    _pending.err = None
    try:
        return p(mod)
    except Exception:
        err, _pending.err = getattr(_pending, "err", None), None
        if err is not None:
            raise err from None
        raise


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse with usage errors as one ``<prog>: error: <message>`` line and exit status 2 (argparse prints the
    whole usage block first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def report_internal_error(prog: str, e: BaseException, debug_env: str = "QCOMPILE_DEBUG") -> int:
    """One line for an unexpected exception (a bug in qcompile or its libraries), exit status 1; the full trace
    with ``<debug_env>=1``."""
    if os.environ.get(debug_env, "") not in ("", "0"):
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    lines = str(e).strip().splitlines()
    msg = lines[0][:300] if lines else ""
    print(f"{prog}: internal error: {type(e).__name__}{': ' + msg if msg else ''}", file=sys.stderr)
    print(f"{prog}: this is a bug in qcompile or a library it uses; please report it with the command line "
          f"(run with {debug_env}=1 for the stack trace)", file=sys.stderr, flush=True)
    return 1


def install_warning_printer(prog: str) -> None:
    """Print every Python warning as one line ``<prog>: warning: <message>`` (no source line, no file:line)."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message).strip().splitlines()
        print(f"{prog}: warning: {text[0] if text else category.__name__}", file=file or sys.stderr, flush=True)

    warnings.showwarning = show


def run_cli(prog: str, body, user_errors=(QCompileError,)) -> int:
    """Run a command's ``body()`` the way every qcompile CLI does: Python warnings as one ``<prog>: warning:`` line
    each; a user error (``user_errors``) as one ``<prog>: error:`` line, exit status 2; Ctrl-C exit status 130; any
    other exception as one internal-error line, exit status 1 (:func:`report_internal_error`)."""
    import warnings

    saved = warnings.showwarning
    install_warning_printer(prog)
    try:
        return body()
    except user_errors as e:
        print(f"{prog}: error: " + " ".join(str(e).split()), file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (outputs are written only when complete)", file=sys.stderr, flush=True)
        return 130
    except Exception as e:  # noqa: BLE001  (a bug: one line, not a stack trace)
        return report_internal_error(prog, e)
    finally:
        warnings.showwarning = saved
