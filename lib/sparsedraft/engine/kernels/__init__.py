"""Optional C++ kernels, built on first use; the pure-torch path stays the default and the oracle.

``attend`` is decode / verification attention over a KV cache that reads each cached key and value
once for a whole GQA group and all T new tokens (see ``decode_attention.cpp`` for why torch's SDPA
does not); ``linear`` multiplies the few rows of such a step by a weight matrix read once
(``few_rows_linear.cpp``); ``rms_norm`` and ``rope`` are the row-wise operations between them, one
call each instead of several torch ops (``step_pointwise.cpp``); ``layer_head`` and ``layer_tail`` run
a layer's calls before and after its attention as two (``step_block.cpp``). All give each row the same bits
whatever the step's length, which is what keeps speculative greedy output equal to plain greedy output
in bf16. It is built with ``torch.utils.cpp_extension.load`` the first time :func:`available` is
asked, into ``$XDG_CACHE_HOME/sparsedraft/kernels/<hash>`` (``~/.cache`` by default), the hash
covering the sources, the compiler flags, torch, Python, the compiler and this CPU (``-march=native``
code must not run on another CPU that shares the home folder). A machine without a compiler or ninja
gets one warning naming the reason and ``available() == False``; callers then keep the SDPA path. A
``-march=native`` build that fails where the portable one builds is one warning too, naming the reason.
``SPARSEDRAFT_KERNELS=0`` turns the kernels off without a warning.

Which vector path runs is chosen here, at run time, from what this CPU reports: by default
(``auto``) the build targets it with ``-march=native`` (AVX-512, AVX2+FMA, NEON ... whatever it
has). ``SPARSEDRAFT_KERNEL_ISA`` (or :func:`use_isa`) forces one of :data:`ISA_FLAGS` instead:
``avx512``, ``avx512bf16`` (AVX-512 with bf16 and VNNI int8 dot products, no AMX), ``avx2`` (AVX2+FMA) or
``portable`` (no vector extension beyond the architecture's baseline), so a test or a bench can run
the path another machine would, and a path the CPU lacks is one clear error rather than an illegal
instruction. Where the build targets AMX-BF16 (``auto`` on a CPU that has it) and Linux grants the tile
state, bf16 attention (head_dim a multiple of 32) and the bf16 few-row linear (K a multiple of 32) run on
AMX tiles (:func:`use_tiles` turns them off for an A/B); elsewhere a build with AVX512-BF16 runs the bf16
linear, and bf16 attention the tile path's steps, on its dot products (:func:`on_dots`; the same switch).
Every path keeps the same contract (each row's bits independent of the step's length); bits differ between
paths, since FMA rounds once and the tiles and dot products round the softmax weights to bf16.

:func:`supports` is the one question a caller asks (inputs, mask and build); :func:`attend_reference`
is the oracle the tests hold it to.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import statistics
import sys
import time
import warnings
import weakref
from pathlib import Path
from types import ModuleType
from typing import Iterator

import torch

from ...errors import SparsedraftError, require
from ..cpuinfo import cpu_flags, read_cpuinfo

SOURCES = tuple(Path(__file__).with_name(name) for name in
                ("decode_attention.cpp", "few_rows_linear.cpp", "rounded_rows_linear.cpp", "step_pointwise.cpp",
                 "step_block.cpp", "step_stack.cpp", "bindings.cpp"))
# compiled into the sources, so part of the build key
HEADERS = tuple(Path(__file__).with_name(name) for name in ("kernels.h", "prefetch.h", "tiles.h"))
MAX_LINEAR_ROWS = 16  # rows the few-row linear kernels take (decode and verification steps): kernels.h kLinearRows
# Steps with at most this many query rows per KV head (a decode's group of g heads, a 2-token step) compute
# with keys as lanes instead: row lanes would be mostly padding (3 of 16 for SmolLM2's decode). Where the
# two cross: `python -m sparsedraft.bench.kernel_timing` times both (docs/engine.md).
KEY_ROWS = 6
# Tried in order: the first that builds is kept. -march=native with 512-bit vectors where the compiler
# takes it, then the portable build. -ffp-contract=off keeps every multiply-add explicit (exactness).
FLAG_SETS = (
    ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fopenmp"],
    ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
    ["-O3", "-ffp-contract=off", "-fopenmp"],
)
# Forced paths (SPARSEDRAFT_KERNEL_ISA / use_isa): the flags of each, and the CPU flags it needs.
_COMMON = ["-O3", "-ffp-contract=off", "-fopenmp"]
_AVX512 = [*_COMMON, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
           "-mprefer-vector-width=512"]
_AVX512_NEEDS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"}
ISA_FLAGS = {
    "avx512": _AVX512,
    # bf16 and int8 (VNNI) dot products, no AMX: what such a CPU's build runs (every CPU with AVX512-BF16 has VNNI)
    "avx512bf16": [*_AVX512, "-mavx512bf16", "-mavx512vnni"],
    "avx2": [*_COMMON, "-mavx2", "-mfma", "-mf16c"],
    "portable": list(_COMMON),
}
ISA_NEEDS = {"avx512": _AVX512_NEEDS, "avx512bf16": _AVX512_NEEDS | {"avx512_bf16", "avx512_vnni"},
             "avx2": {"avx2", "fma"}, "portable": set()}
ISA_CHOICES = ("auto", *ISA_FLAGS)
DTYPES = (torch.float32, torch.bfloat16)
# Verification-sized steps only: beyond ~32 new tokens (a prefill chunk) SDPA's GEMMs catch up in bf16
# (8K context, 2 cores: kernel 168 vs SDPA 169 ms at T=32, 337 vs 226 ms at T=64) and it skips masked blocks.
MAX_TOKENS = 32

_module: ModuleType | None = None
_failure: str | None = None
_flags: list[str] | None = None  # the FLAG_SETS entry the module was built with
_last_mask: tuple[weakref.ref, int, bool] | None = None
_isa: str | None = None  # use_isa's choice; None: the environment's (SPARSEDRAFT_KERNEL_ISA, default auto)
_tiles = True  # use_tiles's choice
PAIRS_ENV = "SPARSEDRAFT_PAIR_ROWS"  # 1 / 0: AVX2 few-row linear steps past pair_from() rows paired / not
_pairs: bool | None = None  # the layout those steps run (use_pairs); None until the module loads
_pairs_chosen: tuple[bool, str] | None = None  # what loading chose, and how: the environment or a timing


def enabled() -> bool:
    """False when the environment turns the kernels off (``SPARSEDRAFT_KERNELS=0``)."""
    return os.environ.get("SPARSEDRAFT_KERNELS", "1").strip() != "0"


def requested_isa() -> str:
    """The vector path asked for: :func:`use_isa`'s choice, else ``SPARSEDRAFT_KERNEL_ISA``, else ``auto``."""
    isa = _isa or os.environ.get("SPARSEDRAFT_KERNEL_ISA", "auto").strip().lower() or "auto"
    require(isa in ISA_CHOICES, f"SPARSEDRAFT_KERNEL_ISA={isa!r} is not one of {ISA_CHOICES}")
    return isa


def check_isa(isa: str) -> None:
    """One error when ``isa`` is unknown or this CPU lacks what it needs (before any build)."""
    require(isa in ISA_CHOICES, f"kernel ISA {isa!r} is not one of {ISA_CHOICES}")
    if isa != "auto":
        flags = cpu_flags()
        runnable = tuple(n for n in ISA_CHOICES if n == "auto" or ISA_NEEDS[n] <= flags)
        missing = ISA_NEEDS[isa] - flags
        require(not missing, f"this CPU cannot run the {isa} kernel path (it lacks {', '.join(sorted(missing))}); "
                             f"use one of {runnable}")


def use_isa(isa: str | None) -> str:
    """Run the kernels on vector path ``isa`` (one of :data:`ISA_CHOICES`; None: back to the environment's)
    from the next call on; checked against this CPU first. Returns the path asked for before, so a caller
    can put it back."""
    global _isa, _module, _failure, _flags, _pairs, _pairs_chosen
    before = requested_isa()
    if isa is not None:
        check_isa(isa)
    if isa != _isa:  # another build: its linear layout is chosen again when it loads
        _isa, _module, _failure, _flags, _pairs, _pairs_chosen = isa, None, None, None, None, None
    return before


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sparsedraft" / "kernels"


def _cpu_fingerprint() -> str:
    lines = read_cpuinfo().splitlines()
    if not lines:
        return platform.processor()
    keep = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in keep}))


def build_key(flags: list[str], files: tuple[Path, ...] = (*SOURCES, *HEADERS)) -> str:
    """Hash of everything that makes a built module reusable; names its folder and module."""
    parts = [*(source.read_bytes() for source in files), " ".join(flags).encode(),
             torch.__version__.encode(), sys.version.encode(), platform.machine().encode(),
             os.environ.get("CXX", "c++").encode(), _cpu_fingerprint().encode()]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:16]


def _build(flags: list[str], sources: tuple[Path, ...] = SOURCES, headers: tuple[Path, ...] = HEADERS) -> ModuleType:
    """The module built from ``sources`` (which include ``headers``) with ``flags``, or the cached build of them."""
    from torch.utils.cpp_extension import load
    key = build_key(flags, (*sources, *headers))
    folder = cache_root() / key
    folder.mkdir(parents=True, exist_ok=True)
    torch_log = logging.getLogger("torch.utils.cpp_extension")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)  # its multi-line compiler notices would drown our one line
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load(name=f"sparsedraft_attend_{key}", sources=[str(source) for source in sources], extra_cflags=flags,
                        extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
    finally:
        torch_log.setLevel(level)


def _reason(exc: BaseException) -> str:
    """The line of a build failure that says what went wrong, not the compiler command around it."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    telling = [line for line in lines if not line.startswith(("Error building extension", "FAILED:", "ninja:"))
               and ".cpp -o " not in line and any(word in line.lower() for word in
                                                 ("error", "not found", "no such", "required", "fatal"))]
    line = (telling or lines or ["no message"])[0]
    return f"{type(exc).__name__}: {line[:200]}"


def available() -> bool:
    """Whether :func:`attend` can run here; builds the extension the first time (about a minute)."""
    global _module, _failure, _flags
    if not enabled():
        return False
    if _module is not None:  # asked for every matmul of every step: the answer, without the build's logic
        return True
    if _failure is None:
        isa = requested_isa()
        check_isa(isa)
        _pairs_env()  # a bad value is refused before the build, not after it
        native_failed = None  # why the -march=native build failed, when a later one is kept
        for flags in FLAG_SETS if isa == "auto" else (ISA_FLAGS[isa],):
            try:
                _module, _flags = _build(flags), flags
                break
            except Exception as exc:  # noqa: BLE001 - any build failure means "use SDPA", reported once
                _failure = _reason(exc)
                if "-march=native" in flags:
                    native_failed = _failure
        if _module is not None:
            _failure = None
            _module.allow_tiles(_tiles)
            _module.allow_pairs(_choose_pairs())
            if native_failed is not None and "-march=native" not in _flags:  # a slower path: say so, once
                warnings.warn(f"sparsedraft C++ kernels: the -march=native build failed ({native_failed}); "
                              "running the portable build (no vector extensions, no AMX tiles)", RuntimeWarning,
                              stacklevel=2)
        else:
            warnings.warn(f"sparsedraft C++ attention kernel unavailable ({_failure}); using torch SDPA",
                          RuntimeWarning, stacklevel=2)
    return _module is not None


def build_from(folder: Path) -> ModuleType:
    """The kernels built from another copy of their files (:data:`SOURCES` and :data:`HEADERS` by name, in
    ``folder``) with the loaded module's flags, and given its run-time switches (tiles, paired rows), so the two
    run the same way in one process: ``bench.kernels_at`` builds a git revision's kernels this way for an A/B.
    Cached like the module itself, by the files' contents. A failed build is a RuntimeError naming its reason."""
    _built()
    try:
        module = _build(_flags, tuple(folder / p.name for p in SOURCES), tuple(folder / p.name for p in HEADERS))
    except Exception as exc:  # noqa: BLE001 - the compiler's telling line, not its command
        raise RuntimeError(_reason(exc)) from exc
    for switch, value in (("allow_tiles", _tiles), ("allow_pairs", _choose_pairs())):
        if hasattr(module, switch):  # an older revision may predate a switch
            getattr(module, switch)(value)
    return module


@contextlib.contextmanager
def running(module: ModuleType) -> Iterator[None]:
    """Inside: every kernel call of the library goes to ``module``, another build of these files
    (:func:`build_from`, e.g. a git revision's from ``bench.kernels_at``), so whole model steps can be timed on
    both builds in one process (``bench.whole_steps``). Not for two threads at once."""
    global _module
    _built()
    mine, _module = _module, module
    try:
        yield
    finally:
        _module = mine


def current() -> ModuleType:
    """The build the kernel calls go to now: this checkout's, or another one inside :func:`running`. Call
    :func:`available` first."""
    return _built()


def use_tiles(on: bool) -> bool:
    """Let bf16 attention and the bf16 few-row linear run on AMX tiles where the build has them and the OS
    grants them (the default), and bf16 attention on AVX512-BF16 dot products where the build has those
    without AMX, or keep them on the same build's vector code, so a bench or a test can run both
    in one process. Bits differ between the two, so a generation must not switch midway. Returns the previous
    choice."""
    global _tiles
    before, _tiles = _tiles, bool(on)
    if _module is not None:
        _module.allow_tiles(_tiles)
    return before


def _choose_pairs() -> bool:
    """The layout of the few-row linear's AVX2 steps of more than 8 rows, chosen as the module loads:
    ``SPARSEDRAFT_PAIR_ROWS`` when set, else whichever a short timing here finds faster. Both give the same bits;
    which is faster differs between machines (paired 1.5x faster at 16 rows on one AVX2 machine, 1.25-1.55x slower
    at 9-16 rows on a Zen 3 EPYC; docs/engine.md). Other builds ignore it."""
    global _pairs, _pairs_chosen
    if _pairs is None:
        value = _pairs_env()
        if not _module.vector_path.startswith("AVX2"):
            _pairs_chosen = (True, "unused")
        elif value is not None:
            _pairs_chosen = (value == "1", f"{PAIRS_ENV}={value}")
        else:
            _pairs_chosen = (_time_pairs(), "measured")
        _pairs = _pairs_chosen[0]
    return _pairs


def _pairs_env() -> str | None:
    """``SPARSEDRAFT_PAIR_ROWS`` ("1", "0" or unset: None), refused when it is anything else."""
    value = os.environ.get(PAIRS_ENV)
    require(value in (None, "0", "1"), lambda: f"{PAIRS_ENV}={value!r} is not allowed; set {PAIRS_ENV}=1 (pairs), "
                                               "0 (all rows at once), or unset it (measured here)")
    return value


def _time_pairs(repeats: int = 5) -> bool:
    """Whether four rows past :func:`pair_from` through a 14 MB fp32 weight (past L2, like a step's) run faster
    paired, the two layouts taking turns ``repeats`` times after one untimed round (about 30 ms on a 2-core
    EPYC)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(int(_module.pair_from) + 4, 576, generator=gen)
    w, none = torch.randn(6144, 576, generator=gen), torch.empty(0)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode():
        for _ in range(repeats + 1):
            for paired in (True, False):
                _module.allow_pairs(paired)
                start = time.perf_counter()
                _module.linear(x, w, none)
                seconds[paired].append(time.perf_counter() - start)
    return statistics.median(seconds[True][1:]) <= statistics.median(seconds[False][1:])


def use_pairs(on: bool) -> bool:
    """Run the few-row linear's AVX2 steps of more than 8 rows two rows at a time over two weight rows (True)
    or all rows at once (False) instead of the layout chosen when the module loaded, so a bench or a test can
    run both in one process (same bits either way; other builds ignore it). Builds like :func:`available`;
    returns the previous choice."""
    global _pairs
    require(available(), lambda: f"kernels.use_pairs needs the C++ kernels: {path()}")
    before, _pairs = _pairs, bool(on)
    _module.allow_pairs(_pairs)
    return before


def pair_from() -> int:
    """Steps of more rows than this may run in pairs on AVX2+FMA (few_rows_linear.cpp's kPairFrom, as built):
    the layout :func:`use_pairs` switches. Builds like :func:`available`."""
    require(available(), lambda: f"kernels.pair_from needs the C++ kernels: {path()}")
    return int(_module.pair_from)


def lanes() -> int:
    """Query rows of a KV head the attention kernel computes side by side, as built here (decode_attention.cpp's
    kLanes: 8 on an AVX2 build without AVX-512, one register; 16 elsewhere): a step's rows are rounded up to
    it, outside the keys-as-lanes steps (:data:`KEY_ROWS`). Builds like :func:`available`."""
    require(available(), lambda: f"kernels.lanes needs the C++ kernels: {path()}")
    return int(_module.lanes)


def on_tiles() -> bool:
    """Whether bf16 attention (head_dim a multiple of 32) and the bf16 few-row linear (K a multiple of 32) run
    on AMX tiles here; builds like :func:`available`."""
    return available() and _module.tiles() == 1


def on_dots(head_dim: int | None = None) -> bool:
    """Whether bf16 attention (head_dim a multiple of 32) runs the tile path's steps on AVX512-BF16 dot products
    here (a build with them and without AMX; :func:`use_tiles` switches it too); with ``head_dim``, whether
    attention of that head size takes them, by the kernel's own rule. Builds like :func:`available`."""
    if not available():
        return False
    if head_dim is None:
        return getattr(_module, "dots", lambda: 0)() == 1  # an older revision's build lacks it
    return getattr(_module, "dots_for", lambda d: 0)(int(head_dim)) == 1


def path() -> str:
    """Which path the kernels run here, for a bench to print: the vector instruction set the build
    targeted and how (``AVX2+FMA (-march=native)``), or why the torch path runs instead. Builds the
    extension the first time, like :func:`available`."""
    if not enabled():
        return "off (SPARSEDRAFT_KERNELS=0): torch path"
    if not available():
        return f"unavailable ({_failure}): torch path"
    isa = requested_isa()
    if isa != "auto":
        how = f"forced: SPARSEDRAFT_KERNEL_ISA={isa}"
    else:
        how = "-march=native" if any(f.startswith("-march=") for f in _flags) else "portable flags"
    tiles = {1: ", bf16 attention and linear on AMX tiles", -1: ", AMX tiles refused by the OS (arch_prctl)"}
    pairs = ""
    if _pairs_chosen[1] != "unused":
        chosen, by = _pairs_chosen
        pairs = (f", linear steps past {_module.pair_from} rows {'paired' if _pairs else 'unpaired'} "
                 f"({by if _pairs == chosen else 'use_pairs'})")
    dots = ", bf16 attention on AVX512-BF16 dot products" if on_dots() else ""
    vnni = ", w8a8 linear on VNNI" if getattr(_module, "vnni", False) else ""  # an older revision's build lacks it
    return f"{_module.vector_path} ({how}){tiles.get(_module.tiles(), '')}{dots}{vnni}{pairs}"


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: int) -> None:
    require(q.dim() == 4 and k.dim() == 4 and k.shape == v.shape,
            lambda: f"attend takes q [B, KV, rows, D] and k, v [B, KV, S, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}")
    b, kv, rows, d = q.shape
    require(k.shape[0] == b and k.shape[1] == kv and k.shape[3] == d,
            lambda: f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)} in batch, kv heads or head_dim")
    require(t >= 1 and rows % t == 0, lambda: f"T must be >= 1 and divide q's {rows} rows (g * T), got T={t}")
    require(k.shape[2] >= t, lambda: f"S={k.shape[2]} keys cannot hold T={t} new tokens; S must be >= T")
    require(q.dtype == k.dtype == v.dtype and q.dtype in DTYPES,
            lambda: f"attend takes float32 or bfloat16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    require(q.is_cpu and k.is_cpu and v.is_cpu, "attend runs on CPU tensors only")


def _built() -> ModuleType:
    """The built module, or one RuntimeError saying why there is none (callers check :func:`available` first)."""
    if not available():
        reason = _failure if enabled() else "SPARSEDRAFT_KERNELS=0"
        raise RuntimeError(f"the C++ attention kernel is unavailable ({reason}); check kernels.available() first")
    return _module


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, t: int,
           key_rows: int = KEY_ROWS) -> torch.Tensor:
    """Attention of q [B, KV, g*T, D] (row i*T + t: head i of the group, new token t) over k, v
    [B, KV, S, D] whose last T keys are the new tokens; row t sees keys 0 .. S-T+t. Returns
    [B, KV, g*T, D] in q's dtype. k, v may be views into bigger buffers (rows of D contiguous values,
    consecutive keys D apart); they are read in place. Each row's result is bitwise independent of T
    and of the other rows. ``key_rows``: steps of at most this many rows per KV head compute with keys
    as vector lanes, others with rows as lanes (same bits either way; the tests force each path). Call
    :func:`available` first."""
    _check(q, k, v, t)
    require(k.stride(3) == 1 and v.stride(3) == 1 and k.stride(2) == k.shape[3] and v.stride(2) == v.shape[3],
            lambda: f"k/v need contiguous rows with consecutive keys head_dim apart, got strides {k.stride()}, "
                    f"{v.stride()}; slice a [B, KV, max_len, D] buffer along S")
    return _built().attend(q, k, v, float(scale), int(t), int(key_rows))


def attend_int8(q: torch.Tensor, codes_k: torch.Tensor, scale_k: torch.Tensor, codes_v: torch.Tensor,
                scale_v: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor, scale: float, t: int,
                key_rows: int = KEY_ROWS) -> torch.Tensor:
    """:func:`attend` over keys and values held as int8 codes [B, KV, N, D] times a scale per key
    [B, KV, N] (a quantised draft view's stored tokens), followed by a full-precision tail [B, KV, S - N, D]
    (its new tokens): what streams from memory is the codes, dequantised a chunk at a time in cache. q and
    the tails may be float32 or bfloat16 (computed in float32); returns q's dtype. Rows' bits are
    independent of T, as in :func:`attend`. Call :func:`available` first."""
    require(codes_k.dtype == codes_v.dtype == torch.int8 and codes_k.shape == codes_v.shape,
            lambda: f"attend_int8 takes int8 codes of one shape, got {codes_k.dtype} {tuple(codes_k.shape)} and "
                    f"{codes_v.dtype} {tuple(codes_v.shape)}")
    require(q.dtype in DTYPES and tail_k.dtype == tail_v.dtype == q.dtype,
            lambda: f"attend_int8 takes q and tails of one float dtype, got {q.dtype}, {tail_k.dtype}, {tail_v.dtype}")
    b, kv, n, d = codes_k.shape
    require(q.dim() == 4 and q.shape[:2] == (b, kv) and q.shape[3] == d and scale_k.shape == scale_v.shape == (b, kv, n)
            and tail_k.shape == tail_v.shape and tail_k.dim() == 4 and tail_k.shape[:2] == (b, kv)
            and tail_k.shape[3] == d,
            lambda: f"attend_int8 takes q [B, KV, rows, D], codes [B, KV, N, D], scales [B, KV, N] and tails "
                    f"[B, KV, S - N, D] of one B, KV, N and D; got q {tuple(q.shape)}, codes {tuple(codes_k.shape)}, "
                    f"scales {tuple(scale_k.shape)} and {tuple(scale_v.shape)}, tails {tuple(tail_k.shape)} and "
                    f"{tuple(tail_v.shape)}")
    require(t >= 1 and q.shape[2] % t == 0 and n + tail_k.shape[2] >= t,
            lambda: f"T must be >= 1, divide q's {q.shape[2]} rows and fit in the {n + tail_k.shape[2]} keys; got T={t}")
    out = _built().attend_int8(q.float().contiguous(), codes_k, scale_k.float(), codes_v, scale_v.float(),
                              tail_k.float(), tail_v.float(), float(scale), int(t), int(key_rows))
    return out.to(q.dtype)


def is_tail_causal(mask: torch.Tensor, t: int) -> bool:
    """Whether bool ``mask`` [B, 1, T, S] lets new token t see exactly keys 0 .. S-T+t (what StaticCache
    builds without a sliding window). The last answer is remembered for the same mask object, since
    every layer of a forward gets the same one."""
    global _last_mask
    if _last_mask is not None and _last_mask[0]() is mask and _last_mask[1] == t:
        return _last_mask[2]
    s = mask.shape[-1]
    answer = (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == t
              and s >= t and bool((mask == _tail_causal(t, s, mask.device)).all()))
    _last_mask = (weakref.ref(mask), t, answer)
    return answer


def _tail_causal(t: int, s: int, device: torch.device) -> torch.Tensor:
    return torch.arange(s, device=device)[None, :] <= (s - t + torch.arange(t, device=device))[:, None]


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, t: int) -> bool:
    """Whether :func:`attend` can stand in for SDPA on folded q [B, KV, g*T, D] and k, v [B, KV, S, D]
    with ``mask`` (None: every key visible, or bool [B, 1, T, S]): CPU, float32 or bfloat16, keys in
    rows of head_dim values, the mask the tail-causal one (None only when T == 1), at most MAX_TOKENS
    new tokens, kernel built."""
    return (q.device.type == "cpu" and q.dtype in DTYPES and q.dtype == k.dtype == v.dtype and t <= MAX_TOKENS
            and q.dim() == 4 and k.dim() == 4 and k.shape == v.shape and k.shape[:2] == q.shape[:2]
            and k.shape[3] == q.shape[3] and q.shape[2] % t == 0 and k.shape[2] >= t
            and all(x.stride(3) == 1 and x.stride(2) == x.shape[3] for x in (k, v))
            and (t == 1 if mask is None else mask.shape[-1] == k.shape[2] and is_tail_causal(mask, t))
            and available())


def attend_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, t: int) -> torch.Tensor:
    """The same contract in plain torch (explicit scores, mask and fp32 softmax): the tests' oracle."""
    _check(q, k, v, t)
    rows = q.shape[2]
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # [B, KV, rows, S]
    visible = _tail_causal(t, k.shape[2], q.device).repeat(rows // t, 1)  # [rows, S], row i*T + t
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (weights @ v.float()).to(q.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for 1..:data:`MAX_LINEAR_ROWS` rows of x [..., K] on CPU (fp32 or bf16, weight [N, K]
    contiguous), each weight row read once for all rows. The weight is of x's dtype, or int8 codes with a
    ``scale`` per output row (``(x @ codes^T) * scale``: a quarter of fp32's weight bytes, the scale applied
    after the sum), or int8 codes packed by :func:`~sparsedraft.engine.quant.pack_codes` (4 dims) with their
    scale, for which each row of x is rounded to int8 on its own scale (``amax / 127``) and the products summed
    exactly in int32 (``rounded_rows_linear.cpp``: :class:`~sparsedraft.engine.quant.RoundedInt8Linear`'s bits,
    a draft's arithmetic). Row m's result is bitwise the same whatever the number of rows, which torch's own
    kernels do not promise. On AVX2+FMA a step of more than 8 rows runs in the layout :func:`use_pairs` says
    (two rows at a time, whose accumulators fit AVX2's 16 registers, or all at once, which spills there; same
    bits either way, measured once per process). Call :func:`available` first."""
    # A decode step makes ~200 of these calls: the checks stay cheap (messages built only when raised, the
    # empty bias made once), since wrapper time once matched the kernel's on small weights.
    rows = x.numel() // max(x.shape[-1], 1)
    require(1 <= rows <= MAX_LINEAR_ROWS,
            lambda: f"kernels.linear takes 1..{MAX_LINEAR_ROWS} rows, got {rows}; use F.linear for more")
    require((weight.dtype == torch.int8) == (scale is not None),
            lambda: f"kernels.linear takes a scale with int8 weights and only then, got {weight.dtype} and "
                    f"{'a' if scale is not None else 'no'} scale")
    if bias is None:
        bias = _NO_BIAS.get(x.dtype)
        if bias is None:
            bias = _NO_BIAS[x.dtype] = torch.empty(0, dtype=x.dtype)
    if not x.is_contiguous():
        x = x.contiguous()
    if scale is None:
        return _module.linear(x, weight, bias)  # out [..., N], x's leading dims
    if weight.dim() == 4:
        return _module.linear_rounded(x, weight, scale.float().contiguous(), bias)
    return _module.linear_int8(x, weight, scale.float().contiguous(), bias)


_NO_BIAS: dict[torch.dtype, torch.Tensor] = {}  # linear's "no bias" argument, one per dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of contiguous x (fp32 or bf16, CPU), Hugging Face's order: normalise
    in float32, round to x's dtype, times ``weight`` [D] of x's dtype. Each row's bits are independent of the
    other rows. Call :func:`available` first."""
    return _module.rms_norm(x, weight, float(eps))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding ("rotate half") of contiguous x [..., H, D] with cos, sin [..., D], one row per
    position of x (x's shape without H): what :meth:`~sparsedraft.engine.rope.Angles.apply` computes on the
    transposed [B, H, T, D], in float32, rounded once. Call :func:`available` first."""
    return _module.rope(x, cos, sin)


def layer_head(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, linears: list[torch.Tensor], heads: int,
               cos: torch.Tensor, sin: torch.Tensor, rope_keys: bool) -> list[torch.Tensor]:
    """A decoder layer's first half for a step's rows, one call: ``n = RMSNorm(x)``, then q, k, v [B, T, heads,
    D] from ``linears`` ((weight, bias, scale) for q, k and v, as :func:`layer_tail` takes them), q and (where
    ``rope_keys``) k rotated by cos, sin [B, T, D]. The same calls as the Python path, so the same bits. Call
    :func:`available` first."""
    return _module.layer_head(x, norm_weight, float(eps), linears, heads, cos, sin, rope_keys)


def layer_tail(x: torch.Tensor, a: torch.Tensor, linears: list[torch.Tensor], norm_weight: torch.Tensor,
               eps: float) -> torch.Tensor:
    """A decoder layer's second half for a step's rows, one call: ``h = x + o_proj(a)``, then ``h +
    down(silu(gate(n)) * up(n))`` with ``n = RMSNorm(h)``; ``linears`` holds (weight, bias, scale) for o, gate,
    up and down (empty bias: none; empty scale: not int8 codes, else fp32 [N]). The same calls in the same
    order as the Python path (``kernels/step_block.cpp``), so the same bits. Call :func:`available` first."""
    return _module.layer_tail(x, a, linears, norm_weight, float(eps))


def layer_stack(head_norms: list[torch.Tensor], head_eps: list[float], head_linears: list[list[torch.Tensor]],
                tail_norms: list[torch.Tensor], tail_eps: list[float], tail_linears: list[list[torch.Tensor]],
                k: list[torch.Tensor], v: list[torch.Tensor], heads: int, scale: float, rope_keys: bool,
                codes: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], int]
                | None = None, key_rows: int = KEY_ROWS):
    """A step's decoder stack as one C++ object (``kernels/step_stack.cpp``), per layer the arguments of
    :func:`layer_head` and :func:`layer_tail` and a cache's k, v buffers [B, KV, slots, D]; ``codes``: for a view
    whose first ``n`` slots are int8, per layer its key codes, key scales [B, KV, n], value codes and value
    scales, then ``n``. ``.run(x, start, stop, cos, sin, keep)`` runs each layer's :func:`layer_head`, writes its
    keys and values at slots [start, stop), :func:`attend` (:func:`attend_int8` over codes) over slots [0,
    stop) and :func:`layer_tail`, and returns the outputs of the layers in ``keep`` (ascending), then the last
    layer's: the Python path's calls in its order, so its bits. Call :func:`available` first."""
    kc, ks, vc, vs, n = codes if codes is not None else ([], [], [], [], 0)
    try:
        return _module.LayerStack(head_norms, [float(e) for e in head_eps], head_linears, tail_norms,
                                  [float(e) for e in tail_eps], tail_linears, k, v, kc, ks, vc, vs, int(n),
                                  int(heads), float(scale), bool(rope_keys), int(key_rows))
    except TypeError as error:  # another revision's build (running()) whose LayerStack takes other arguments
        raise SparsedraftError(
            "the kernel build in use takes LayerStack(...) with other arguments than this checkout passes: an A/B "
            "of whole steps needs a commit whose kernels/step_stack.cpp has this interface") from error


def step_fits(x: torch.Tensor) -> bool:
    """Whether the kernels take a step's tensor ``x``: CPU, fp32/bf16, no autograd, built (what every kernel
    asks; :func:`linear_fits` adds the weight's conditions)."""
    return x.is_cpu and x.dtype in DTYPES and not (torch.is_grad_enabled() and x.requires_grad) and available()


def linear_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` takes this step: CPU, fp32/bf16 rows, a contiguous weight of their dtype or int8
    codes, no autograd, few rows, built."""
    return weight_fits(x, weight) and step_fits(x)


def weight_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """:func:`linear_fits` less what :func:`step_fits` asks of ``x``: the weight's dtype, layout and autograd,
    and few rows (for a caller that has asked step_fits once for a whole forward)."""
    return (weight.dtype in (x.dtype, torch.int8) and weight.is_contiguous()
            and x.numel() <= MAX_LINEAR_ROWS * x.shape[-1]
            and not (torch.is_grad_enabled() and weight.requires_grad))
