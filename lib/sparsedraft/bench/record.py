"""Results records: every figure the README states traces to one file the measuring code wrote.

A hand-typed number cannot be checked; a number in a file that names its
command, commit, date and machine can be rerun and compared. ``bench ...
--record docs/results/NAME.json`` (:func:`write_record`) writes the bench's
JSON object together with that provenance: the command line, ``git rev-parse
HEAD`` plus whether the tree had uncommitted changes, the UTC date
(:func:`sparsedraft.engine.machine.provenance`), the CPU's best vector path
(:func:`sparsedraft.engine.machine.machine_record`; the C++ kernels are
built with ``-march=native``, so AVX2 and AVX-512 machines run different code) and the
read bandwidth measured in the bench's own process, the floor every speed is
judged against, and the load average, since other jobs on the same cores slow
every figure.

``python -m sparsedraft results`` (:func:`refresh_readme`) rebuilds the
README's results table from every record under ``docs/results/``, between the
two marker comments :data:`BEGIN` and :data:`END`, and its table of run times
(one row per ``reproduce-<profile>.json``, the runner's timing of a whole
profile) between :data:`TIMES_BEGIN` and :data:`TIMES_END`: the one way either
changes. A record missing a field is refused with its path and the field.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

from ..analysis.costmodel import predicted_speedup
from ..engine.machine import machine_record, provenance
from ..errors import SparsedraftError, require
from ..speculative.methods import method_options

RESULTS_DIR = Path("docs/results")
BEGIN = "<!-- results:begin (python -m sparsedraft results) -->"
END = "<!-- results:end -->"
TIMES_BEGIN = "<!-- times:begin (python -m sparsedraft results) -->"
TIMES_END = "<!-- times:end -->"
# Top-level fields a record must hold; ``machine`` and ``result`` must hold theirs.
REQUIRED = ("command", "commit", "dirty", "date", "machine", "result")
MACHINE_REQUIRED = ("isa", "read_gb_s")
# Where a record's result holds its measurements: rows (compare, curve, reproduce, command, kernel timing), runs
# (bench ar: one per dtype), report (bench.agreement); a record needs one of them, non-empty.
RESULT_BODIES = ("rows", "runs", "report")


def write_module_record(path: str | Path, module: str, argv: list[str] | None, result: dict[str, Any],
                        started: dict[str, Any], read_gb_s: float | None = None) -> Path:
    """A ``python -m sparsedraft.bench.<module>`` command's ``--record``: its command line as run, the read
    bandwidth (measured now unless given, and kept in ``result``) and the provenance taken when it started."""
    from ..engine.roofline import measure_read_bandwidth
    if read_gb_s is None:
        read_gb_s = measure_read_bandwidth() / 1e9
    result["read_gb_s"] = read_gb_s
    command = f"python -m sparsedraft.bench.{module} " + shlex.join(argv if argv is not None else sys.argv[1:])
    return write_record(path, result, read_gb_s, command, started)


def finish_module(record: str, module: str, argv: list[str] | None, result: dict[str, Any],
                  started: dict[str, Any], read_gb_s: float | None = None) -> None:
    """How every ``python -m sparsedraft.bench.<module>`` command ends: its record when ``--record`` named one
    (:func:`write_module_record`), then its one JSON line on stdout."""
    if record:
        print(f"record written to {write_module_record(record, module, argv, result, started, read_gb_s)}",
              file=sys.stderr)
    print(json.dumps(result, default=str))


def write_record(path: str | Path, result: dict[str, Any], read_gb_s: float | None = None,
                 command: str | None = None, started: dict[str, Any] | None = None) -> Path:
    """Write ``result`` (a bench's ``to_dict()``) with its provenance to ``path`` as indented JSON.

    ``started`` is :func:`provenance` taken before the run: the code that ran is the commit checked out when it
    started, not when it ended (a long bench outlives commits); taken now when not given."""
    path = Path(path)
    require(path.suffix == ".json", f"a record is a .json file, got {str(path)!r}")
    command = command or "python -m sparsedraft " + shlex.join(sys.argv[1:])
    record = {"command": command, **(started or provenance()), "machine": machine_record(read_gb_s),
              "result": result}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path


def resolved_options(config: Any) -> dict[str, dict[str, Any]]:
    """Every option each of ``config.methods`` ran with, defaults included (row label -> options): the defaults
    belong to the commit that ran, so the record keeps them rather than leave them to a later reader's code."""
    labels = config.labels(config.methods)
    out = {}
    for label, (name, given) in zip(labels, config.methods):
        options = method_options(name, **given)
        out[label] = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    return out


def check_record(record: dict[str, Any], where: str) -> dict[str, Any]:
    """``record`` if it holds every required field, else one error naming the file and the field."""
    for key in REQUIRED:
        require(record.get(key) is not None, f"{where}: record has no {key!r}; rewrite it with bench --record")
    for key in MACHINE_REQUIRED:
        require(record["machine"].get(key) is not None, f"{where}: record has no machine.{key!r}")
    require(any(record["result"].get(body) for body in RESULT_BODIES),
            f"{where}: record's result holds no measurements (none of {', '.join(RESULT_BODIES)})")
    return record


def load_records(folder: str | Path = RESULTS_DIR) -> list[tuple[str, dict[str, Any]]]:
    """(file name, record) for every ``*.json`` in ``folder``, sorted by name, each checked."""
    files = sorted(Path(folder).glob("*.json"))
    return [(f.name, check_record(json.loads(f.read_text()), str(f))) for f in files]


def step_rows(records: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every timed step of every bench record (decode, verify-k, each level's step), one dict each, with its
    record's name, method, date and read bandwidth beside ``ms`` and ``roofline_ms``: "where the time goes",
    set against the machine that measured it. Records without steps (curves, older benches) add nothing."""
    out = []
    for name, record in records:
        result = record["result"]
        for row in [*result.get("rows", []), *result.get("runs", [])]:  # runs: bench ar's, plain decoding
            for step in row.get("steps") or []:
                out.append({"record": name, "method": row.get("method", "ar"), "date": record["date"][:10],
                            "read_gb_s": result.get("read_gb_s", record["machine"].get("read_gb_s")),
                            **{k: step.get(k) for k in ("step", "dtype", "context", "tokens", "ms", "roofline_ms",
                                                        "over_roofline", "bound")}})
    return out


def _acceptance(row: dict[str, Any]) -> str:
    return " / ".join(f"{v:.2f}" for v in row.get("acceptance", {}).values()) or "-"


# Options a results table shows beside the method's name, when the method has them.
SHOWN_OPTIONS = ("draft", "draft_cache", "budget", "gamma", "gamma1", "gamma2", "group_reduce", "draft_vocab",
                 "draft_weights", "draft_kv", "draft_confidence", "draft_lookup")
USUAL = {"group_reduce": "sum", "draft_vocab": 0, "draft_weights": "same", "draft_kv": "same",
         "draft_confidence": 0.0, "draft_lookup": 0.0}  # values not worth a word: defaults


def _shown(key: str, options: dict[str, Any]) -> bool:
    """Whether a table names option ``key``: it is set, not a default, and not spec's budget beside a
    draft cache that has none."""
    if key not in options or USUAL.get(key, object()) == options[key]:
        return False
    return not (key == "budget" and options.get("draft_cache") in ("full", "streaming"))


def _options(row: dict[str, Any], resolved: dict[str, dict[str, Any]]) -> str:
    options = resolved.get(row["method"])
    if options is None:  # a record from before options were resolved: the ones given
        return ", ".join(f"{k} {v}" for k, v in row.get("options", {}).items())
    return ", ".join(f"{k} {options[k]}" for k in SHOWN_OPTIONS if _shown(k, options))


def _predicted(row: dict[str, Any], options: dict[str, Any] | None, batch: int) -> str:
    """" (model N.NNx)" beside a measured speedup: the record's own prediction, or for a record from before
    compare stored one, the same cost model over the parts it kept (its resolved gammas, timed regions, counts
    and rounds); empty where there is none (a batch, a run without drafts, a record without resolved options)."""
    value = row.get("predicted_speedup")
    if "predicted_speedup" not in row and batch == 1 and options and row.get("rounds"):
        value = predicted_speedup(options, row["seconds"], row["drafted"], row["verifications"], row["rounds"],
                                  row["decode_s"], row["ms_per_token"] * row["speedup"])
    return f" (model {value:.2f}x)" if value else ""


def _compare_rows(name: str, record: dict[str, Any]) -> list[list[str]]:
    result, m = record["result"], record["machine"]
    resolved = result.get("resolved_options", {})
    c = result["config"]
    base = result["rows"][0]
    threads = m.get("torch_threads")
    threads = f", {threads} thread{'s' if threads != 1 else ''}" if threads else ""
    load = f", load {m['load_1min']:.1f}" if m.get("load_1min") is not None else ""
    out = []
    for row in result["rows"][1:]:
        match = {True: "yes", False: "**no**", None: "-"}[row.get("tokens_match")]
        law = "greedy" if c["temperature"] == 0 else f"T {c['temperature']}, top-p {c['top_p']}"
        options = _options(row, resolved)
        dtype = c.get("dtype", "fp32")  # the model cell names a dtype other than fp32 (records before it: fp32)
        window = c.get("variant", 0)  # the context cell names the prompt when it is not its split's first window
        method = row["method"].split("(")[0]  # a method listed twice is labelled with its options, shown here anyway
        out.append([f"{method} ({options})" if options else row["method"],
                    c["model"] if dtype == "fp32" else f"{c['model']} {dtype}",
                    f"{result['prompt_len']:,}" + (f" (window {window})" if window else ""),
                    f"{c['new_tokens']} {law}", f"{base['ms_per_token']:.1f}",
                    f"{row['ms_per_token']:.1f}",
                    f"**{row['speedup']:.2f}x**{_predicted(row, resolved.get(row['method']), c.get('batch', 1))}",
                    _acceptance(row), match,
                    f"{record['date'][:10]}, {record['commit'][:7]}{'+' if record['dirty'] else ''}",
                    f"{m['isa']}{threads}, {m['read_gb_s']:.1f} GB/s{load}", f"[{name}](docs/results/{name})"])
    return out


def _curve_rows(name: str, record: dict[str, Any]) -> list[list[str]]:
    """A notebook run's record (:mod:`sparsedraft.runner.results`: notebook 05's curve, notebook 06's timed runs):
    each row carries its own context and AR time, and the cost model's prediction beside the speedup where the
    notebook made one."""
    m, result = record["machine"], record["result"]
    threads = m.get("torch_threads")
    threads = f", {threads} thread{'s' if threads != 1 else ''}" if threads else ""
    out = []
    for row in result["rows"]:
        match = {True: "yes", False: "**no**", None: "-"}[row.get("tokens_match")]
        options = ", ".join(f"{k} {v}" for k, v in row["options"].items())
        predicted = f" (model {row['predicted_speedup']:.2f}x)" if row.get("predicted_speedup") else ""
        read = row.get("read_gb_s") or m["read_gb_s"]
        out.append([f"{row['method']} ({options})", result["model"], f"{row['context']:,}",
                    f"{row['tokens']} greedy", f"{row['ar_ms_per_token']:.1f}", f"{row['ms_per_token']:.1f}",
                    f"**{row['speedup']:.2f}x**{predicted}", _acceptance(row), match,
                    f"{record['date'][:10]}, {record['commit'][:7]}{'+' if record['dirty'] else ''}",
                    f"{m['isa']}{threads}, {read:.1f} GB/s", f"[{name}](docs/results/{name})"])
    return out


RENDERERS: dict[str, Callable[[str, dict[str, Any]], list[list[str]]]] = {"compare": _compare_rows,
                                                                          "curve": _curve_rows, "speed": _curve_rows}
HEADER = ["method (options)", "model", "context", "tokens", "AR ms/tok", "method ms/tok", "speedup",
          "acceptance (per level)", "tokens = AR", "date, commit", "machine: ISA, torch threads, read, load", "record"]


def render_table(records: list[tuple[str, dict[str, Any]]]) -> str:
    """A markdown table, one line per method row of every compare record (other benches are skipped)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for name, record in records:
        for cells in RENDERERS.get(record["result"].get("bench"), lambda *_: [])(name, record):
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


TIMES_HEADER = ["profile or command", "wall", "per notebook (or exit status)", "peak RSS", "date, commit", "machine: ISA, read, fp32 peak",
                "record"]


def render_times(records: list[tuple[str, dict[str, Any]]]) -> str:
    """A markdown table, one line per reproduce record (the whole profile's wall time, each notebook's, peak RSS)
    and per timed command (``make test``, ``make reproduce`` on a fresh clone: wall time, exit status, peak RSS)."""
    lines = ["| " + " | ".join(TIMES_HEADER) + " |", "|" + "---|" * len(TIMES_HEADER)]
    for name, record in records:
        result, m = record["result"], record["machine"]
        if result.get("bench") == "command":
            lines.append(_command_row(name, record))
        if result.get("bench") != "reproduce":
            continue
        each = ", ".join(f"{row['notebook'][:2]} {row['wall_s']:.0f} s" + ("" if row["status"] == "ok" else
                                                                            f" ({row['status']})")
                         for row in result["rows"])
        peak = f", {m['peak_gflops_fp32']:.0f} GFLOP/s" if m.get("peak_gflops_fp32") else ""
        lines.append(f"| `{result['profile']}` | {result['wall_s'] / 60:.0f} min | {each} | "
                     f"{result['peak_rss_mb'] / 1024:.1f} GB | {record['date'][:10]}, {record['commit'][:7]}"
                     f"{'+' if record['dirty'] else ''} | {m['isa']}, {m['read_gb_s']:.1f} GB/s{peak} | "
                     f"[{name}](docs/results/{name}) |")
    return "\n".join(lines)


def _command_row(name: str, record: dict[str, Any]) -> str:
    """A run-times line for a whole command timed by :mod:`.timed_command` (``make test`` on a fresh clone)."""
    result, m = record["result"], record["machine"]
    run = result["rows"][0]
    label = f" ({result['label']})" if result.get("label") else ""
    return (f"| `{record['command']}`{label} | {run['wall_s'] / 60:.0f} min | exit status {run['rc']} | "
            f"{run['peak_rss_mb'] / 1024:.1f} GB | {record['date'][:10]}, {record['commit'][:7]}"
            f"{'+' if record['dirty'] else ''} | {m['isa']}, {m['read_gb_s']:.1f} GB/s | [{name}](docs/results/{name}) |")


def _replace_between(text: str, begin: str, end: str, body: str, where: Path) -> str:
    if begin not in text or end not in text or text.index(begin) > text.index(end):
        raise SparsedraftError(f"{where} lacks the markers {begin!r} ... {end!r}; put them where the table goes")
    head, rest = text.split(begin, 1)
    return f"{head}{begin}\n{body}\n{end}{rest.split(end, 1)[1]}"


def refresh_readme(readme: str | Path = "README.md", folder: str | Path = RESULTS_DIR) -> str:
    """Replace the text between :data:`BEGIN` and :data:`END` in ``readme`` by the results table of ``folder``'s
    records, and the text between :data:`TIMES_BEGIN` and :data:`TIMES_END` by their run times; the results
    table is returned."""
    readme = Path(readme)
    records = load_records(folder)
    table = render_table(records)
    text = _replace_between(readme.read_text(), BEGIN, END, table, readme)
    readme.write_text(_replace_between(text, TIMES_BEGIN, TIMES_END, render_times(records), readme))
    return table
