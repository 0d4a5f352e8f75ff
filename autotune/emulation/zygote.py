"""A warm start for an emulated card's children: ``python -m autotune.emulation.zygote``.

Started by autotune/emulation/runner.py with one card's environment (the emulation's LD_PRELOAD, the card's
variables), it imports torch and what a child's jobs import (3 of a child's 3.5 s start on the 2-core machine)
and then forks one child per request read from stdin: a JSON line ``[request, result, log]``. Each child is a
fresh process, as a cold one is (nothing of one request's torch state reaches the next; CUDA is never
initialized before the fork), its own session (a timeout kills its group), its output in its log. For each
request the zygote writes two lines: the child's pid, then its exit status.
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["main"]


def _warm_imports() -> None:
    import torch
    import torch._dynamo  # noqa: F401
    import torch._subclasses.fake_tensor  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    import autotune.emulation.child  # noqa: F401

    if torch.cuda.is_initialized():  # a forked child cannot use a CUDA context made before the fork
        raise RuntimeError("CUDA was initialized by the zygote's imports")


def _child(request: str, result: str, log: str) -> None:
    code = 1
    try:
        os.setsid()
        with open(log, "wb") as out:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        from autotune.emulation.child import main as child_main

        code = child_main([request, result])
    except BaseException:  # the parent reads the missing result and the log
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> int:
    _warm_imports()
    for line in sys.stdin:
        request, result, log = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request, result, log)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
