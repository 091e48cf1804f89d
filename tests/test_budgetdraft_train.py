"""The training loop on a tiny verifier over byte-tokenised essays: resume, determinism, CLI, --no-teacher."""

import json

import pytest
import torch

from sparsedraft.__main__ import main
from sparsedraft.speculative.loading import load_drafter
from sparsedraft.budgetdraft.config import TrainConfig
from sparsedraft.budgetdraft.train import train_drafter
from sparsedraft.errors import SparsedraftError
from sparsedraft.engine.tiny import tiny_model


class Stop(Exception):
    pass


def config(tmp_path, name, **changes):
    base = dict(verifier="tiny-llama", layers=1, seq_len=64, continuation=16, sequences=4, eval_sequences=1,
                budgets=(16, 32), chunk_size=8, obs_window=16, steps=4, warmup=1, checkpoint_every=2, eval_every=2, final_context=0,
                teacher_dir=str(tmp_path / "teacher"), out_dir=str(tmp_path / name))
    return TrainConfig(**{**base, **changes})


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path):
    verifier = tiny_model("llama")
    straight = train_drafter(config(tmp_path, "a"), verifier, progress=False)

    def crash(entry):
        if entry["step"] == 3:  # after the step-2 checkpoint and one more step that is lost
            raise Stop

    with pytest.raises(Stop):
        train_drafter(config(tmp_path, "b"), verifier, progress=False, callback=crash)
    resumed = train_drafter(config(tmp_path, "b"), verifier, progress=False)
    assert resumed.step == straight.step == 4
    for (name, a), (_, b) in zip(straight.drafter.state_dict().items(), resumed.drafter.state_dict().items()):
        assert torch.equal(a, b), name
    assert [h.get("loss_a") for h in resumed.history] == [h.get("loss_a") for h in straight.history]
    assert [h["step"] for h in straight.history if "eval" in h] == [0, 2]  # the init, then every eval_every
    assert set(straight.final["agreement"]) == {"full", "16", "32"}
    reloaded = load_drafter(tmp_path / "a")
    trained = straight.drafter.state_dict()
    assert all(torch.equal(a, trained[name]) for name, a in reloaded.state_dict().items())


def test_resume_refuses_another_run_and_no_teacher_needs_a_cache(tmp_path):
    verifier = tiny_model("llama")
    train_drafter(config(tmp_path, "a", steps=2), verifier, progress=False)
    with pytest.raises(SparsedraftError, match="different run"):
        train_drafter(config(tmp_path, "a", lam=0.0), verifier, progress=False)
    with pytest.raises(SparsedraftError, match="not cached"):
        train_drafter(config(tmp_path, "c", teacher=False, teacher_dir=str(tmp_path / "empty")), verifier,
                      progress=False)


def test_a_checkpoint_of_another_view_version_is_refused(tmp_path):
    train_drafter(config(tmp_path, "a", steps=1), tiny_model("llama"), progress=False)
    state_file = tmp_path / "a" / "state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({k: v for k, v in state.items() if k != "view_version"}))  # an old run
    with pytest.raises(SparsedraftError, match="view version 1"):
        load_drafter(tmp_path / "a")
    with pytest.raises(SparsedraftError, match="view version 1"):
        train_drafter(config(tmp_path, "a", steps=2), tiny_model("llama"), progress=False)


def test_training_lowers_the_loss_and_the_cli_reports_json(tmp_path, capsys):
    verifier = tiny_model("llama")
    result = train_drafter(config(tmp_path, "long", steps=30, lr=3e-3, eval_every=0, checkpoint_every=30,
                                  final_context=200, final_tokens=16), verifier, progress=False)
    losses = [h["loss_a"] for h in result.history if "loss_a" in h]
    assert sum(losses[-5:]) < sum(losses[:5])
    assert {row["budget"] for row in result.final["acceptance"]} == {16, 32, "full"}
    main(["train-drafter", "--verifier", "tiny-llama", "--layers", "1", "--seq-len", "64", "--continuation", "16",
          "--sequences", "2",
          "--eval-sequences",
          "1", "--budgets", "16", "32", "--steps", "1", "--final-context", "0", "--lam", "0",
          "--teacher-dir", str(tmp_path / "teacher"), "--out-dir", str(tmp_path / "cli")])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["step"] == 1 and last["config"]["lam"] == 0 and last["config"]["budgets"] == [16, 32]


def test_a_drafter_of_another_verifier_or_a_damaged_one_is_refused_before_any_forward(tmp_path, monkeypatch):
    from sparsedraft import decode
    from sparsedraft.speculative.loading import check_drafter_for
    from sparsedraft.engine.model import Transformer
    train_drafter(config(tmp_path, "a", steps=1), tiny_model("llama"), progress=False)
    run = tmp_path / "a"
    state = json.loads((run / "state.json").read_text())
    assert state["verifier"]["source"] == "tiny-llama" and state["verifier"]["vocab_size"] == 256
    check_drafter_for(run, 256, "tiny-qwen2")  # another tiny model: the same byte tokenizer
    other = tiny_model("llama", vocab_size=128)
    prompt = torch.arange(1, 100)[None] % 128

    def refuse(*args, **kwargs):
        raise AssertionError("a forward ran before the drafter was refused")

    monkeypatch.setattr(Transformer, "forward", refuse)
    with pytest.raises(SparsedraftError, match="vocabulary of 256 tokens, this verifier 128.*tiny-llama"):
        decode(other, prompt, "budgetdraft", 4, draft=str(run), budget=16, chunk_size=8)
    state["verifier"]["tokenizer"] = "0" * 16  # as if trained with another tokenizer of the same size
    (run / "state.json").write_text(json.dumps(state))
    with pytest.raises(SparsedraftError, match="tokenizer differs"):
        check_drafter_for(run, 256, "tiny-llama")
    (run / "drafter.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SparsedraftError, match="not readable safetensors"):
        decode(tiny_model("llama"), prompt, "budgetdraft", 4, draft=str(run), budget=16, chunk_size=8)
    (run / "state.json").write_text("{ damaged")
    with pytest.raises(SparsedraftError, match="not readable JSON"):
        decode(tiny_model("llama"), prompt, "budgetdraft", 4, draft=str(run), budget=16, chunk_size=8)


def test_a_drafter_trained_on_key_scored_views_drafts_with_key_scoring_by_default(tmp_path, monkeypatch):
    from sparsedraft import decode
    from sparsedraft.caches.budget import BudgetCache
    verifier = tiny_model("llama")
    train_drafter(config(tmp_path, "keys", steps=1, scoring="keys"), verifier, progress=False)
    used = []
    original = BudgetCache.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        used.append(self.scoring)

    monkeypatch.setattr(BudgetCache, "__init__", spy)
    prompt = torch.arange(1, 100)[None]
    expected = decode(verifier, prompt, "ar", 8).tokens
    for asked, want in (("", "keys"), ("attention", "attention")):
        out = decode(verifier, prompt, "budgetdraft", 8, draft=str(tmp_path / "keys"), budget=16, chunk_size=8,
                     chunk_scoring=asked)
        assert torch.equal(out.tokens, expected) and used[-1] == want
