"""Every input honoured or refused before any work starts: the checks that need no task.

``main`` runs :func:`check_inputs` on the parsed flags of every command before the command runs, so that a
value that cannot be honoured costs no trial, stores nothing and writes no file: one line naming the flag, the
value and the rule, exit 2 (``autotune.core.errors.ExitCode.USAGE``). What the argument types refuse alone (a
size that is not one, a number that is not finite, an integer past what a profile records) is refused by the
parser before this; what needs the task loaded (a policy on a model without blocks, --moe-load-factor on a
dense model, --seq-len on a task that takes none) by the command, still before its first trial.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from autotune.cli.common import CliError
from autotune.core.compositions import Dimensions, refuse_composition
from autotune.core.units import format_bytes
from autotune.tasks.tp_plan import tp_plan_refusal

__all__ = ["check_inputs", "check_task"]

# The commands that upload what they make to --server (a write, which the server takes only with a token).
_UPLOADERS = ("probe", "estimate", "fleet")
# The commands that only talk to a server, from --server or else $AUTOTUNE_URL.
_CLIENTS = ("suggest", "profiles")


def check_inputs(args: argparse.Namespace) -> None:
    """Refuse, in one line, the first flag of args whose value the command could not honour.

    Raises:
        CliError: naming the flag, the value and the rule it breaks.
    """
    _check_server(args)
    _check_output(args)
    _check_micro_batches(args)
    _check_card_list(args)
    _check_full_walk(args)
    _check_gpu_memory(args)
    _check_budget_on_cards(args)
    _check_database_url(args)
    _check_verify_sizes(args)
    _check_mesh(args)
    _check_composition(args)
    _check_tp_plan(args)


def _check_tp_plan(args: argparse.Namespace) -> None:
    refusal = tp_plan_refusal(
        getattr(args, "tp_plan", None),
        tp=getattr(args, "tp", None) or 1,
        cp=getattr(args, "cp", None) or 1,
        seq_lens=getattr(args, "seq_len", None) or (),
    )
    if refusal is not None:
        raise CliError(refusal)


def check_task(args: argparse.Namespace, task: Any) -> None:
    """The rows of the composition table that read the model (its heads, key/value heads, blocks, family:
    autotune/core/compositions.py), asked once the command has loaded the task and before its first trial: one line
    naming the flag and the model's number, exit 2.

    Raises:
        CliError: the first row that refuses the flags' mesh on this model.
    """
    dims = _dimensions(args)
    if dims.trivial_mesh and dims.tp_plan is None:
        return
    from autotune.measure.model_shape import model_shape

    own_plan = task.tp_plan if isinstance(task.tp_plan, str) else None
    dims = dims.replace(
        seq_lens=dims.seq_lens or ((task.seq_len,) if task.seq_len else ()),
        tp_plan=dims.tp_plan or own_plan,
        model=model_shape(task),
    )
    refuse_composition(dims, CliError)


def _dimensions(args: argparse.Namespace) -> Dimensions:
    """The flags' dimensions for the composition table (what a flag leaves unsaid, unknown)."""
    suggest = getattr(args, "command", None) == "suggest"  # a query: None is the fingerprint's compile and offload
    policies = getattr(args, "ac", None)
    if isinstance(policies, str):
        policies = [policies]
    budgets = [policy for policy in policies or () if policy.startswith("budget:")]
    lengths = getattr(args, "seq_len", None)
    return Dimensions(
        strategy=getattr(args, "strategy", None) or "ddp",
        world_size=getattr(args, "world_size", None) or 1,
        tp=getattr(args, "tp", None) or 1,
        pp=getattr(args, "pp", None) or 1,
        cp=getattr(args, "cp", None) or 1,
        ep=getattr(args, "ep", None) or 1,
        compile=getattr(args, "compile", None),
        offload=getattr(args, "offload", None) or "none",
        host_budget=getattr(args, "host_budget", None) is not None and not suggest,
        activation_checkpointing=budgets[0] if budgets and not suggest else "none",
        quantize=getattr(args, "quantize", None),
        lora=getattr(args, "lora_rank", None) is not None if hasattr(args, "lora_rank") else None,
        precision=getattr(args, "precision", None),
        weights_dtype=getattr(args, "weights_dtype", None),
        lm_loss=getattr(args, "loss", None) or "plain",
        seq_lens=tuple(lengths) if isinstance(lengths, list) else (),
        tp_plan=getattr(args, "tp_plan", None),
    )


def _check_mesh(args: argparse.Namespace) -> None:
    """The mesh flags on their own (the schedule's rules, W a multiple of tp x pp x cp), before the model's rows
    (:func:`check_task`) can be asked."""
    if getattr(args, "command", None) not in ("probe", "estimate"):
        return
    from autotune.cli.common import mesh_of
    from autotune.core.errors import AutotuneError

    try:
        mesh_of(args).validate(getattr(args, "world_size", None) or 1)
    except AutotuneError as exc:
        raise CliError(str(exc)) from None


def _check_composition(args: argparse.Namespace) -> None:
    """The flags' dimensions, asked of the one composition table (autotune/core/compositions.py) before any task
    loads: what needs the task (the optimizer's library, LoRA in a spec, the model's shape: :func:`check_task`) is
    asked again where it is known."""
    command = getattr(args, "command", None)
    if command in ("probe", "estimate", "fleet", "suggest"):
        refuse_composition(_dimensions(args), CliError)
    if getattr(args, "host_budget", None) is not None and command not in ("probe", "suggest"):
        raise CliError(
            "--host-budget applies to autotune probe: an estimate reports the host's bytes with --offload but "
            "does not search by them"
        )


def _check_server(args: argparse.Namespace) -> None:
    command = getattr(args, "command", None)
    server = getattr(args, "server", None)
    if command in _CLIENTS and not server:
        server = os.environ.get("AUTOTUNE_URL") or None
        if server is None:
            raise CliError(f"{command} asks a server: give --server URL or set AUTOTUNE_URL")
        _check_url(server, "AUTOTUNE_URL")
        return
    if server is None:
        return
    _check_url(server, "--server")
    if command in _UPLOADERS and not os.environ.get("AUTOTUNE_TOKEN"):
        raise CliError(
            f"--server {server} uploads what {command} makes, and the server takes uploads only with a write "
            "token: set AUTOTUNE_TOKEN (or leave --server out and keep the profile with --output)"
        )


def _check_url(url: str, flag: str) -> None:
    """A server URL: http(s), a host, a port that is one."""
    rule = "give http://HOST:PORT or https://HOST"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  # raises ValueError for a port that is not a number in 0..65535
    except ValueError as exc:
        raise CliError(f"{flag} {url!r} is not a server URL ({exc}): {rule}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CliError(f"{flag} {url!r} is not a server URL: {rule}")


def _check_output(args: argparse.Namespace) -> None:
    output = getattr(args, "output", None)
    if output is None:
        return
    path = Path(output)
    if getattr(args, "command", None) == "fleet":  # a folder of profiles, one file per pair
        if path.exists() and not path.is_dir():
            raise CliError(f"--output {str(path)!r} is a file: fleet writes a profile per pair into a folder")
    elif path.is_dir():
        raise CliError(f"--output {str(path)!r} is a folder: give a file name, e.g. {str(path / 'profile.json')!r}")
    _check_writable(path, "--output")


def _check_writable(path: Path, flag: str) -> None:
    """The nearest folder of path that exists is one this process can create a file in (what
    write_atomically does, creating the folders between): tried with a file removed at once."""
    folder = path if path.is_dir() else path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise CliError(f"{flag} {str(path)!r}: {str(folder)!r} is a file, not a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".autotune-check-"):
            pass
    except OSError as exc:
        raise CliError(f"{flag} {str(path)!r}: cannot write in {str(folder)!r} ({exc.strerror or exc})") from None


def _check_micro_batches(args: argparse.Namespace) -> None:
    """--micro-batches: sizes the emulated search can try (only it runs them)."""
    sizes = getattr(args, "micro_batches", None) or ()
    if not sizes:
        return
    if getattr(args, "gpu", None) is None:
        raise CliError(
            f"--micro-batches {','.join(map(str, sizes))}: extra sizes are estimated for a card only: name it with "
            "--gpu (autotune gpus lists them)"
        )
    cap, multiple = args.max_micro_batch, args.multiple_of
    for m in sizes:
        if m > cap:
            raise CliError(
                f"--micro-batches {m}: above --max-micro-batch {cap}, the largest size the estimate tries "
                "(raise --max-micro-batch to try it)"
            )
        if m % multiple:
            raise CliError(f"--micro-batches {m}: not a multiple of --multiple-of {multiple}")


def _check_card_list(args: argparse.Namespace) -> None:
    """--gpu h100,h200: an estimate for each card, each named as the catalog names it (not by --device-name)."""
    gpu = getattr(args, "gpu", None)
    if not isinstance(gpu, str) or "," not in gpu:
        return
    names = [name.strip() for name in gpu.split(",")]
    if not all(names):
        raise CliError(f"--gpu {gpu!r}: an empty card name between the commas")
    if getattr(args, "device_name", None):
        raise CliError(f"--device-name names one card: --gpu names several ({gpu}); each takes its catalog name")


def _check_full_walk(args: argparse.Namespace) -> None:
    """--full-walk: the whole walk of an emulated card's fake trials (only a card's search has a shortcut)."""
    if getattr(args, "full_walk", False) and getattr(args, "gpu", None) is None:
        raise CliError("--full-walk walks every block of an emulated card's trials: name the card with --gpu")


def _check_gpu_memory(args: argparse.Namespace) -> None:
    """--gpu-memory and --estimate-bound: the memory and the bound of the card --gpu names (a card whose
    architecture can be placed and that a device of it can have is _known_cards's to say)."""
    gpu = getattr(args, "gpu", None)
    bound = getattr(args, "estimate_bound", None)
    if bound is not None and not gpu:
        raise CliError(
            f"--estimate-bound {bound} bounds what an estimate for a card does not model: give --gpu NAME "
            "(autotune gpus lists them)"
        )
    gpu_memory = getattr(args, "gpu_memory", None)
    if gpu_memory is None:
        return
    if not gpu:
        raise CliError(
            f"--gpu-memory {format_bytes(gpu_memory)} is the memory of the card --gpu names: give --gpu NAME"
        )
    names = gpu.split(",") if isinstance(gpu, str) else list(gpu)  # estimate: a string; fleet: card_list's list
    if len(names) > 1:
        raise CliError(
            f"--gpu-memory is one card's memory: --gpu names several ({','.join(names)}); give one card with it"
        )
    if gpu_memory <= 0:
        raise CliError(f"--gpu-memory {gpu_memory}: a card's memory is above 0 bytes")
    from autotune.core.cards import resolve_card

    for name in names:
        try:
            resolve_card(name, gpu_memory)
        except ValueError as exc:  # no family in the name, or memory no device of its architecture has
            raise CliError(f"--gpu {name!r} --gpu-memory {format_bytes(gpu_memory)}: {exc}") from None


def _check_budget_on_cards(args: argparse.Namespace) -> None:
    """A budget is what the job may hold of its card: above the card's memory it is refused where the card is
    known (--gpu, a catalog card's --device-name, a CUDA device of this machine)."""
    budgets = _budgets(args)
    if not budgets:
        return
    for name, memory_bytes in _known_cards(args):
        for budget in budgets:
            if budget > memory_bytes:
                raise CliError(
                    f"--budget {format_bytes(budget)} ({budget} bytes) is above the {name}'s memory, "
                    f"{format_bytes(memory_bytes)} ({memory_bytes} bytes as CUDA reports it): a budget is what the "
                    "job may hold of the card (leave --budget out to take all of it)"
                )


def _budgets(args: argparse.Namespace) -> list[int]:
    budget = getattr(args, "budget", None)
    if budget is None:
        return []
    return list(budget) if isinstance(budget, list) else [budget]


def _known_cards(args: argparse.Namespace) -> Iterable[tuple[str, int]]:
    """(name, memory in bytes) of each card the command's budget is for, where it is known."""
    from autotune.core.cards import lookup, resolve_card

    command = getattr(args, "command", None)
    gpu = getattr(args, "gpu", None)
    gpu_memory = getattr(args, "gpu_memory", None)
    if gpu:  # estimate: a name or several, by commas; fleet: the list card_list made
        for name in gpu.split(",") if isinstance(gpu, str) else gpu:
            try:
                card = resolve_card(name, gpu_memory)
            except ValueError as exc:
                if gpu_memory is not None:  # a name no family of the catalog matches: no architecture to take
                    raise CliError(f"--gpu {name!r} --gpu-memory {format_bytes(gpu_memory)}: {exc}") from None
                continue  # the estimate's own line names the known cards
            yield card.short_name, card.device_total_bytes
        return
    device_name = getattr(args, "device_name", None)
    if device_name and command in ("estimate", "suggest") and getattr(args, "device_kind", "cuda") == "cuda":
        try:
            card = lookup(device_name)
        except ValueError:
            return  # a card the catalog does not know: its memory is not known here
        yield card.nvml_name, card.device_total_bytes
        return
    if command == "probe":
        yield from _local_cuda_devices(str(args.device))


def _local_cuda_devices(device: str) -> Iterable[tuple[str, int]]:
    """The CUDA devices of this machine a probe's --device names (none without CUDA: the probe says so)."""
    spec = device.strip().lower()
    if not (spec.startswith("cuda") or spec in ("auto", "all")):
        return
    import torch

    if not torch.cuda.is_available():
        return
    if spec.startswith("cuda:"):
        try:
            indices = [int(spec.removeprefix("cuda:"))]
        except ValueError:
            return  # the probe's own line says what a device is
        if not 0 <= indices[0] < torch.cuda.device_count():
            return
    elif spec == "all":
        indices = list(range(torch.cuda.device_count()))
    else:
        indices = [torch.cuda.current_device()]
    for index in indices:
        properties = torch.cuda.get_device_properties(index)
        yield f"cuda:{index} ({properties.name})", int(properties.total_memory)


def _check_database_url(args: argparse.Namespace) -> None:
    """serve and db: a database URL SQLAlchemy can open (a dialect it has), before the server starts."""
    if getattr(args, "command", None) not in ("serve", "db"):
        return
    url = getattr(args, "database_url", None)
    flag = "--database-url"
    if url is None and os.environ.get("AUTOTUNE_DATABASE_URL"):
        url, flag = os.environ["AUTOTUNE_DATABASE_URL"], "AUTOTUNE_DATABASE_URL"
    if url is None:
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        make_url(url).get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CliError(
            f"{flag} {url!r} is not a database URL SQLAlchemy can open ({first}): e.g. sqlite:///store.db or "
            "postgresql+psycopg://USER@HOST/DB"
        ) from None
    except ImportError as exc:  # the dialect's driver is not installed
        raise CliError(f"{flag} {url!r}: its driver is not installed ({exc})") from None


def _check_verify_sizes(args: argparse.Namespace) -> None:
    if getattr(args, "command", None) != "verify":
        return
    target, micro = args.target_batch, args.micro_batch
    if target is not None and micro is not None and micro >= target:
        rule = "larger than" if micro > target else "equal to"
        raise CliError(
            f"--micro-batch {micro} is {rule} --target-batch {target}: verify compares one batch of the target "
            "with its accumulation over smaller micro-batches"
        )
