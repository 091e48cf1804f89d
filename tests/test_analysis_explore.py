"""Notebook 04's sliders: one library call gives the costs, prediction, schedules, sweep and bound they draw."""

import matplotlib

matplotlib.use("Agg")

from pathlib import Path  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import nbformat  # noqa: E402
import pytest  # noqa: E402

from sparsedraft.analysis import (HARDWARE, MODELS, WALKTHROUGH_COSTS, HierarchySetup,  # noqa: E402
                                  acceptance_sweep, build_schedule, explore, explore_figures, predict_ms_per_token,
                                  typical_schedule)
from sparsedraft.analysis.costmodel import level_costs  # noqa: E402
from sparsedraft.errors import SparsedraftError  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "04_cost_walkthrough.ipynb"
SLIDERS = dict(gamma1=2, gamma2=6, alpha1=0.9, alpha2=0.9, context=131072, retrieval_budget=4096,
               hardware="a100-80gb", alpha_tiny=0.6, gamma_pairs=[[1, 3], [2, 6], [4, 8], [2, 12]], alpha_points=11)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def notebook_parameters() -> dict:
    """The values of notebook 04's tagged parameters cell."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    values: dict = {}
    exec(cell.source, values)
    return {k: v for k, v in values.items() if not k.startswith("__")}


@pytest.mark.parametrize("hardware", sorted(HARDWARE))
def test_roofline_costs_are_level_costs_of_the_chosen_setup(hardware):
    args = {**SLIDERS, "hardware": hardware, "context": 32768, "retrieval_budget": 2048}
    view = explore(None, **args)
    setup = HierarchySetup(0.9, 0.9, 0.6, 2, 6, retrieval_budget=2048)
    assert view.source == "roofline"
    assert view.costs == level_costs(MODELS["llama2-7b-128k"], MODELS["llama-68m"], HARDWARE[hardware], 32768, setup)
    assert view.prediction == predict_ms_per_token(view.costs, 2, 6, 0.9, 0.9)


def test_context_moves_the_full_target_only_once_past_the_budget():
    short, long = (explore(None, **{**SLIDERS, "context": c}).costs for c in (16384, 131072))
    assert long.target_ms > short.target_ms
    assert long.retrieval_ms == short.retrieval_ms
    assert long.draft_ms == short.draft_ms
    smaller_budget = explore(None, **{**SLIDERS, "retrieval_budget": 1024}).costs
    assert smaller_budget.retrieval_ms < long.retrieval_ms
    assert smaller_budget.target_ms == long.target_ms


def test_manual_costs_drive_prediction_schedules_and_sweep_but_not_the_bound():
    view = explore(WALKTHROUGH_COSTS, **SLIDERS)
    assert view.source == "manual" and view.costs == WALKTHROUGH_COSTS
    assert view.schedules["all accepted"].vanilla_ms == WALKTHROUGH_COSTS.target_ms
    assert view.sweep.equals(acceptance_sweep(WALKTHROUGH_COSTS, SLIDERS["gamma_pairs"], SLIDERS["alpha_points"]))
    assert view.bound.equals(explore(None, **SLIDERS).bound)


def test_bound_surrounds_the_chosen_context_within_the_target_window():
    view = explore(None, **{**SLIDERS, "context": 8192})
    assert sorted(view.bound.context.unique()) == [1024, 2048, 4096, 8192, 16384, 32768]
    longest = explore(None, **SLIDERS).bound.context
    assert longest.max() == MODELS["llama2-7b-128k"].max_position_embeddings == 131072
    row = view.bound[(view.bound.context == 8192) & (view.bound.method == "triforce")].iloc[0]
    assert row.target_ms == view.costs.target_ms and row.speedup == pytest.approx(view.prediction.speedup)


def test_sweep_adds_the_chosen_pair_once():
    assert explore(None, **SLIDERS).sweep.gammas.nunique() == 4  # (2, 6) is already a curve
    added = explore(None, **{**SLIDERS, "gamma1": 3, "gamma2": 5}).sweep
    assert added.gammas.unique().tolist()[-1] == "γ1=3, γ2=5"
    assert len(added) == 5 * SLIDERS["alpha_points"]


@pytest.mark.parametrize("change, message", [
    ({"hardware": "a100"}, r"unknown hardware 'a100'; pick one of \['a100-80gb'"),
    ({"retrieval_budget": 0}, "retrieval_budget must be >= 1 KV token, got 0"),
    ({"context": 0}, "context must be >= 1 token, got 0"),
    ({"target": "llama3"}, r"unknown target model 'llama3'; pick one of \["),
    ({"alpha_points": 1}, "alpha_points must be >= 2"),
])
def test_bad_slider_values_name_the_problem_and_the_choices(change, message):
    with pytest.raises(SparsedraftError, match=message):
        explore(None, **{**SLIDERS, **change})


def test_schedules_are_build_schedule_with_rounded_expected_outcomes():
    view = explore(WALKTHROUGH_COSTS, **SLIDERS)
    # α = 0.9: a round of two drafts keeps 0.9 + 0.81 ≈ 2; six held tokens keep 0.9 + … + 0.9^6 ≈ 4.2 -> 4
    assert view.schedules["typical"] == build_schedule(WALKTHROUGH_COSTS, 2, 6, (2, 2), 4, name="typical")
    assert view.schedules["all accepted"] == build_schedule(WALKTHROUGH_COSTS, 2, 6, (2, 2), 6, name="all accepted")
    assert view.schedules["all accepted"].total_ms == pytest.approx(85.8)  # the walkthrough's all-pass case
    # nothing accepted: every round hands up one token, level 3 keeps none and adds its own
    rejected = typical_schedule(WALKTHROUGH_COSTS, 2, 6, 0.0, 0.0)
    assert rejected == build_schedule(WALKTHROUGH_COSTS, 2, 6, (0,) * 6, 0, name="typical")
    # overshoot: rounds of three tokens reach gamma2 = 4 at six held
    assert typical_schedule(WALKTHROUGH_COSTS, 2, 4, 1.0, 1.0).table().held.max() == 6


def test_notebook_defaults_give_the_three_figures():
    p = notebook_parameters()
    view = explore(None, gamma1=p["gamma1"], gamma2=p["gamma2"], alpha1=p["alpha1"], alpha2=p["alpha2"],
                   context=max(p["bound_contexts"]), retrieval_budget=HierarchySetup(0.5, 0.5, 0.5).retrieval_budget,
                   hardware=p["bound_hardware"], alpha_tiny=p["alpha_tiny"], gamma_pairs=p["gamma_pairs"],
                   alpha_points=p["alpha_points"])
    figures = explore_figures(view)
    assert list(figures) == ["schedules", "acceptance_sweep", "speedup_vs_context"]
    sweep_labels = [t.get_text() for t in figures["acceptance_sweep"].axes[0].get_legend().texts]
    assert sweep_labels[-1] == f"chosen γ1={p['gamma1']}, γ2={p['gamma2']}"
    context_labels = [t.get_text() for t in figures["speedup_vs_context"].axes[0].get_legend().texts]
    assert context_labels[-1] == f"chosen context {max(p['bound_contexts']):,}"


def test_notebook_slider_cell_redraws_for_both_cost_sources(monkeypatch):
    """Runs notebook 04's code cells in this process with an empty output_dir (no kernel, nothing written),
    as a person opening it would, then flips the cost toggle; the runner never takes this branch."""
    pytest.importorskip("ipywidgets")
    import IPython.display
    from matplotlib.figure import Figure

    from sparsedraft import report
    shown: list = []
    monkeypatch.setattr(IPython.display, "display", lambda *objects: shown.extend(objects))
    monkeypatch.chdir(NOTEBOOK.parent)  # the parameters' relative paths are the notebook's
    namespace: dict = {}
    try:
        for cell in nbformat.read(NOTEBOOK, as_version=4).cells:
            if cell.cell_type == "code":
                exec(cell.source, namespace)
        assert report.output_dir() is None

        def redrawn(start: int) -> tuple[list[str], int]:
            texts = [obj.data for obj in shown[start:] if isinstance(obj, IPython.display.Markdown)]
            return texts, sum(isinstance(obj, Figure) for obj in shown[start:])

        texts, figures = redrawn(0)
        roofline = [text for text in texts if text.startswith("Roofline costs on A100-80GB at 131,072 tokens, 4,096-")]
        assert len(roofline) == 1 and figures >= 3  # the static cells display theirs too
        controls, before = namespace["controls"], len(shown)
        controls["source"].value = "manual"
        assert not any(controls[name].disabled for name in ("draft_ms", "retrieval_ms", "target_ms"))
        texts, figures = redrawn(before)
        assert figures == 3
        assert texts == [texts[0]] and texts[0].startswith("Manual costs: draft 0.45 ms, retrieval 14 ms, target 56 ms")
    finally:
        report.init(None)
