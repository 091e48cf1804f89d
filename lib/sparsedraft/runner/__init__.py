"""Notebook runner internals: planning (:mod:`.config`), execution (:mod:`.execute`), index (:mod:`.index`).

The command line is ``python -m sparsedraft run`` (:mod:`.cli`).
"""

from .config import NotebookRun, RunConfig, plan, run_id
from .execute import RunOutcome, execute, is_finished
from .index import latest_results, write_index

__all__ = ["NotebookRun", "RunConfig", "RunOutcome", "execute", "is_finished", "latest_results", "plan", "run_id",
           "write_index"]
