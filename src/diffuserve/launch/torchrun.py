"""`diffuserve-torchrun` (also `python -m diffuserve.launch.torchrun`): torchrun, stopped by a signal like a server.

torchrun's agent turns the SIGTERM it gets into a `SignalException`: it forwards the signal to every rank (our rank 0
drains and then stops the others, `launch/root.py`), waits for them, and re-raises, so plain torchrun ends with its
traceback and exit 1 even when every rank drained and exited 0. A platform that stops a pod signals its first
process, which is torchrun: this entry point runs torchrun's own `main` unchanged and turns that exception into the
exit code of the exit-code table (SIGTERM: 0, SIGINT: 130, any other signal: 128 + its number), with one line
instead of a traceback. Everything else (arguments, worker failures, their report) is torchrun's.
"""

from __future__ import annotations

import signal
import sys


def exit_code_for(signum: int) -> int:
    """The process exit code for being stopped by `signum` (docs/cli.md, exit codes)."""
    if signum == signal.SIGTERM:
        return 0
    return 128 + int(signum)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except SignalException as exc:
        code = exit_code_for(exc.sigval)
        name = signal.Signals(exc.sigval).name
        print(f"diffuserve-torchrun: stopped by {name}; the ranks were signalled and have exited (exit {code})")
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
