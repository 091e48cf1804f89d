"""``python -m sparsedraft.runner.worker SPEC_JSON``: one notebook run in a process of its own.

The local-parallel and Ray backends start this module once per run
(:func:`sparsedraft.runner.backends.launch`), so a crashing kernel or
interpreter takes down one run, and everything the run prints, papermill's
log included, lands in its ``run.log``. The spec is the JSON of
:func:`run_spec`; the exit status is 0 when the notebook finished, 1 when it
failed (``run.json`` says why).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .config import NotebookRun
from .execute import execute


def run_spec(run: NotebookRun, timeout_s: int | None, threads: int | None, log_output: bool,
             progress_bar: bool) -> dict[str, Any]:
    """Everything a worker needs to execute ``run``, as JSON-ready values (paths absolute)."""
    return {"notebook": str(run.notebook.resolve()), "profile": run.profile, "parameters": run.parameters,
            "outputs_dir": str(run.outputs_dir.resolve()), "reads_outputs": run.reads_outputs,
            "kernel": run.kernel, "timeout_s": timeout_s, "threads": threads, "log_output": log_output,
            "progress_bar": progress_bar}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    run = NotebookRun(Path(spec["notebook"]), spec["profile"], spec["parameters"], Path(spec["outputs_dir"]),
                      spec["reads_outputs"], spec["kernel"])
    outcome = execute(run, force=True, timeout_s=spec["timeout_s"], threads=spec["threads"],
                      log_output=spec["log_output"], progress_bar=spec["progress_bar"], log_file=False)
    if outcome.error:
        print(f"run failed: {outcome.error}", file=sys.stderr)
    return 0 if outcome.status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
