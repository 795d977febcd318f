"""The CPU decode fast path: one fused C++ call per mHC site for a few tokens without autograd.

``CPU_DECODE_OPS`` is what the dispatch table runs on CPU when no gradient is wanted: for CPU float32 / bfloat16 /
float16 streams of at most ``MAX_TOKENS`` tokens (``takes_fast_path``) it calls the kernels of ``cpu_decode.cpp``
instead of the eager torch kernels (``torch_backend``, which run every other call): ``coeffs_pre`` (``mix`` by dot
products, or one GEMM past a few tokens, the residual map, the ``pre`` collapse), ``post_res`` and ``head``, each
one call with ``at::parallel_for`` over the tokens, giving the numbers of ``hf_mhc.mhc_reference`` to float32
rounding. Greedy decoding runs each site on one token per sequence, where the eager kernels' Python and operator
dispatch (Sinkhorn alone is ``2·iters - 1`` normalisations of three ops each) would cost more than the arithmetic;
the kernels themselves call no ATen operator for one token beyond allocating their outputs, since every operator
call runs code that the sublayer's weight reads have pushed out of the CPU's caches.

Under ``torch.compile`` (``generate`` with a static cache and a compile config) the same kernels run as the custom
ops ``hf_mhc::cpu_decode_coeffs_pre`` / ``_post_res`` / ``_head`` (shapes for tracing, the C++ call at run time).
These read the switch and the build when they run (a graph traced once serves every model and both settings) and run
the eager torch kernels when the fast path is off. In eager mode the kernels are called directly, without the
dispatcher.

The source is JIT-built once with ``torch.utils.cpp_extension`` (a C++ compiler and ninja, the ``ninja`` package of
the dependencies) to ``$TORCH_EXTENSIONS_DIR/NAME/NAME.so`` (default ``~/.cache/torch_extensions``), ``NAME`` hashing
the source, the flags and the torch and Python versions. Loading never hangs:

- A built library is imported directly (as torch's loader imports it), with no lock and no compiler: torch's
  ``cpp_extension.load`` takes the file lock ``NAME/lock`` on every load and waits for it forever, so a process
  killed while holding it would block every later one.
- Only a build takes a lock, ``NAME/build.lock``, held with ``flock``, which the kernel releases when its holder
  exits, however it is killed. A process that finds it held waits (one line on stderr) for at most ``LOCK_WAIT_S``,
  then loads the library the holder built (or builds it, if the holder died first); past that it warns once, naming
  the lock file and how to remove it, and the eager torch kernels run.
- The build runs in a private folder ``NAME/build-PID@HOST-*`` (torch's own lock is taken there, where no other
  process looks) and the library is moved to ``NAME/NAME.so`` by one rename, so that path holds a complete library or
  nothing. Two builds at once (the lock file deleted meanwhile) each rename a complete library there and both work.
  Folders of builds killed on this host are removed by the next build.

A failed build warns once with its reason and the eager torch kernels run instead. ``HF_MHC_CPU_DECODE=0`` turns the
fast path off.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from hf_mhc.mhc_reference import DEFAULT_RESIDUAL_MAP, POST_MAGNITUDE, ResidualMap

from ..processes import owner_is_dead, owner_tag
from .coeffs_pre_op import coeffs_pre_forward
from .common import MAP_CODES
from .torch_backend import TORCH_KERNELS, TORCH_OPS

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
MAX_TOKENS = 64  # tokens (all leading dims) up to which the fast path runs
FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # not DTensor or other subclasses, whose data the C++ cannot read
ENV_SWITCH = "HF_MHC_CPU_DECODE"
CFLAGS = ["-O3"]
BUILD_LOCK = "build.lock"  # beside the library: held (flock) by the one process that builds it
PRIVATE_BUILD_PREFIX = "build-"  # a build's own folder beside the library: build-PID@HOST-RANDOM
LOCK_WAIT_S = 180.0  # the longest wait for another process's build (one takes 1 to 2 minutes on 2 busy cores)
LOCK_POLL_S = 0.1


def enabled() -> bool:
    """Whether the fast path may run: ``HF_MHC_CPU_DECODE`` is not ``0`` (read at each call)."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def extension_name() -> str:
    """``hf_mhc_cpu_decode_<hash>``: the hash covers the source, the flags and the torch and Python versions."""
    key = "\n".join([SOURCE.read_text(), " ".join(CFLAGS), torch.__version__, sys.version.split()[0]])
    return f"hf_mhc_cpu_decode_{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def build_directory(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / name


@contextlib.contextmanager
def _ninja_on_path():
    """torch runs ``ninja`` from ``PATH``; the ``ninja`` package's binary is there only in an activated venv."""
    try:
        import ninja
    except ImportError:
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR
    try:
        yield
    finally:
        os.environ["PATH"] = path


def library_path(name: str) -> Path:
    """Where the built library of ``name`` lies: ``$TORCH_EXTENSIONS_DIR/NAME/NAME.so``."""
    return build_directory(name) / f"{name}.so"


def import_library(name: str, path: Path) -> ModuleType:
    """The module ``name`` of the built library ``path``, imported as torch's loader does, with no lock."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class LockTimeout(TimeoutError):
    """Another process held the build lock ``path`` for ``LOCK_WAIT_S``."""

    def __init__(self, path: Path):
        super().__init__(f"{path} held for {LOCK_WAIT_S:g} s")
        self.path = path


@contextlib.contextmanager
def build_lock(path: Path):
    """Hold ``path`` exclusively for the block, waiting at most ``LOCK_WAIT_S`` (then :class:`LockTimeout`).

    An ``flock``, which the kernel releases when its holder exits, however it is killed: a lock file left behind is
    never held. Where the file system has no locks, the block runs unlocked (a build is safe without it, see
    :func:`compile_library`)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline, waiting = time.monotonic() + LOCK_WAIT_S, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LockTimeout(path) from None
                if not waiting:
                    print(f"waiting for another process's build of hf-mhc's CPU decode kernels (lock {path}) ...",
                          file=sys.stderr, flush=True)
                    waiting = True
                time.sleep(min(LOCK_POLL_S, left))
            except OSError:  # no locks on this file system
                break
        yield
    finally:
        os.close(fd)  # releases the lock


def compile_library(name: str, library: Path) -> ModuleType:
    """Compile the kernels in a private folder beside ``library``, move the library into place with one rename (over
    whatever another build put there meanwhile: both are complete) and import it."""
    from torch.utils import cpp_extension

    _remove_abandoned_builds(library.parent)
    owner = owner_tag()
    private = Path(tempfile.mkdtemp(prefix=f"{PRIVATE_BUILD_PREFIX}{owner}-", dir=library.parent))
    try:
        with _ninja_on_path():
            module = cpp_extension.load(name, [str(SOURCE)], extra_cflags=CFLAGS, build_directory=str(private),
                                        verbose=False)
        built = Path(module.__file__)
        if built.name != library.name:  # a second build in one process, which torch names NAME_v1: use it as it is
            return module
        os.replace(built, library)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return import_library(name, library)


def _remove_abandoned_builds(directory: Path) -> None:
    """Delete the private folders of builds on this host whose process no longer exists."""
    for entry in directory.glob(f"{PRIVATE_BUILD_PREFIX}*@*-*"):
        if owner_is_dead(entry.name[len(PRIVATE_BUILD_PREFIX):].rsplit("-", 1)[0]):  # build-PID@HOST-XXXXXXXX
            shutil.rmtree(entry, ignore_errors=True)


def build() -> ModuleType:
    """Import the built kernels, building them first if no process has (once per source and torch version)."""
    name = extension_name()
    library = library_path(name)
    if library.exists():  # built: no lock, no compiler
        return import_library(name, library)
    library.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(library.parent / BUILD_LOCK):
        if library.exists():  # built by the process this one waited for
            return import_library(name, library)
        print("building hf-mhc's CPU decode kernels (once) ...", file=sys.stderr, flush=True)
        return compile_library(name, library)


@functools.cache
def extension() -> ModuleType | None:
    """The built C++ extension (the kernels of ``cpu_decode.cpp``), or ``None`` after warning once why the build
    failed or that another process's build held the lock past ``LOCK_WAIT_S`` (the eager torch kernels then run)."""
    try:
        return build()
    except LockTimeout as error:
        warnings.warn(f"hf-mhc's CPU decode kernels: another process held the build lock {error.path} for "
                      f"{LOCK_WAIT_S:g} s; decoding on CPU runs the eager torch kernels. If no hf-mhc build is "
                      f"running, remove the lock: rm {error.path}", RuntimeWarning, stacklevel=2)
        return None
    except Exception as error:  # a missing compiler or ninja, a failed compile: every cause says why in its message
        reason = " ".join(str(error).split())[:500] or type(error).__name__
        warnings.warn(f"hf-mhc's CPU decode kernels failed to build ({reason}); decoding on CPU runs the eager torch "
                      f"kernels, which are slower for a few tokens. Set {ENV_SWITCH}=0 to skip the build.",
                      RuntimeWarning, stacklevel=2)
        return None


def available() -> bool:
    """Whether the fast path is switched on and its kernels built."""
    return enabled() and extension() is not None


def takes_fast_path(streams: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether a call on ``streams [..., n, C]`` (and the op's other ``tensors``) takes the fast path: CPU float32 /
    bfloat16 / float16 tensors with at most ``MAX_TOKENS`` tokens, no gradient wanted (grad mode off, or no input
    requires grad), plain tensors (no ``DTensor``), the switch on and the kernels built. Under ``torch.compile`` the
    traced tensors stand for plain ones, and the custom ops read the switch and the build when they run."""
    if not streams.is_cpu or streams.dtype not in FAST_DTYPES or not 0 < math.prod(streams.shape[:-2]) <= MAX_TOKENS:
        return False
    grad = torch.is_grad_enabled()
    compiling = torch.compiler.is_compiling()
    for tensor in (streams, *tensors):
        if (grad and tensor.requires_grad) or not (compiling or type(tensor) in PLAIN_TENSORS):
            return False
    return compiling or available()


def _token_shape(streams: torch.Tensor, *last: int) -> list[int]:
    """The streams' leading (token) dims followed by ``last``."""
    return [*streams.shape[:-2], *last]


@torch.library.custom_op("hf_mhc::cpu_decode_coeffs_pre", mutates_args=())
def _coeffs_pre_op(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                   eps: float, norm_eps: float, map_code: int, post_magnitude: float,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if available():
        return tuple(extension().coeffs_pre(streams, fn, base, scale, iters, eps, norm_eps, map_code, post_magnitude))
    residual_map = next(name for name, code in MAP_CODES.items() if code == map_code)
    y, post, comb, *_ = coeffs_pre_forward(TORCH_KERNELS, streams, fn, base, scale, iters, eps, norm_eps, False,
                                           residual_map, post_magnitude)
    return y, post, comb


@_coeffs_pre_op.register_fake
def _(streams, fn, base, scale, iters, eps, norm_eps, map_code, post_magnitude):
    n, hidden = streams.shape[-2:]
    comb_size = [0] if map_code == MAP_CODES["identity"] else _token_shape(streams, n, n)
    return (streams.new_empty(_token_shape(streams, hidden)),
            streams.new_empty(_token_shape(streams, n), dtype=torch.float32),
            streams.new_empty(comb_size, dtype=torch.float32))


@torch.library.custom_op("hf_mhc::cpu_decode_post_res", mutates_args=())
def _post_res_op(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 identity: bool) -> torch.Tensor:
    if available():
        return extension().post_res(streams, y, post, comb, identity)
    return TORCH_KERNELS.post_res_forward(streams, y, post, comb, identity)


@_post_res_op.register_fake
def _(streams, y, post, comb, identity):
    return torch.empty_like(streams, memory_format=torch.contiguous_format)


@torch.library.custom_op("hf_mhc::cpu_decode_head", mutates_args=())
def _head_op(streams: torch.Tensor, hc_fn: torch.Tensor, hc_base: torch.Tensor, hc_scale: torch.Tensor, eps: float,
             norm_eps: float) -> torch.Tensor:
    if available():
        return extension().head(streams, hc_fn, hc_base, hc_scale, eps, norm_eps)
    return coeffs_pre_forward(TORCH_KERNELS, streams, hc_fn, hc_base, hc_scale, 1, eps, norm_eps, True,
                              DEFAULT_RESIDUAL_MAP, POST_MAGNITUDE)[0]


@_head_op.register_fake
def _(streams, hc_fn, hc_base, hc_scale, eps, norm_eps):
    return streams.new_empty(_token_shape(streams, streams.shape[-1]))


def _run(kernel: str, *args):
    """Call the C++ ``kernel`` in the tensors' own dtypes, like the torch path (which turns autocast off for the HC
    math): under CPU autocast (e.g. ``Trainer.evaluate`` with bf16 on CPU) the aten ops it calls would otherwise
    return bfloat16 where it expects float32. The autocast state is checked first: entering a context costs more
    than the kernel's arithmetic for one token."""
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return getattr(extension(), kernel)(*args)
    return getattr(extension(), kernel)(*args)


def coeffs_pre(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, post, comb)`` of ``cpu_decode.cpp``'s ``coeffs_pre`` (its arguments); the custom op under compile."""
    return _coeffs_pre_op(*args) if torch.compiler.is_compiling() else _run("coeffs_pre", *args)


def post_res(*args) -> torch.Tensor:
    """The new streams of ``cpu_decode.cpp``'s ``post_res`` (its arguments); the custom op under compile."""
    return _post_res_op(*args) if torch.compiler.is_compiling() else _run("post_res", *args)


def head(*args) -> torch.Tensor:
    """``y`` of ``cpu_decode.cpp``'s ``head`` (its arguments); the custom op under compile."""
    return _head_op(*args) if torch.compiler.is_compiling() else _run("head", *args)


class CPUDecodeOps:
    """The torch backend's ops, with ``mhc_coeffs_pre``, ``mhc_post_res`` and ``mhc_head`` as one C++ call each where
    ``takes_fast_path`` holds (the same signatures as ``MHCOps``)."""

    name = "cpu_decode"
    sinkhorn = TORCH_OPS.sinkhorn
    mhc_coeffs = TORCH_OPS.mhc_coeffs
    mhc_pre = TORCH_OPS.mhc_pre

    def __repr__(self) -> str:
        return "CPUDecodeOps()"

    def mhc_coeffs_pre(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                       sinkhorn_iters: int, eps: float, norm_eps: float,
                       residual_map: ResidualMap = DEFAULT_RESIDUAL_MAP, post_magnitude: float = POST_MAGNITUDE,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if not takes_fast_path(streams, fn, base, scale):
            return TORCH_OPS.mhc_coeffs_pre(streams, fn, base, scale, sinkhorn_iters=sinkhorn_iters, eps=eps,
                                            norm_eps=norm_eps, residual_map=residual_map, post_magnitude=post_magnitude)
        y, post, comb = coeffs_pre(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, MAP_CODES[residual_map],
                                   float(post_magnitude))
        return y, post, None if residual_map == "identity" else comb

    def mhc_post_res(self, streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor,
                     comb: torch.Tensor | None) -> torch.Tensor:
        identity = comb is None
        comb = post.new_empty(0, dtype=torch.float32) if identity else comb
        if y.dtype != streams.dtype or not takes_fast_path(streams, y, post, comb):
            return TORCH_OPS.post_res_op(streams, y, post, comb, identity)
        return post_res(streams, y, post, comb, identity)

    def mhc_head(self, streams: torch.Tensor, hc_fn: torch.Tensor, hc_base: torch.Tensor, hc_scale: torch.Tensor, *,
                 eps: float, norm_eps: float) -> torch.Tensor:
        if not takes_fast_path(streams, hc_fn, hc_base, hc_scale):
            return TORCH_OPS.mhc_head(streams, hc_fn, hc_base, hc_scale, eps=eps, norm_eps=norm_eps)
        return head(streams, hc_fn, hc_base, hc_scale, eps, norm_eps)


CPU_DECODE_OPS = CPUDecodeOps()
