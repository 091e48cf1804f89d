"""The C++ kernels as they were at another git revision, built beside this checkout's, for an A/B in one process.

Why: a kernel change is judged by timing it against the code it replaces, and on the 2-core machines here the
read bandwidth moves between processes by more than most kernel changes are worth (26.6 and 39.7 GB/s in two
``bench.kernel_timing`` records taken 40 s apart, ``attention-prefetch-{before,after}.json``). Two processes
then measure the machine as much as the change. Built from the revision's own files with this build's flags
and loaded into the same process, the two builds take turns on the same caches and the same bandwidth
(``bench.kernel_timing --against REV``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import ModuleType

from ..engine import kernels
from ..errors import SparsedraftError, require


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, check=False)


def revision(rev: str) -> tuple[Path, str]:
    """The checkout's top folder and the full commit ``rev`` names in it; one clear error when either is missing."""
    here = Path(kernels.__file__).parent
    top = _git(here, "rev-parse", "--show-toplevel")
    require(top.returncode == 0,
            f"--against needs the kernels in a git checkout, and {here} is not in one "
            f"({top.stderr.decode().strip() or 'git failed'}); run from a clone of the repository")
    root = Path(top.stdout.decode().strip())
    sha = _git(root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    require(sha.returncode == 0, f"--against {rev!r}: no such commit in {root}; give a commit, tag or branch "
                                 "(`git log --oneline` lists them)")
    return root, sha.stdout.decode().strip()


def kernels_at(rev: str) -> tuple[ModuleType, str]:
    """The kernels built from revision ``rev``'s files (and the commit it names). Their folder is kept under the
    kernel cache, so a second A/B against the same commit does not rebuild."""
    require(kernels.available(), "the C++ kernels are unavailable here, so there is no build to compare with")
    root, sha = revision(rev)
    folder = kernels.cache_root() / f"at-{sha[:12]}"
    folder.mkdir(parents=True, exist_ok=True)
    for path in (*kernels.SOURCES, *kernels.HEADERS):
        name = path.resolve().relative_to(root.resolve()).as_posix()
        shown = _git(root, "show", f"{sha}:{name}")
        require(shown.returncode == 0, f"--against {rev!r}: commit {sha[:12]} has no {name}, so its kernels are "
                                       "not this build's files; pick a later commit")
        if not (folder / path.name).exists() or (folder / path.name).read_bytes() != shown.stdout:
            (folder / path.name).write_bytes(shown.stdout)
    try:
        return kernels.build_from(folder), sha
    except RuntimeError as exc:
        raise SparsedraftError(f"--against {rev!r}: commit {sha[:12]}'s kernels did not build here ({exc}); "
                               "pick another commit") from exc
