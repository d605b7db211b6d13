"""User-facing errors: one clear message that names the node, op, dtype or file."""


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
