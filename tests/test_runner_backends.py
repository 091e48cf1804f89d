"""Runner parameters from files and papermill-style ``-p``, profile sweeps, and the serial/local/Ray backends.

The lab notebooks are the trivial ones of ``test_runner``; the Ray backend's run of real notebooks is in
``test_notebooks`` (it compares with the quick profile's serial run made there).
"""

import json
import socket
import sys

import pytest

from sparsedraft.__main__ import main
from sparsedraft.errors import SparsedraftError
from sparsedraft.runner import plan
from sparsedraft.runner.backends import Settings, check_reachable, make_backend
from sparsedraft.runner.config import override_item
from sparsedraft.runner.execute import LOG_FILE, RUN_FILE

from test_runner import TRIVIAL_BODY, by_name, config, fake_papermill, lab, write_notebook  # noqa: F401 (fixture)

SWEEP = """description: a grid over 01
select: ["01"]
defaults:
  x: 3
sweep:
  "01":
    x: [1, 2, 3]
    name: [a, b]
"""


def args_for(lab, *extra):
    return ["run", "--notebooks", str(lab / "notebooks"), "--outputs", str(lab / "outputs"), *extra]


def test_papermill_style_p_and_parameter_files_layer_before_p(lab, tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("x: 5\n'01':\n  name: from-file\n  scale: 4\n")
    runs = by_name(plan(config(lab, parameter_files=(params,), overrides=(override_item(["01.scale", "9"]),))))
    assert runs["01_trivial"].parameters["x"] == 5 and runs["02_other"].parameters["x"] == 5
    assert runs["01_trivial"].parameters["name"] == "from-file"
    assert runs["01_trivial"].parameters["scale"] == 9  # -p wins over -f
    assert override_item(["x", "[1, 2]"]) == "x=[1, 2]" and override_item(["x=2"]) == "x=2"


@pytest.mark.parametrize("values, words", [(["a=1", "b=2"], "one override per -p"), (["a", "1", "2"], "key value")])
def test_bad_p_forms(values, words):
    with pytest.raises(SparsedraftError, match=words):
        override_item(values)


@pytest.mark.parametrize("text, words", [
    ("- 1\n- 2\n", "must be a YAML mapping"),
    ("nope: 1\n", "no notebook declares a parameter 'nope'"),
    ("'01': 3\n", "must be a mapping of parameters"),
    ("x: [oops\n", "not valid YAML"),
    ("x: text\n", "expects int"),
])
def test_bad_parameter_files(lab, tmp_path, text, words):
    params = tmp_path / "bad.yaml"
    params.write_text(text)
    with pytest.raises(SparsedraftError, match=words.replace("[", r"\[")):
        plan(config(lab, parameter_files=(params,)))
    with pytest.raises(SparsedraftError, match="not found"):
        config(lab, parameter_files=(tmp_path / "missing.yaml",))


def test_sweep_expands_into_one_run_per_point_with_distinct_folders(lab):
    (lab / "notebooks" / "profiles" / "grid.yaml").write_text(SWEEP)
    runs = plan(config(lab, profile="grid"))
    assert [r.name for r in runs] == ["01_trivial"] * 6  # select keeps 02 out
    points = [(r.parameters["x"], r.parameters["name"]) for r in runs]
    assert points == [(1, "a"), (1, "b"), (2, "a"), (2, "b"), (3, "a"), (3, "b")]
    assert len({r.output_dir for r in runs}) == 6
    assert all(r.parameters["scale"] == 0.5 for r in runs)
    assert [r.name for r in plan(config(lab, profile="grid", only=("02",)))] == ["02_other"]  # --only wins


@pytest.mark.parametrize("sweep, words", [
    ("  '01':\n    x: [1, text]\n", "expects int"),
    ("  '01':\n    x: 3\n", "non-empty list"),
    ("  '01':\n    x: []\n", "non-empty list"),
    ("  '01':\n    nope: [1]\n", "has no parameter 'nope'"),
    ("  '09':\n    x: [1]\n", "names no notebook"),
    ("  - 1\n", "sweep must be a mapping"),
])
def test_bad_sweeps_fail_before_anything_runs(lab, sweep, words):
    (lab / "notebooks" / "profiles" / "grid.yaml").write_text(f"description: bad\nsweep:\n{sweep}")
    with pytest.raises(SparsedraftError, match=words):
        plan(config(lab, profile="grid"))


def test_a_swept_parameter_cannot_also_be_overridden(lab):
    (lab / "notebooks" / "profiles" / "grid.yaml").write_text(SWEEP)
    with pytest.raises(SparsedraftError, match=r"sweeps \['x'\], which -f/-p also set"):
        plan(config(lab, profile="grid", overrides=("x=7",)))
    assert len(plan(config(lab, profile="grid", overrides=("scale=7",)))) == 6


def test_a_killed_sweep_resumes_without_rerunning_finished_points(lab, monkeypatch):
    import papermill
    (lab / "notebooks" / "profiles" / "grid.yaml").write_text(SWEEP)
    calls = fake_papermill(monkeypatch)
    finish = papermill.execute_notebook

    def killed_at_third(*args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C (or a kill) while the third point runs
        finish(*args, **kwargs)

    monkeypatch.setattr(papermill, "execute_notebook", killed_at_third)
    with pytest.raises(KeyboardInterrupt):
        main(args_for(lab, "--profile", "grid"))
    assert len(calls) == 2
    monkeypatch.setattr(papermill, "execute_notebook", finish)
    assert main(args_for(lab, "--profile", "grid")) == 0
    assert len(calls) == 6  # the two finished points were skipped, the other four ran once each
    assert sorted(c["x"] for c in calls) == [1, 1, 2, 2, 3, 3]


def test_local_backend_runs_in_worker_processes_and_reports_a_failure_with_its_log(lab, capsys):
    books = lab / "notebooks"
    write_notebook(books / "03_broken.ipynb", 'output_dir = ""\nx = 1', 'print("about to fail")\nraise ValueError("bad x")')
    assert main(args_for(lab, "--profile", "test", "--jobs", "2", "--only", "01,03")) == 1
    out = capsys.readouterr().out
    assert "03_broken: failed" in out and "ValueError" in out
    broken = next((lab / "outputs" / "03_broken").iterdir())
    log = (broken / LOG_FILE).read_text()
    assert f"log: {broken / LOG_FILE}" in out and "Executing" in log and "about to fail" in log
    record = json.loads((broken / RUN_FILE).read_text())
    assert record["status"] == "failed" and "ValueError" in record["error"]
    good = next((lab / "outputs" / "01_trivial").iterdir())  # the other run is kept, finished
    assert json.loads((good / RUN_FILE).read_text())["status"] == "ok"
    assert json.loads((good / "metrics.json").read_text())["double"] == 6
    local_files = {p.name for p in good.iterdir()}
    # the same run serially, in another outputs folder: the same files
    assert main(["run", "--notebooks", str(books), "--outputs", str(lab / "serial"), "--profile", "test",
                 "--only", "01"]) == 0
    serial = next((lab / "serial" / "01_trivial").iterdir())
    assert {p.name for p in serial.iterdir()} == local_files and serial.name == good.name
    timing = json.loads((lab / "serial" / "run-test.json").read_text())  # the command's own timing record
    assert [n["notebook"] for n in timing["notebooks"]] == ["01_trivial"] and timing["notebooks"][0]["status"] == "ok"
    assert timing["wall_s"] >= timing["notebooks"][0]["wall_s"] > 0 and timing["peak_rss_mb"] > 0
    assert len(timing["commit"]) == 40 and timing["machine"]["isa"] and "peak_gflops_fp32" not in timing["machine"]
    assert main(args_for(lab, "--profile", "test", "--jobs", "2", "--only", "01")) == 0
    assert "skipped" in capsys.readouterr().out


def test_a_worker_that_dies_leaves_a_failed_record(lab, capsys):
    write_notebook(lab / "notebooks" / "03_dies.ipynb", 'output_dir = ""\nx = 1', "import os\nos._exit(3)")
    assert main(args_for(lab, "--profile", "test", "--jobs", "2", "--only", "03")) == 1
    folder = next((lab / "outputs" / "03_dies").iterdir())
    record = json.loads((folder / RUN_FILE).read_text())
    assert record["status"] == "failed" and record["error"]


def test_ray_without_ray_installed_is_one_clear_error(lab, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    assert main(args_for(lab, "--profile", "test", "--backend", "ray")) == 2
    err = capsys.readouterr().err
    assert "needs Ray, which is not installed" in err and "pip install" in err
    assert not (lab / "outputs").exists()  # nothing ran


def test_an_unreachable_ray_address_is_one_clear_error(lab, capsys):
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(args_for(lab, "--profile", "test", "--backend", "ray", "--address", f"127.0.0.1:{port}")) == 2
    err = capsys.readouterr().err
    assert "unreachable" in err and f"127.0.0.1:{port}" in err
    assert not (lab / "outputs").exists()
    with pytest.raises(SparsedraftError, match="must be host:port"):
        check_reachable("nowhere")


@pytest.mark.parametrize("kwargs, words", [
    ({"name": "ray", "jobs": 2}, "--jobs applies to the local backend"),
    ({"name": "serial", "address": "auto"}, "need --backend ray"),
    ({"name": "local", "jobs": 0}, "--jobs must be >= 1"),
])
def test_backend_option_errors(kwargs, words):
    with pytest.raises(SparsedraftError, match=words):
        make_backend(settings=Settings(), **kwargs)


def test_a_missing_kernel_is_reported_before_any_run(lab, capsys):
    assert main(args_for(lab, "--profile", "test", "--kernel", "no-such-kernel")) == 2
    assert "no-such-kernel" in capsys.readouterr().err and not (lab / "outputs").exists()


def test_ray_tasks_declare_a_gpu_only_for_cuda_runs(lab):
    from sparsedraft.runner.backends import ray_resources
    write_notebook(lab / "notebooks" / "03_device.ipynb", 'output_dir = ""\ndevice = "cpu"')
    cpu = by_name(plan(config(lab)))["03_device"]
    cuda = by_name(plan(config(lab, overrides=("device=cuda:0",))))["03_device"]
    assert ray_resources(cpu, 2) == {"num_cpus": 2, "num_gpus": 0}
    assert ray_resources(cuda, 1) == {"num_cpus": 1, "num_gpus": 1}


def test_a_failed_join_hints_at_ray_token_authentication(monkeypatch):
    from sparsedraft.runner.backends import auth_hint
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert "RAY_AUTH_MODE=token" in auth_hint("127.0.0.1:6379")
    assert auth_hint(None) == ""  # an embedded Ray makes its own token
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert auth_hint("127.0.0.1:6379") == ""  # already set: the failure is something else


def test_measure_machine_records_the_machines_speed_before_running(lab, monkeypatch):
    import sparsedraft.runner.cli as cli
    monkeypatch.setattr(cli, "machine_record", lambda measure=True: {"isa": "X", "read_gb_s": 9.5 if measure else None})
    monkeypatch.setattr(cli, "peak_gflops", lambda dtypes: {"fp32": 42.04})
    assert main(args_for(lab, "--profile", "test", "--only", "01", "--measure-machine")) == 0
    timing = json.loads((lab / "outputs" / "run-test.json").read_text())
    assert timing["machine"] == {"isa": "X", "read_gb_s": 9.5, "peak_gflops_fp32": 42.0}
