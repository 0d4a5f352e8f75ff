"""`autotune` commands and documented Python scripts run as a user runs them, each in a process of its own, forked
warm.

``run`` is ``subprocess.run`` for the tests that run the CLI or a page's script: where the command is ``autotune ...``
(the console script, by name or path) or ``python -m autotune.cli ...``, the process is forked from tests/ranks.py's
forkserver, which has imported torch, transformers and autotune once per test process, and runs ``autotune.cli.main``
there with the command's arguments, working folder, environment and output files; where it is ``python SCRIPT ...``,
the script runs there as ``__main__`` (its folder first on sys.path, as ``python SCRIPT`` puts it). Every other
command goes to ``subprocess.run`` unchanged.

Why: a fresh interpreter imports torch and transformers again for every command, 2.5-4 s of each on the 2-core
machine, and the suite runs about a hundred of them. A forked process is as fresh for what a test asks of it (no
trial, store, cache or group of an earlier command is in it; its own session, so a timeout kills what it started),
its exit status and output are the command's. What it cannot see: an environment variable read when a preloaded
module was imported (``os.environ`` is the command's when ``main`` runs), which is why a test about the interpreter
itself (its start, its imports, its signals) runs ``subprocess`` directly.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.ranks import FORKSERVER

__all__ = ["autotune_arguments", "run"]

_CLI_MODULES = ("autotune.cli", "autotune")


def autotune_arguments(command: Sequence[str]) -> list[str] | None:
    """The CLI's arguments when ``command`` runs autotune; None for any other command."""
    words = [str(word) for word in command]
    if not words:
        return None
    if Path(words[0]).name == "autotune":
        return words[1:]
    if len(words) >= 3 and Path(words[0]).name.startswith("python") and words[1] == "-m" and words[2] in _CLI_MODULES:
        return words[3:]
    return None


def _script_of(command: Sequence[str]) -> list[str] | None:
    """``[SCRIPT, *ARGS]`` where ``command`` is ``python SCRIPT ARGS...``; None for any other command."""
    words = [str(word) for word in command]
    if len(words) < 2 or not Path(words[0]).name.startswith("python") or words[1].startswith("-"):
        return None
    return words[1:]


def _main(arguments: list[str]) -> int:
    from autotune.cli import main

    sys.argv = ["autotune", *arguments]
    return main(arguments)


def _script(argv: list[str]) -> int:
    import runpy

    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")
    return 0


def _child(
    entry: Any, arguments: list[str], cwd: str | None, env: dict[str, str] | None, out: str, err: str | None
) -> None:
    """In the forked process: the command's session, folder, environment and output, then ``entry(arguments)``
    (the CLI's main, or a script run as ``__main__``)."""
    os.setsid()
    if cwd is not None:
        os.chdir(cwd)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
    if err is None:  # stderr=STDOUT: one file, in the order the command wrote
        os.dup2(1, 2)
    else:
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    # A new interpreter's streams: PYTHONUNBUFFERED as the command's environment says, stderr line-buffered.
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), write_through=unbuffered)  # noqa: SIM115
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True, write_through=unbuffered)  # noqa: SIM115
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit():  # read by OpenMP when torch loaded, in the forkserver: the command's own, set again
        import torch

        torch.set_num_threads(int(threads))
    code: int = 1
    try:
        code = entry(arguments)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def run(
    command: Sequence[str],
    *,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    capture_output: bool = False,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    check: bool = False,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(command, ...)`` with the same keywords the tests use; an autotune command (in a bash script
    too: :func:`_shim_folder`) or a Python script forked warm."""
    arguments, entry = autotune_arguments(command), _main
    if arguments is None:
        arguments, entry = _script_of(command), _script
    piped = capture_output or (stdout == subprocess.PIPE and stderr in (subprocess.PIPE, subprocess.STDOUT))
    if arguments is None or not piped:
        if command and Path(str(command[0])).name == "bash":
            base = dict(os.environ if env is None else env)
            env = {**base, "PATH": f"{_shim_folder()}{os.pathsep}{base.get('PATH', '')}"}
        kwargs: dict[str, Any] = {"cwd": cwd, "env": env, "timeout": timeout, "text": text, "check": check}
        if capture_output:
            kwargs["capture_output"] = True
        else:
            kwargs.update(stdout=stdout, stderr=stderr)
        return subprocess.run(list(command), **kwargs)
    merged = stderr == subprocess.STDOUT
    with tempfile.TemporaryDirectory(prefix="autotune-cli-") as folder:
        out, err = str(Path(folder, "stdout")), None if merged else str(Path(folder, "stderr"))
        process = FORKSERVER.Process(
            target=_child,
            args=(entry, arguments, None if cwd is None else str(cwd), None if env is None else dict(env), out, err),
        )
        process.start()
        process.join(timeout)
        if process.exitcode is None:  # its session: what the command started goes with it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.join()
            raise subprocess.TimeoutExpired(list(command), timeout or 0.0)

        def read(path: str) -> Any:  # a process that died before its first write wrote nothing
            found = Path(path).read_bytes() if Path(path).exists() else b""
            return found.decode() if text else found

        done = subprocess.CompletedProcess(
            list(command), process.exitcode, read(out), None if err is None else read(err)
        )
    if check:
        done.check_returncode()
    return done


# A documented bash script runs in bash as written; the ``autotune`` its PATH finds first is this shim, which hands
# its arguments, folder and environment to the test process (a thread serving a Unix socket) and prints what the
# command forked warm there printed, exiting with its status. The shim is a Python without site (-S: stdlib only,
# 20 ms), where the console script is a fresh interpreter importing torch (4-6 s a command).
_SHIM = """#!{python} -S
import base64, json, os, socket, sys
connection = socket.socket(socket.AF_UNIX)
connection.connect({address!r})
asked = {{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}
connection.sendall(json.dumps(asked).encode() + b"\\n")
reply = b""
while chunk := connection.recv(1 << 16):
    reply += chunk
done = json.loads(reply)
sys.stdout.buffer.write(base64.b64decode(done["stdout"]))
sys.stderr.buffer.write(base64.b64decode(done["stderr"]))
sys.exit(done["code"])
"""
_SHIM_SECONDS = 900.0  # a command's limit in the shim's server (the test's own timeout kills bash first)


@functools.cache
def _shim_folder() -> str:
    """The folder of this process's ``autotune`` shim, its socket served by a daemon thread (made on first use)."""
    import socket
    import threading

    folder = tempfile.mkdtemp(prefix="autotune-shim-")
    owner = os.getpid()
    # Removed when this process exits (not by a forked child of it that exits through Python: the folder is not its).
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(folder, ignore_errors=True))
    address = str(Path(folder, "cli.sock"))
    server = socket.socket(socket.AF_UNIX)
    server.bind(address)
    server.listen()
    script = Path(folder, "autotune")
    script.write_text(_SHIM.format(python=sys.executable, address=address))
    script.chmod(0o755)

    def serve(connection: socket.socket) -> None:
        import base64
        import json

        with connection:
            asked = b""
            while not asked.endswith(b"\n"):
                chunk = connection.recv(1 << 16)
                if not chunk:
                    return
                asked += chunk
            request = json.loads(asked)
            command = ["autotune", *request["argv"]]
            try:
                done = run(command, cwd=request["cwd"], env=request["env"], capture_output=True, timeout=_SHIM_SECONDS)
            except subprocess.TimeoutExpired:  # said by the shim, as a timeout's status, not as its broken reply
                said = f"autotune shim: timed out after {_SHIM_SECONDS} s\n".encode()
                done = subprocess.CompletedProcess(command, 124, b"", said)
            reply = {
                "code": done.returncode,
                "stdout": base64.b64encode(done.stdout).decode(),
                "stderr": base64.b64encode(done.stderr).decode(),
            }
            connection.sendall(json.dumps(reply).encode())

    def accept() -> None:
        while True:
            connection, _ = server.accept()
            threading.Thread(target=serve, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return folder
