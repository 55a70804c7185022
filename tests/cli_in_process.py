"""`hybridpar ARGS` run in this process: the console script's own entry (`hybridpar.cli.main`).

A fresh ``python -m hybridpar.cli run`` costs about 15 s of CPU on the development machines
for a tiny run: the interpreter imports torch (and `torch._dynamo`, which the config check's
optimizer step imports), then its workers' fork server imports them again. Here the test
process has imported them already, and `hybridpar.spawn`'s fork server (the same
``forkserver`` context `hybridpar run` starts its workers from, with the same preloads) is
already up: the same run costs 1-2 s. Use a real process where the claim is about the process
(its exit status as a command, a signal to the agent, what outlives it).

What the agent leaves in the process is put back: the handlers of the signals torch's elastic
agent takes over, and the environment variables it sets. A run past `timeout` is stopped as a
user's Ctrl-C stops one (SIGINT: the agent stops its workers) and fails the call.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from hybridpar.cli import main

__all__ = ["CliResult", "CliTimeout", "hybridpar"]

# the signals torch's elastic agent handles while its workers run (TORCHELASTIC_SIGNALS_TO_HANDLE)
AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


@dataclass(frozen=True)
class CliResult:
    """What a command left: its exit status and what it printed (the agent's own lines; the
    workers print to the fork server's streams, not these)."""

    returncode: int
    stdout: str
    stderr: str


class CliTimeout(TimeoutError):
    """The command ran past its time limit (a hang); its workers were stopped."""


def hybridpar(*args: str | os.PathLike[str], cwd: str | os.PathLike[str] | None = None,
              timeout: float = 240.0) -> CliResult:
    """``hybridpar ARGS`` in this process (from `cwd`); its status and output."""
    handlers = {s: signal.getsignal(s) for s in AGENT_SIGNALS}
    environ = dict(os.environ)
    here = Path.cwd()
    out, err = io.StringIO(), io.StringIO()
    expired = threading.Event()

    def stop() -> None:   # from the timer's thread; the handler runs in the main thread
        expired.set()
        os.kill(os.getpid(), signal.SIGINT)

    def interrupted(signum: int, frame: object) -> None:   # until the agent takes SIGINT over
        raise CliTimeout

    timer = threading.Timer(timeout, stop)
    timer.daemon = True
    try:
        if cwd is not None:
            os.chdir(cwd)
        signal.signal(signal.SIGINT, interrupted)
        timer.start()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main([os.fspath(a) for a in args])
            except SystemExit as e:   # argparse's refusals
                status = e.code if isinstance(e.code, int) else 1
            except CliTimeout:
                status = 128 + signal.SIGINT
    finally:
        timer.cancel()
        os.chdir(here)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.environ.clear()
        os.environ.update(environ)
    if expired.is_set():
        raise CliTimeout(f"hybridpar {' '.join(map(str, args))}: still running after "
                         f"{timeout:g} s (stopped)\n{err.getvalue()[-3000:]}")
    return CliResult(status, out.getvalue(), err.getvalue())
