"""Per-context bench defaults: the tuned table fills only the options a user left off, at the right context."""

import pytest

import sparsedraft.bench.tuned as tuned
from sparsedraft import METHODS
from sparsedraft.__main__ import bench_config, build_parser, tuned_note
from sparsedraft.bench.tuned import tuned_context, tuned_options

TABLE = {"triforce": {8000: {"budget": 512, "gamma1": 2, "gamma2": 6},
                      16000: {"budget": 2048, "gamma1": 4, "gamma2": 8}},
         "retrieval": {16000: {"budget": 1024, "gamma": 8}}}


@pytest.fixture
def table(monkeypatch):
    monkeypatch.setattr(tuned, "TUNED", TABLE)


def options_of(*argv):
    return bench_config(build_parser().parse_args(["bench", *argv])).methods[0][1]


def test_the_largest_tuned_context_at_or_below_applies(table):
    assert tuned_context("triforce", 7999) is None and tuned_options("triforce", 7999) == {}
    assert tuned_context("triforce", 8000) == 8000
    assert tuned_context("triforce", 15999) == 8000
    assert tuned_options("triforce", 32000) == TABLE["triforce"][16000]
    assert tuned_options("spec", 32000) == {}  # no tuned row for other methods
    assert tuned_options("retrieval", 8000) == {}


def test_bench_takes_tuned_defaults_and_given_flags_win(table):
    assert options_of("triforce", "--context", "20000") == TABLE["triforce"][16000]
    assert options_of("triforce", "--context", "9000") == TABLE["triforce"][8000]
    assert options_of("triforce", "--context", "20000", "--budget", "1024", "--draft", "truncated:2") == {
        "budget": 1024, "gamma1": 4, "gamma2": 8, "draft": "truncated:2"}
    assert options_of("retrieval", "--context", "16000") == {"budget": 1024, "gamma": 8}


def test_below_the_tuned_contexts_only_given_flags_are_passed(table):
    assert options_of("triforce", "--context", "4000") == {}
    assert options_of("triforce", "--context", "4000", "--gamma2", "5") == {"gamma2": 5}


def test_the_bench_names_only_the_options_the_table_filled_in(table):
    def note(*argv):
        args = build_parser().parse_args(["bench", *argv])
        return tuned_note(args, bench_config(args))
    assert note("triforce", "--context", "20000", "--budget", "1024").endswith("{'gamma1': 4, 'gamma2': 8}")
    assert note("triforce", "--context", "20000", "--budget", "1024", "--gamma1", "2", "--gamma2", "6") == ""
    assert note("triforce", "--context", "4000") == ""


def test_shipped_table_is_valid_options_at_increasing_contexts():
    for method, rows in tuned.TUNED.items():
        assert method in METHODS
        for context, options in rows.items():
            assert context > 0 and options, (method, context)
            METHODS[method].options(**options)  # a misspelt or invalid option fails here
