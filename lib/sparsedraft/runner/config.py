"""Which notebooks run with which parameters: defaults -> profile YAML -> command line.

Three layers, later ones winning:

1. the notebook's own ``parameters`` cell (each line ``name = <Python literal>``);
2. a profile, ``notebooks/profiles/<name>.yaml``::

       description: one line saying what the profile is for
       defaults:             # every notebook that declares the parameter takes it
         device: cpu
       notebooks:
         "05":               # a notebook's number or full stem; only that notebook
           gammas: [2, 4]

3. parameter files, ``-f params.yaml`` (in order): a mapping whose keys are
   parameter names (every notebook that declares one) or notebook keys
   (``"05": {gammas: [2, 4]}``, one notebook);
4. ``-p key=value`` or papermill's ``-p key value`` (every selected notebook
   that declares ``key``) or ``-p 05.key=value`` (one notebook); values are
   parsed as YAML.

A profile may also declare ``select`` (the notebooks it runs when ``--only``
is not given) and ``sweep``: per notebook, a grid of parameter values whose
cartesian product expands into one run per point::

       select: ["05"]
       sweep:
         "05":
           context: [2000, 4000]   # each axis a non-empty list of values,
           budget: [256, 512]      # each value checked like any parameter

A swept parameter may not also be set by ``-f`` or ``-p`` (the grid would be
silently overridden). Each point is an ordinary run: its folder is the profile
name plus the hash of its merged parameters, so points never collide and a
resumed sweep skips the points that finished.

Every name is checked against the notebooks' parameter cells and every value
against the type of the notebook's default, before anything runs. The run id
is the profile name plus a hash of the merged parameters, so a changed value
gives a new output folder and an unchanged one is found and skipped.

A notebook whose metadata holds ``"sparsedraft": {"reads_outputs": true}``
summarises other notebooks' results (07); the runner reruns it whenever
another notebook ran in the same invocation, so its summary is never stale.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import nbformat
import yaml

from ..errors import SparsedraftError, require

PARAMETERS_TAG = "parameters"
OUTPUT_DIR_PARAM = "output_dir"  # injected by the runner, never layered or hashed
NOTEBOOK_GLOB = "[0-9][0-9]_*.ipynb"
PROFILE_KEYS = ("description", "defaults", "notebooks", "select", "sweep")
METADATA_KEY = "sparsedraft"  # notebook metadata section read by the runner
HASH_CHARS = 8


@dataclass(frozen=True)
class RunConfig:
    """One invocation of the runner, validated on construction."""

    profile: str = "cpu"  # profile name in <notebooks>/profiles/ or a path to a .yaml file
    only: tuple[str, ...] = ()  # notebook numbers or stems to run; empty runs all
    force: bool = False  # rerun even when a finished run with the same id exists
    overrides: tuple[str, ...] = ()  # "key=value" or "NN.key=value" from -p
    parameter_files: tuple[Path, ...] = ()  # YAML files from -f, applied in order before the overrides
    notebooks_dir: Path = Path("notebooks")
    outputs_dir: Path = Path("outputs")
    kernel: str | None = None  # Jupyter kernel for every notebook; None: each notebook's own kernelspec
    timeout_s: int | None = None  # per-cell limit; None waits as long as a cell takes
    threads: int | None = None  # CPU threads per kernel (OMP_NUM_THREADS); None keeps the default

    def __post_init__(self) -> None:
        require(self.notebooks_dir.is_dir(),
                f"notebooks folder {self.notebooks_dir} not found; run from the repository root "
                "or pass --notebooks DIR")
        require(bool(self.profile), "profile must be a name (cpu, quick, gpu-paper) or a .yaml path")
        for item in self.overrides:
            require("=" in item and item.split("=", 1)[0].strip() != "",
                    f"parameter override {item!r} must look like key=value or NN.key=value")
        require(self.timeout_s is None or self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}")
        require(self.threads is None or self.threads > 0, f"threads must be > 0, got {self.threads}")
        for path in self.parameter_files:
            require(Path(path).is_file(), f"parameter file {path} not found (-f expects a YAML file of name: value)")

    @property
    def profile_path(self) -> Path:
        if self.profile.endswith((".yaml", ".yml")):
            return Path(self.profile)
        return self.notebooks_dir / "profiles" / f"{self.profile}.yaml"

    @property
    def profile_name(self) -> str:
        return Path(self.profile).stem if self.profile.endswith((".yaml", ".yml")) else self.profile


@dataclass(frozen=True)
class NotebookRun:
    """One notebook with its merged parameters and the folder its results go to."""

    notebook: Path
    profile: str
    parameters: dict[str, Any] = field(hash=False)
    outputs_dir: Path
    reads_outputs: bool = False  # summarises other notebooks' runs: rerun when any of them ran
    kernel: str = "python3"  # the Jupyter kernel that executes it

    @property
    def name(self) -> str:
        return self.notebook.stem

    @property
    def run_id(self) -> str:
        return run_id(self.profile, self.parameters)

    @property
    def output_dir(self) -> Path:
        return self.outputs_dir / self.name / self.run_id


def run_id(profile: str, parameters: Mapping[str, Any]) -> str:
    """``<profile>-<8 hex>``: the same parameters always map to the same folder."""
    blob = json.dumps(parameters, sort_keys=True, default=str).encode()
    return f"{profile}-{hashlib.sha256(blob).hexdigest()[:HASH_CHARS]}"


def reads_outputs(path: Path) -> bool:
    """Whether the notebook declares that it reads other notebooks' results."""
    return bool(nbformat.read(path, as_version=4).metadata.get(METADATA_KEY, {}).get("reads_outputs", False))


def kernelspec_name(path: Path) -> str:
    """The kernel the notebook's metadata names (``metadata.kernelspec.name``)."""
    name = nbformat.read(path, as_version=4).metadata.get("kernelspec", {}).get("name")
    require(bool(name), f"{path.name} names no kernel in metadata.kernelspec; pass --kernel NAME")
    return name


def notebook_defaults(path: Path) -> dict[str, Any]:
    """Values assigned in the notebook's cell tagged ``parameters`` (literals only)."""
    nb = nbformat.read(path, as_version=4)
    cells = [c for c in nb.cells if PARAMETERS_TAG in c.get("metadata", {}).get("tags", [])]
    require(len(cells) == 1, f"{path.name} must have exactly one cell tagged {PARAMETERS_TAG!r}, "
                             f"found {len(cells)}")
    try:
        tree = ast.parse(cells[0].source)
    except SyntaxError as exc:
        raise SparsedraftError(f"{path.name}: the parameters cell is not valid Python ({exc})") from exc
    values: dict[str, Any] = {}
    for node in tree.body:
        require(isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name),
                f"{path.name}: the parameters cell may only hold `name = literal` lines "
                f"(line {getattr(node, 'lineno', '?')})")
        name = node.targets[0].id
        try:
            values[name] = ast.literal_eval(node.value)
        except ValueError as exc:
            raise SparsedraftError(f"{path.name}: parameter {name} must be a Python literal") from exc
    require(OUTPUT_DIR_PARAM in values,
            f"{path.name}: the parameters cell must declare {OUTPUT_DIR_PARAM} = '' (the runner fills it)")
    unparsed = sorted(set(values) - set(_papermill_parameters(path)))
    require(not unparsed, f"{path.name}: papermill cannot parse the parameter line(s) of {unparsed}, so it would "
                          "pass their values as unknown and the notebook would keep its defaults; simplify the "
                          "line's comment (papermill rejects some characters there, e.g. '>=')")
    return values


def _papermill_parameters(path: Path) -> list[str]:
    """The parameter names papermill itself reads from the notebook (its parser is stricter than Python's)."""
    import logging

    import papermill
    logger = logging.getLogger("papermill")
    level = logger.level
    logger.setLevel(logging.ERROR)  # its own warning names the line; ours says what follows from it
    try:
        return list(papermill.inspect_notebook(str(path)))
    finally:
        logger.setLevel(level)


def discover(notebooks_dir: Path) -> list[Path]:
    """Numbered notebooks (``NN_name.ipynb``) in order."""
    found = sorted(notebooks_dir.glob(NOTEBOOK_GLOB))
    require(bool(found), f"no notebooks named {NOTEBOOK_GLOB} in {notebooks_dir}")
    return found


def match_notebook(key: str, notebooks: Sequence[Path]) -> Path:
    """The notebook a key names: its two-digit number (``05``) or its stem."""
    key = str(key)
    hits = [nb for nb in notebooks if nb.stem == key or nb.stem.split("_", 1)[0] == key.zfill(2)]
    require(len(hits) == 1, f"{key!r} names no notebook; choose from {[nb.stem for nb in notebooks]}")
    return hits[0]


def load_profile(path: Path) -> dict[str, Any]:
    require(path.is_file(), f"profile {path} not found; profiles live in notebooks/profiles/ "
                            "(cpu, quick, gpu-paper) or pass a path to a .yaml file")
    data = yaml.safe_load(path.read_text()) or {}
    require(isinstance(data, dict), f"profile {path} must be a YAML mapping with keys {PROFILE_KEYS}")
    unknown = sorted(set(data) - set(PROFILE_KEYS))
    require(not unknown, f"profile {path}: unknown top-level keys {unknown}; allowed are {PROFILE_KEYS}")
    for key in ("defaults", "notebooks", "sweep"):
        require(isinstance(data.get(key) or {}, dict), f"profile {path}: {key} must be a mapping")
    select = data.get("select") or []
    require(isinstance(select, list) and all(isinstance(k, (str, int)) for k in select),
            f"profile {path}: select must be a list of notebook numbers or names, e.g. [\"05\"]")
    return data


def load_parameter_file(path: Path) -> dict[str, Any]:
    """A ``-f`` file: a YAML mapping of parameter names (and notebook keys holding mappings) to values."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise SparsedraftError(f"parameter file {path} is not valid YAML ({exc})") from exc
    require(isinstance(data, dict), f"parameter file {path} must be a YAML mapping of name: value "
                                    "(or \"05\": {{name: value}} for one notebook)")
    return data


def override_item(values: Sequence[str]) -> str:
    """``-p`` as ``key=value`` (one word) or papermill's ``key value`` (two words), as ``key=value``."""
    require(1 <= len(values) <= 2, f"-p takes key=value or key value, got {list(values)}")
    if len(values) == 2:
        require("=" not in values[0], f"-p {' '.join(values)}: give one override per -p "
                                      "(-p a=1 -p b=2, or -p a 1 -p b 2)")
        return f"{values[0]}={values[1]}"
    return values[0]


def expand_grid(notebook: str, grid: Any, defaults: Mapping[str, Any], source: str) -> list[dict[str, Any]]:
    """The points of one notebook's sweep grid (cartesian product, axes in the order written)."""
    require(isinstance(grid, dict) and bool(grid), f"{source} must map parameter names to lists of values")
    axes = []
    for name, values in grid.items():
        require(name in defaults and name != OUTPUT_DIR_PARAM,
                f"{source}: {notebook} has no parameter {name!r}; "
                f"its parameters are {sorted(set(defaults) - {OUTPUT_DIR_PARAM})}")
        require(isinstance(values, list) and bool(values),
                f"{source}.{name} must be a non-empty list of values to sweep, got {values!r}")
        axes.append([(name, coerce(notebook, name, defaults[name], v)) for v in values])
    return [dict(point) for point in itertools.product(*axes)]


def parse_override(item: str) -> tuple[str | None, str, Any]:
    """``[NN.]key=value`` -> (notebook key or None, parameter, YAML-parsed value)."""
    left, text = item.split("=", 1)
    left = left.strip()
    match = re.fullmatch(r"(?:([\w-]+)\.)?([A-Za-z_]\w*)", left)
    require(match is not None, f"override {item!r}: the key must be a parameter name, optionally "
                               "prefixed by a notebook number (05.gammas=[2,4])")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as exc:
        raise SparsedraftError(f"override {item!r}: value is not valid YAML ({exc})") from exc
    return match.group(1), match.group(2), value


def coerce(notebook: str, name: str, default: Any, value: Any) -> Any:
    """``value`` checked against the type of ``default``.

    An int passes where the default is a float and stays an int: some
    parameters read the two differently (a budget of ``0.03`` is a share of
    the context, ``4096`` a token count).
    """
    if default is None or value is None:
        return value
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(default, (list, tuple)) and isinstance(value, (list, tuple)):
        return type(default)(value)
    kind = type(default)
    ok = isinstance(value, kind) and (isinstance(value, bool) == isinstance(default, bool))
    require(ok, f"{notebook}: parameter {name} expects {kind.__name__} (default {default!r}), "
                f"got {value!r} ({type(value).__name__})")
    return value


def plan(cfg: RunConfig) -> list[NotebookRun]:
    """Validated :class:`NotebookRun` for every selected notebook (every sweep point), nothing executed."""
    notebooks = discover(cfg.notebooks_dir)
    defaults = {nb: notebook_defaults(nb) for nb in notebooks}
    profile = load_profile(cfg.profile_path)
    layers: dict[Path, dict[str, Any]] = {nb: {} for nb in notebooks}
    late: dict[Path, set[str]] = {nb: set() for nb in notebooks}  # set by -f or -p: a sweep may not cover them

    def apply_everywhere(name: str, value: Any, source: str, user: bool = False) -> None:
        targets = [nb for nb in notebooks if name in defaults[nb] and name != OUTPUT_DIR_PARAM]
        require(bool(targets), f"{source}: no notebook declares a parameter {name!r}")
        for nb in targets:
            layers[nb][name] = value
            if user:
                late[nb].add(name)

    def apply_one(key: str, name: str, value: Any, source: str, user: bool = False) -> None:
        nb = match_notebook(key, notebooks)
        require(name in defaults[nb] and name != OUTPUT_DIR_PARAM,
                f"{source}: {nb.stem} has no parameter {name!r}; "
                f"its parameters are {sorted(set(defaults[nb]) - {OUTPUT_DIR_PARAM})}")
        layers[nb][name] = value
        if user:
            late[nb].add(name)

    def is_notebook_key(key: Any) -> bool:
        key = str(key)
        return any(nb.stem == key or nb.stem.split("_", 1)[0] == key.zfill(2) for nb in notebooks) \
            and not any(key in defaults[nb] for nb in notebooks)

    for name, value in (profile.get("defaults") or {}).items():
        apply_everywhere(name, value, f"profile {cfg.profile_name} defaults")
    for key, values in (profile.get("notebooks") or {}).items():
        require(isinstance(values, dict), f"profile {cfg.profile_name}: notebooks.{key} must be a mapping")
        for name, value in values.items():
            apply_one(str(key), name, value, f"profile {cfg.profile_name} notebooks.{key}")
    for path in cfg.parameter_files:
        for key, value in load_parameter_file(path).items():
            if is_notebook_key(key):
                require(isinstance(value, dict), f"parameter file {path}: {key} names a notebook, so its value "
                                                 f"must be a mapping of parameters, got {value!r}")
                for name, item in value.items():
                    apply_one(str(key), name, item, f"parameter file {path} ({key})", user=True)
            else:
                apply_everywhere(str(key), value, f"parameter file {path}", user=True)
    for item in cfg.overrides:
        key, name, value = parse_override(item)
        if key is None:
            apply_everywhere(name, value, f"-p {item}", user=True)
        else:
            apply_one(key, name, value, f"-p {item}", user=True)

    grids: dict[Path, list[dict[str, Any]]] = {}
    for key, grid in (profile.get("sweep") or {}).items():
        nb = match_notebook(str(key), notebooks)
        source = f"profile {cfg.profile_name} sweep.{key}"
        grids[nb] = expand_grid(nb.stem, grid, defaults[nb], source)
        clash = sorted(late[nb] & set(grid))
        require(not clash, f"{source} sweeps {clash}, which -f/-p also set; drop the override or the grid axis")

    only = cfg.only or tuple(str(k) for k in profile.get("select") or ())
    selected = [match_notebook(key, notebooks) for key in only] if only else notebooks
    runs = []
    for nb in dict.fromkeys(selected):
        merged = {k: v for k, v in defaults[nb].items() if k != OUTPUT_DIR_PARAM}
        for name, value in layers[nb].items():
            merged[name] = coerce(nb.stem, name, defaults[nb][name], value)
        kernel = cfg.kernel or kernelspec_name(nb)
        for point in grids.get(nb, [{}]):
            runs.append(NotebookRun(nb, cfg.profile_name, {**merged, **point}, cfg.outputs_dir, reads_outputs(nb),
                                    kernel))
    return runs
