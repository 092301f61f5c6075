"""Small C kernels for the CPU decode path: built on first use with the system C compiler, loaded with ctypes.

A decode step of a small model on a CPU is hundreds of tiny torch kernels; what costs is their
dispatch and the passes over memory between them, not the arithmetic. A few fused C loops (each
beside its torch reference, with tests holding them together) remove both. They need no torch
headers: a plain ``cc -O3 -march=native`` builds one in well under a second (flags: :data:`FLAGS`).

Built libraries are cached under ``$DELTASERVE_KERNEL_CACHE`` (default ``~/.cache/deltaserve/kernels``),
named by a hash of the source, the flags, the compiler's version and the CPU; a build writes a temporary file
and renames it, so concurrent replicas never load a half-written library. Without a working compiler
(or with ``DELTASERVE_NATIVE_KERNELS=0``) :func:`load` returns None once, with a warning, and callers use
their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

# Compile with fast math (vectorised exp/tanh from glibc's libmvec, reassociated sums; the kernels have no
# NaN or infinity checks for it to drop), but link without it: a -ffast-math link adds crtfastmath.o,
# which would turn on flush-to-zero for the whole process when the library loads.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c11")
LINK = ("-shared",)
LIBS = ("-lmvec", "-lm")
_cache: dict[Path, ctypes.CDLL | None] = {}
_lock = threading.Lock()


def enabled() -> bool:
    """False when ``DELTASERVE_NATIVE_KERNELS`` is 0/false/no/off (the torch paths run instead). Read when a
    library first loads: a :class:`Library` that has loaded keeps its kernels for the process's life (set the
    variable before the process starts; ``model.layers.fused.NATIVE`` switches the fast paths at run time)."""
    return os.environ.get("DELTASERVE_NATIVE_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    return Path(os.environ.get("DELTASERVE_KERNEL_CACHE") or Path.home() / ".cache" / "deltaserve" / "kernels")


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu() -> str:
    """The CPU's model and feature flags: ``-march=native`` code built on one CPU may not run on another, so a
    cache directory shared between machines keeps one library per CPU kind."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return platform.machine() + "\n" + "\n".join(keep)


def build(source: Path) -> Path:
    """Compile ``source`` into the cache (if not there yet) → the library's path. Raises RuntimeError
    (with the compiler's output) when the build fails or no compiler exists."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc) for the native CPU kernels")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    digest = hashlib.sha256("\0".join([source.read_text(), *FLAGS, *LINK, *LIBS, *version, _cpu()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{source.stem}-", suffix=".so")
    os.close(fd)
    obj = tmp[:-3] + ".o"
    try:
        for cmd in ([cc, *FLAGS, "-c", "-o", obj, str(source)], [cc, *LINK, "-o", tmp, obj, *LIBS]):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"building {source.name} failed: {' '.join(cmd)}\n{proc.stderr.strip()}")
        os.replace(tmp, out)
    finally:
        for leftover in (tmp, obj):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return out


def load(source: Path) -> ctypes.CDLL | None:
    """The library built from ``source`` (cached per process), or None when native kernels are off or
    cannot be built (warned once per source)."""
    if not enabled():
        return None
    with _lock:
        if source not in _cache:
            try:
                _cache[source] = ctypes.CDLL(str(build(source)))
            except (RuntimeError, OSError) as e:
                log.warning("native CPU kernel %s unavailable, using the torch path: %s", source.name, e)
                _cache[source] = None
        return _cache[source]


I64, I32, F32, PTR = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


class Library:
    """The C functions of one source, typed on first use. Each returns 0, or a negative code that
    ``errors`` names; :meth:`call` turns a nonzero code into ValueError."""

    def __init__(self, source: Path, signatures: dict[str, list], errors: dict[int, str]) -> None:
        self.source, self.signatures, self.errors = source, signatures, errors
        self._typed: ctypes.CDLL | None = None

    def _lib(self) -> ctypes.CDLL | None:
        if self._typed is not None:  # loaded and typed: the decode step's hot path stops here
            return self._typed
        lib = load(self.source)
        if lib is not None:
            for name, argtypes in self.signatures.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = ctypes.c_int, argtypes
            self._typed = lib
        return lib

    def available(self) -> bool:
        """True when the library is built and loaded (False: native kernels off, or no compiler)."""
        return self._lib() is not None

    def call(self, name: str, *args) -> None:
        """Call ``name``; RuntimeError when the library is unavailable, ValueError naming a rejected argument."""
        lib = self._lib()
        if lib is None:
            raise RuntimeError(f"the native kernel {self.source.name} is unavailable (see kernels.native)")
        rc = getattr(lib, name)(*args)
        if rc != 0:
            raise ValueError(f"{name} rejected its arguments: {self.errors.get(rc, rc)}")


def ptr(t) -> ctypes.c_void_p:
    """Address of a tensor's first element (the caller checked dtype, device and layout)."""
    return ctypes.c_void_p(t.data_ptr())
