"""Starts `agl-stream store` processes in a second or two, for the test that kills them many
times (tests/integration/compat/test_agl_store_kill.py): it imports the CLI and Agent Lightning
once (about 10 s of CPU on a small machine, most of a cold start), then forks each store process
from there. A forked process runs the CLI's `store` command as `agl-stream store` does, in a
session of its own, its output in a log file of its own. Only the main thread exists when it
forks (importing Agent Lightning starts none).

Commands, one a line on stdin, each answered with one line on stdout:
  start LOG  -> "pid N"                   a new store process, writing to LOG
  poll       -> "running" or "exit CODE"  the last one started (CODE: -9 after SIGKILL)
  reap       -> "exit CODE"               waits for the last one to end
The end of stdin ends this process (not a store it started: the test stops those).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import NoReturn

import agl_stream.compat.agl  # noqa: F401  (imports Agent Lightning, quietly)
from agl_stream.cli.main import cli


def serve(log: str) -> NoReturn:
    """In the forked child: `agl-stream store`, then exit without running the parent's code."""
    code = 1
    try:
        os.setsid()
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        cli.main(["store"], prog_name="agl-stream")  # ends in SystemExit with its exit code
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:  # noqa: BLE001 - reported in the child's log, as its exit code says
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    child, ended = 0, ""
    for line in iter(sys.stdin.readline, ""):
        command, _, argument = line.strip().partition(" ")
        if command == "start":
            sys.stdout.flush()  # a child must not inherit unwritten answers
            child, ended = os.fork(), ""
            if child == 0:
                serve(argument)
            answer = f"pid {child}"
        elif command in ("poll", "reap"):
            if not ended:
                pid, status = os.waitpid(child, 0 if command == "reap" else os.WNOHANG)
                if pid != 0:
                    ended = f"exit {os.waitstatus_to_exitcode(status)}"
            answer = ended or "running"
        else:
            answer = f"unknown command {command!r}"
        print(answer, flush=True)


if __name__ == "__main__":
    main()
