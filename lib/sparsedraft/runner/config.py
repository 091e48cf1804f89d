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

3. ``-p key=value`` (every selected notebook that declares ``key``) or
   ``-p 05.key=value`` (one notebook); values are parsed as YAML.

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
PROFILE_KEYS = ("description", "defaults", "notebooks")
METADATA_KEY = "sparsedraft"  # notebook metadata section read by the runner
HASH_CHARS = 8


@dataclass(frozen=True)
class RunConfig:
    """One invocation of the runner, validated on construction."""

    profile: str = "cpu"  # profile name in <notebooks>/profiles/ or a path to a .yaml file
    only: tuple[str, ...] = ()  # notebook numbers or stems to run; empty runs all
    force: bool = False  # rerun even when a finished run with the same id exists
    overrides: tuple[str, ...] = ()  # "key=value" or "NN.key=value" from -p
    notebooks_dir: Path = Path("notebooks")
    outputs_dir: Path = Path("outputs")
    kernel: str = "python3"  # Jupyter kernel that executes the notebooks
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
    for key in ("defaults", "notebooks"):
        require(isinstance(data.get(key) or {}, dict), f"profile {path}: {key} must be a mapping")
    return data


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
    """Validated :class:`NotebookRun` for every selected notebook, nothing executed."""
    notebooks = discover(cfg.notebooks_dir)
    defaults = {nb: notebook_defaults(nb) for nb in notebooks}
    profile = load_profile(cfg.profile_path)
    layers: dict[Path, dict[str, Any]] = {nb: {} for nb in notebooks}

    def apply_everywhere(name: str, value: Any, source: str) -> None:
        targets = [nb for nb in notebooks if name in defaults[nb] and name != OUTPUT_DIR_PARAM]
        require(bool(targets), f"{source}: no notebook declares a parameter {name!r}")
        for nb in targets:
            layers[nb][name] = value

    def apply_one(key: str, name: str, value: Any, source: str) -> None:
        nb = match_notebook(key, notebooks)
        require(name in defaults[nb] and name != OUTPUT_DIR_PARAM,
                f"{source}: {nb.stem} has no parameter {name!r}; "
                f"its parameters are {sorted(set(defaults[nb]) - {OUTPUT_DIR_PARAM})}")
        layers[nb][name] = value

    for name, value in (profile.get("defaults") or {}).items():
        apply_everywhere(name, value, f"profile {cfg.profile_name} defaults")
    for key, values in (profile.get("notebooks") or {}).items():
        require(isinstance(values, dict), f"profile {cfg.profile_name}: notebooks.{key} must be a mapping")
        for name, value in values.items():
            apply_one(str(key), name, value, f"profile {cfg.profile_name} notebooks.{key}")
    for item in cfg.overrides:
        key, name, value = parse_override(item)
        if key is None:
            apply_everywhere(name, value, f"-p {item}")
        else:
            apply_one(key, name, value, f"-p {item}")

    selected = [match_notebook(key, notebooks) for key in cfg.only] if cfg.only else notebooks
    runs = []
    for nb in dict.fromkeys(selected):
        merged = {k: v for k, v in defaults[nb].items() if k != OUTPUT_DIR_PARAM}
        for name, value in layers[nb].items():
            merged[name] = coerce(nb.stem, name, defaults[nb][name], value)
        runs.append(NotebookRun(nb, cfg.profile_name, merged, cfg.outputs_dir, reads_outputs(nb)))
    return runs
