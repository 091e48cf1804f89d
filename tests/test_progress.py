"""Progress bars: SPARSEDRAFT_PROGRESS decides, else a watcher (terminal or Jupyter); bars go to stderr only,
and every wired loop returns the same results with bars on or off."""

import io
import sys

import pytest
import torch

from sparsedraft.budgetdraft.config import TrainConfig
from sparsedraft.budgetdraft.evaluate import acceptance_grid
from sparsedraft.budgetdraft.train import train_drafter
from sparsedraft.engine.data import ByteTokenizer
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.prefill import prefill
from sparsedraft.progress import ENV, NullBar, bar, bars_on
from sparsedraft.engine.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


class Terminal(io.StringIO):
    """A stderr that claims to be a terminal and keeps what is written to it."""

    def isatty(self) -> bool:
        return True


def run_with(monkeypatch, capsys, value, call):
    """(result of ``call()``, its stderr) with SPARSEDRAFT_PROGRESS=``value``; nothing may reach stdout."""
    monkeypatch.setenv(ENV, value)
    capsys.readouterr()
    result = call()
    captured = capsys.readouterr()
    assert captured.out == ""
    return result, captured.err


def test_one_forces_a_bar_on_stderr(monkeypatch, capsys):
    items, err = run_with(monkeypatch, capsys, "1", lambda: list(bar(range(3), desc="walk")))
    assert items == [0, 1, 2] and "walk" in err

    def by_hand():
        with bar(total=5, desc="count", unit="tok") as counted:
            counted.update(5)
            counted.set_postfix(loss="1.0")
        return counted

    counted, err = run_with(monkeypatch, capsys, "1", by_hand)
    assert not isinstance(counted, NullBar) and "count" in err and "5/5" in err


def test_zero_forces_no_bar_even_on_a_terminal(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.delenv(ENV, raising=False)
    assert bars_on()  # the terminal alone would show bars
    monkeypatch.setenv(ENV, "0")
    items = range(3)
    assert not bars_on() and bar(items, desc="walk") is items
    with bar(total=3, desc="count") as counted:
        counted.update(3)
        counted.set_postfix(x=1)
    assert isinstance(counted, NullBar) and terminal.getvalue() == ""


def test_unset_shows_on_a_terminal(monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.delenv(ENV, raising=False)
    list(bar(range(3), desc="walk"))
    assert "walk" in terminal.getvalue()


def test_unset_shows_in_an_interactive_ipython_kernel(monkeypatch):
    ipython = pytest.importorskip("IPython")
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setitem(sys.modules, "ipykernel", sys.modules.get("ipykernel", object()))
    monkeypatch.setattr(ipython, "get_ipython", lambda: None)
    assert not bars_on()  # ipykernel imported but no running shell: a plain process
    monkeypatch.setattr(ipython, "get_ipython", lambda: object())
    assert bars_on()


def test_bad_value_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(ENV, "yes")
    for call in (bars_on, lambda: bar(range(3), show=False)):
        with pytest.raises(SparsedraftError, match=r"SPARSEDRAFT_PROGRESS='yes' is not allowed.*=1.*=0.*unset"):
            call()


def test_default_under_pytest_is_off(monkeypatch, capsys):
    monkeypatch.delenv(ENV, raising=False)
    items = range(3)
    assert not bars_on() and bar(items, desc="walk") is items and isinstance(bar(total=3), NullBar)
    assert capsys.readouterr().err == ""


def prefill_logits(model, tokens, chunk):
    """Last prefill logits and the next step's logits (which read the whole cache)."""
    cache = model.new_cache(tokens.shape[1] + 1)
    last = prefill(model, cache, tokens, chunk)
    with torch.inference_mode():
        following = model(last.argmax(-1, keepdim=True), cache=cache)
    return last, following


def test_prefill_bar_over_chunks_changes_nothing(monkeypatch, capsys):
    model = tiny_model("llama")
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    on, err = run_with(monkeypatch, capsys, "1", lambda: prefill_logits(model, tokens, 8))
    assert "prefill:" in err
    off, err = run_with(monkeypatch, capsys, "0", lambda: prefill_logits(model, tokens, 8))
    assert err == ""
    assert all(torch.equal(a, b) for a, b in zip(on, off))
    _, err = run_with(monkeypatch, capsys, "1", lambda: prefill_logits(model, tokens, 64))
    assert err == ""  # one chunk: not worth a bar


def test_acceptance_grid_bars_change_nothing(monkeypatch, capsys):
    verifier = tiny_model("llama", num_hidden_layers=2)
    drafters = {"one-layer": tiny_model("llama", seed=1, num_hidden_layers=1)}

    def grid():
        return acceptance_grid(verifier, drafters, ByteTokenizer(), contexts=(40, 56), budgets=(16, None),
                               new_tokens=8)

    on, err = run_with(monkeypatch, capsys, "1", grid)
    assert "acceptance grid" in err and "acceptance:" in err
    off, err = run_with(monkeypatch, capsys, "0", grid)
    assert err == "" and on.equals(off)


def test_training_bars_change_nothing(monkeypatch, capsys, tmp_path):
    verifier = tiny_model("llama")

    def train(name, progress=True):
        cfg = TrainConfig(verifier="tiny-llama", layers=1, seq_len=32, continuation=8, sequences=2, eval_sequences=0,
                          budgets=(8,), chunk_size=8, obs_window=8, steps=2, warmup=1, eval_every=0, final_context=0,
                          teacher_dir=str(tmp_path / name / "teacher"), out_dir=str(tmp_path / name / "run"))
        result = train_drafter(cfg, verifier, progress=progress)
        history = [{k: v for k, v in entry.items() if k != "seconds"} for entry in result.history]
        return history, result.drafter.state_dict()

    on, err = run_with(monkeypatch, capsys, "1", lambda: train("on"))
    assert "teacher" in err and "train-drafter" in err and "loss_a=" in err
    off, err = run_with(monkeypatch, capsys, "0", lambda: train("off"))
    assert err == ""
    assert on[0] == off[0] and all(torch.equal(on[1][k], off[1][k]) for k in on[1])
    _, err = run_with(monkeypatch, capsys, "1", lambda: train("declined", progress=False))
    assert err == ""  # the caller's progress=False wins over the environment
