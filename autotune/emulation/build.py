"""Building the emulation's two libraries for one CUDA build of torch, once, into a cache folder.

``native/runtime.c`` (the CUDA runtime shim, preloaded) and ``native/driver.c`` (the stand-in
``libcuda.so.1``) are compiled with gcc against the CUDA headers that triton ships with the CUDA build
of torch (``site-packages/triton/backends/nvidia/include``: the nvidia wheels do not hold them whole),
so that ``cudaDeviceProp`` has the layout of the runtime torch loads. Every other entry point is a
generated stub that logs its name on first call and fails: for the runtime, every function the real
``libcudart`` exports; for the driver, every ``cu*`` symbol that torch's libraries linked against
``libcuda.so.1`` import (read with binutils' ``nm`` and ``readelf``). So nothing a trial calls reaches
the real runtime (which would fail without a driver, and say less) unlogged.

The result is cached under ``$XDG_CACHE_HOME/autotune/emulation/<key>`` (``~/.cache`` without it), the
key a hash of the sources, torch's version and CUDA version, and the headers' and the runtime's
identity; a build is made in a temporary folder beside it and renamed into place, so that processes
building at once never see half a build. Torch-free: the parent process builds before it starts the
child, whose environment must name the libraries before torch loads.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from autotune.core.errors import AutotuneError

__all__ = [
    "CudaTorch",
    "EmulationError",
    "EmulationLibraries",
    "build_libraries",
    "cache_root",
    "inspect_cuda_torch",
    "torch_versions",
]

NATIVE = Path(__file__).with_name("native")
SOURCES = ("card.h", "runtime.c", "driver.c")
# Bump when the build steps change what they produce from the same sources.
BUILD_FORMAT = 1
# The libraries' exports that are not the C API (registration of kernels, which works without a
# driver) and the ones that return a value that is no error code: never stubbed.
_NOT_STUBBED = ("__", "cudaCreateChannelDesc")
# Found by dlsym rather than linked: stubbed in the driver whatever torch's libraries import.
_DRIVER_LOOKUPS = ("cuGetProcAddress", "cuGetProcAddress_v2", "cuGetExportTable")


class EmulationError(AutotuneError):
    """The CUDA emulation cannot be built or run here; the message says why in one line."""


@dataclass(frozen=True)
class CudaTorch:
    """A CUDA build of torch in some Python environment, found without importing it (an import
    costs seconds, and would load the real CUDA runtime)."""

    python: str
    torch_dir: Path
    torch_version: str
    cuda_version: str
    include_dir: Path
    libcudart: Path

    @property
    def cudart_version(self) -> int:
        """CUDART_VERSION of the headers (13010 for CUDA 13.1)."""
        return _header_version(self.include_dir / "cuda_runtime_api.h", "CUDART_VERSION")


@dataclass(frozen=True)
class EmulationLibraries:
    """The built libraries: the runtime shim for LD_PRELOAD, and the folder holding libcuda.so.1
    for LD_LIBRARY_PATH."""

    runtime: Path
    driver_dir: Path
    folder: Path


_FIND = r"""
import importlib.util, json, sys
found = {}
for name in ("torch", "triton"):
    spec = importlib.util.find_spec(name)
    found[name] = None if spec is None or spec.origin is None else spec.origin
print(json.dumps(found))
"""


@functools.cache
def inspect_cuda_torch(python: str) -> CudaTorch:
    """The CUDA build of torch that ``python`` imports, and what the emulation needs of it.

    Raises:
        EmulationError: python does not run, has no torch, has a CPU build of torch, or lacks the
            CUDA headers or runtime; in one line that says what to install.
    """
    try:
        out = subprocess.run([python, "-c", _FIND], capture_output=True, text=True, timeout=60, check=True)
        origins = json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise EmulationError(f"cannot run {python} to find its torch: {_first_line(exc)}") from None
    if origins.get("torch") is None:
        raise EmulationError(f"{python} has no torch: install the CUDA build there (make .venv-cuda)")
    torch_dir = Path(origins["torch"]).parent
    torch_version, cuda_version = torch_versions(torch_dir)
    if cuda_version is None or torch_version is None:
        raise EmulationError(
            f"the torch of {python} is {torch_version or 'unknown'}, a CPU build: the emulation needs the CUDA "
            "build (make .venv-cuda)"
        )
    if origins.get("triton") is None:
        raise EmulationError(
            f"{python} has no triton, whose copy of the CUDA headers the emulation builds against "
            "(the CUDA build of torch installs it: reinstall torch there)"
        )
    include_dir = Path(origins["triton"]).parent / "backends" / "nvidia" / "include"
    for header in ("cuda_runtime_api.h", "cuda.h", "driver_types.h"):
        if not (include_dir / header).is_file():
            raise EmulationError(
                f"the CUDA headers are missing: {include_dir} has no {header} (the emulation builds against "
                "triton's copy: reinstall triton for this torch)"
            )
    site_packages = torch_dir.parent
    runtimes = sorted(site_packages.glob("nvidia/*/lib/libcudart.so.*")) + sorted(torch_dir.glob("lib/libcudart*.so*"))
    if not runtimes:
        raise EmulationError(f"no libcudart.so under {site_packages}/nvidia: reinstall the CUDA build of torch")
    found = CudaTorch(python, torch_dir, torch_version, cuda_version, include_dir, runtimes[0])
    header_major = found.cudart_version // 1000
    if header_major != int(cuda_version.split(".")[0]):
        raise EmulationError(
            f"the CUDA headers at {include_dir} are for CUDA {header_major}, torch {torch_version} for CUDA "
            f"{cuda_version}: cudaDeviceProp would not match the runtime's (reinstall triton for this torch)"
        )
    return found


def torch_versions(torch_dir: Path) -> tuple[str | None, str | None]:
    """(torch's version, the CUDA version it was built for, None for a CPU build) from the
    ``version.py`` of the torch package at torch_dir, without importing it."""
    try:
        text = (torch_dir / "version.py").read_text()
    except OSError:
        return None, None
    return _assigned(text, "__version__"), _assigned(text, "cuda")


def _assigned(text: str, name: str) -> str | None:
    match = re.search(rf"^{name}\s*(?::[^=]*)?=\s*'([^']*)'", text, re.MULTILINE)
    return match.group(1) if match else None


def _header_version(header: Path, macro: str) -> int:
    match = re.search(rf"#define\s+{macro}\s+(\d+)", header.read_text(errors="replace"))
    if match is None:
        raise EmulationError(f"{header} does not define {macro}: not a CUDA header the emulation knows")
    return int(match.group(1))


def cache_root() -> Path:
    """Where built libraries are kept: ``$XDG_CACHE_HOME/autotune/emulation`` (``~/.cache`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autotune" / "emulation"


def _tool(name: str, package: str) -> str:
    path = shutil.which(os.environ.get("CC", "gcc") if name == "gcc" else name)
    if path is None:
        raise EmulationError(
            f"the CUDA emulation builds its libraries with {name}, which is not on PATH (install {package}, "
            f"for example apt-get install {package})"
        )
    return path


def _key(torch: CudaTorch, gcc: str) -> str:
    digest = hashlib.sha256()
    digest.update(f"format {BUILD_FORMAT}\n{torch.torch_version}\n{torch.cuda_version}\n{gcc}\n".encode())
    for name in SOURCES:
        digest.update((NATIVE / name).read_bytes())
    digest.update((torch.include_dir / "cuda_runtime_api.h").read_bytes())
    stat = torch.libcudart.stat()
    digest.update(f"{torch.libcudart}\n{stat.st_size}\n{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]


def build_libraries(torch: CudaTorch) -> EmulationLibraries:
    """The emulation's libraries for torch, built now unless the cache has them.

    Raises:
        EmulationError: gcc or binutils are missing, or a compilation failed (its first error line).
    """
    gcc = _tool("gcc", "gcc")
    folder = cache_root() / _key(torch, gcc)
    libraries = EmulationLibraries(folder / "libautotune_cudart.so", folder / "driver", folder)
    if (folder / "manifest.json").is_file():
        return libraries
    nm = _tool("nm", "binutils")
    readelf = _tool("readelf", "binutils")
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=folder.parent))
    try:
        manifest = _build(torch, gcc, nm, readelf, work)
        (work / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        try:
            work.rename(folder)
        except OSError:  # another process finished the same build first: theirs is as good
            if not (folder / "manifest.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return libraries


def _build(torch: CudaTorch, gcc: str, nm: str, readelf: str, work: Path) -> dict[str, object]:
    include = ["-I", str(torch.include_dir), "-I", str(NATIVE)]
    flags = ["-O2", "-fPIC", "-Wall", "-Werror", "-Wno-unused-function", "-Wno-format-truncation"]
    not_supported = _header_version_enum(torch.include_dir / "cuda.h", "CUDA_ERROR_NOT_SUPPORTED")

    runtime_object = work / "runtime.o"
    _run([gcc, "-c", *flags, *include, str(NATIVE / "runtime.c"), "-o", str(runtime_object)], "runtime.c")
    emulated = _defined(nm, runtime_object)
    exported = [
        name
        for name in _dynamic_symbols(nm, torch.libcudart, defined=True)
        if name.startswith("cuda") and not name.startswith(_NOT_STUBBED) and name not in emulated
    ]
    runtime_stubs = _write_stubs(work / "runtime_stubs.c", exported, "cudaErrorNotSupported", "<driver_types.h>")
    stubs_object = work / "runtime_stubs.o"
    _run([gcc, "-c", *flags, *include, str(runtime_stubs), "-o", str(stubs_object)], "the runtime's stubs")
    runtime = work / "libautotune_cudart.so"
    _run([gcc, "-shared", "-o", str(runtime), str(runtime_object), str(stubs_object), "-lpthread"], "the runtime")

    driver_object = work / "driver.o"
    _run([gcc, "-c", *flags, *include, str(NATIVE / "driver.c"), "-o", str(driver_object)], "driver.c")
    driver_emulated = _defined(nm, driver_object)
    imported = sorted(
        {name for library in _linking_libcuda(readelf, torch.torch_dir) for name in _imports(nm, library)}
        | set(_DRIVER_LOOKUPS)
    )
    driver_stubs = _write_stubs(
        work / "driver_stubs.c", [name for name in imported if name not in driver_emulated], str(not_supported), None
    )
    driver_stubs_object = work / "driver_stubs.o"
    _run([gcc, "-c", *flags, *include, str(driver_stubs), "-o", str(driver_stubs_object)], "the driver's stubs")
    (work / "driver").mkdir()
    _run(
        [
            gcc,
            "-shared",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            str(work / "driver" / "libcuda.so.1"),
            str(driver_object),
            str(driver_stubs_object),
            "-lpthread",
        ],
        "the driver",
    )
    for leftover in work.glob("*.o"):
        leftover.unlink()
    return {
        "torch": torch.torch_version,
        "cuda": torch.cuda_version,
        "cudart_version": torch.cudart_version,
        "libcudart": str(torch.libcudart),
        "runtime_emulated": sorted(emulated),
        "runtime_stubs": len(exported),
        "driver_emulated": sorted(driver_emulated),
        "driver_stubs": len(imported) - len(driver_emulated & set(imported)),
    }


def _header_version_enum(header: Path, name: str) -> int:
    match = re.search(rf"\b{name}\s*=\s*(\d+)", header.read_text(errors="replace"))
    if match is None:
        raise EmulationError(f"{header} does not define {name}: not a CUDA header the emulation knows")
    return int(match.group(1))


def _write_stubs(path: Path, names: list[str], error: str, include: str | None) -> Path:
    lines = [
        "/* Generated by autotune/emulation/build.py: entry points the emulation does not cover. */",
        '#include "card.h"',
    ]
    if include:
        lines.append(f"#include {include}")
    lines.append(
        "#define AT_STUB(name) int name(void); "
        f"int name(void) {{ static int logged; at_not_emulated_once(#name, &logged); return {error}; }}"
    )
    lines += [f"AT_STUB({name})" for name in names]
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(command: list[str], what: str) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        raise EmulationError(f"building the CUDA emulation ({what}) failed: {_first_line(exc)}") from None
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "error" in line.lower()] or done.stderr.splitlines()
        raise EmulationError(
            f"building the CUDA emulation ({what}) failed: {(errors or ['exit status ' + str(done.returncode)])[0]}"
        )
    return done.stdout


def _defined(nm: str, object_file: Path) -> set[str]:
    out = _run([nm, "--defined-only", "-g", str(object_file)], f"reading {object_file.name}")
    return {parts[2] for parts in (line.split() for line in out.splitlines()) if len(parts) == 3 and parts[1] == "T"}


def _dynamic_symbols(nm: str, library: Path, *, defined: bool) -> list[str]:
    option = "--defined-only" if defined else "--undefined-only"
    out = _run([nm, "-D", option, str(library)], f"reading {library.name}")
    names = []
    for line in out.splitlines():
        parts = line.split()
        if defined and (len(parts) != 3 or parts[1] != "T"):
            continue
        if not defined and (len(parts) != 2 or parts[0] != "U"):
            continue
        names.append(parts[-1].split("@")[0])
    return sorted(set(names))


def _imports(nm: str, library: Path) -> list[str]:
    return [name for name in _dynamic_symbols(nm, library, defined=False) if re.match(r"cu[A-Z]", name)]


def _linking_libcuda(readelf: str, torch_dir: Path) -> list[Path]:
    """torch's libraries that name libcuda.so.1 as a dependency (its NVRTC stub)."""
    found = []
    for library in sorted((torch_dir / "lib").glob("*.so*")):
        out = _run([readelf, "-d", str(library)], f"reading {library.name}")
        if "[libcuda.so.1]" in out:
            found.append(library)
    return found


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


if __name__ == "__main__":  # python -m autotune.emulation.build PYTHON: build for that Python's torch
    print(build_libraries(inspect_cuda_torch(sys.argv[1] if len(sys.argv) > 1 else sys.executable)).folder)
