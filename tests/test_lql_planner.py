"""The planner: a statement and a catalog view of the container in, a typed plan node out, and
no model run (an executor being prepared fails the test). EXPLAIN INFER shows the very node
INFER runs: the same slice plan object, the same reads, the same layers."""

from __future__ import annotations

import lql_fixtures  # noqa: F401
import pytest

import lql
from lql import catalog as catalog_mod
from lql import planner
from lql.binding import Catalog
from lql.errors import EngineRefusal, NoContainer, StatementError
from lql.parser import parse_one
from lql.statements import drafts, infer
from lql.statements.settings import SetSetting


@pytest.fixture
def catalog(tiny_llama_container, monkeypatch):
    import vindex3

    c = vindex3.open(tiny_llama_container)

    def no_run(*a, **kw):
        raise AssertionError("the planner prepared an executor")

    monkeypatch.setattr(type(c), "executor", no_run)
    return Catalog(c)


def plan(text: str, catalog: Catalog | None, **settings) -> planner.Node:
    ctx = planner.Context(catalog=catalog, draft_depth=settings.pop("draft_depth", None),
                          settings=catalog_mod.Settings(**settings))
    return planner.plan(parse_one(text), ctx)


def test_infer_binds_slice_prompt_and_mode(catalog):
    node = plan("INFER 'Water boils' TOP 3 DRAFT DEPTH 2", catalog)
    assert isinstance(node, infer.Run)
    assert node.slice.depth == 2 and node.slice.executed_layers == [0, 1]
    assert node.prompt.ids == tuple(catalog.container.tokenizer.encode("Water boils"))
    assert (node.top, node.generate, node.exactly) == (3, None, False)


def test_infer_takes_the_session_defaults(catalog):
    node = plan("INFER TOKENS (1, 2)", catalog, draft_depth=3, top=7)
    assert node.slice.depth == 3 and node.top == 7 and node.prompt.ids == (1, 2)
    node = plan("INFER TOKENS (1, 2) GENERATE 4", catalog)
    assert node.top is None and node.generate == 4


def test_generate_stops_at_the_declared_end_of_sequence_unless_exactly(catalog):
    eos = catalog.eos_ids()
    assert eos == (catalog.container.tokenizer.eos_id,)
    assert plan("INFER 'x' GENERATE 4", catalog).stop_ids == eos
    assert plan("INFER 'x' GENERATE 4 EXACTLY", catalog).stop_ids == ()


def test_speculate_binds_both_slices(catalog):
    node = plan("INFER 'x' GENERATE 8 SPECULATE DEPTH 1 LOOKAHEAD 3", catalog)
    assert isinstance(node, infer.Speculate)
    assert node.draft.executed_layers == [0] and node.target.executed_layers == [0, 1, 2, 3]
    assert (node.lookahead, node.generate) == (3, 8)


def test_explain_infer_wraps_the_node_infer_would_run(catalog):
    node = plan("EXPLAIN INFER 'Water' TOP 2 DRAFT DEPTH 1", catalog)
    assert isinstance(node, infer.ExplainPlan) and isinstance(node.target, infer.Run)
    assert node.slice is node.target.slice  # one slice plan object, shown and run
    assert node.target.top == 2 and node.slice.executed_layers == [0]


def test_show_and_set_nodes(catalog, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"id": "a", "category": "c", "text": "x"}\n')
    assert plan("SHOW LAYERS RANGE 1-2", catalog).layers == (1, 2)
    assert plan("SHOW LAYERS", catalog).layers == (0, 1, 2, 3)
    node = plan("SET expanded = auto", None)
    assert isinstance(node, SetSetting) and node.value == "auto"
    assert isinstance(plan("DRAFT OFF", None), drafts.SetDraft)
    assert plan("DRAFT LADDER DEPTHS (1, 4) ON 'p.jsonl' PLOT INTO 'c.svg'", catalog).plot == "c.svg"


@pytest.mark.parametrize("text,kind", [
    ("DRAFT DEPTH 0", EngineRefusal), ("INFER 'x' DRAFT DEPTH 0", EngineRefusal), ("EXPLAIN DRAFT DEPTH 9", EngineRefusal),
    ("SHOW LAYERS RANGE 0-4", StatementError), ("INFER TOKENS (1, 320)", StatementError),
    ("INFER 'x' LOOKAHEAD 2", StatementError),
])
def test_refusals_are_decided_by_the_planner(catalog, text, kind):
    from lql.binding import engine_refusal, is_engine_error

    try:
        plan(text, catalog)
    except Exception as e:  # noqa: BLE001 - the session turns vindex3's errors into EngineRefusal
        err = engine_refusal(e) if is_engine_error(e) else e
        assert isinstance(err, kind), err
    else:
        pytest.fail(f"{text} was planned")


def test_unbound_refusals_come_after_the_checks_that_need_no_model():
    with pytest.raises(StatementError, match="TOP must be at least 1"):
        plan("INFER 'x' TOP 0", None)
    with pytest.raises(NoContainer):
        plan("INFER 'x' TOP 1", None)


def test_chat_needs_a_template_and_text(catalog):
    with pytest.raises(StatementError, match="carries none"):
        plan("INFER 'x' CHAT", catalog)
    with pytest.raises(StatementError, match="TOKENS"):
        plan("INFER TOKENS (1) CHAT", catalog)


def test_session_plan_runs_nothing(tiny_llama_container):
    s = lql.connect(tiny_llama_container)
    node = s.plan("INFER 'Hi' GENERATE 3")
    assert isinstance(node, infer.Run) and s._executors == {}


@pytest.mark.parametrize("infer", ["INFER 'Water boils' TOP 3", "INFER 'Water boils' TOP 3 DRAFT DEPTH 2",
                                   "INFER TOKENS (1, 44, 73) GENERATE 3 DRAFT DEPTH 1"])
def test_explain_infer_reports_what_infer_runs(tiny_llama_container, infer):
    """The reads EXPLAIN plans are the reads the executor made; the layers it lists ran."""
    s = lql.connect(tiny_llama_container)
    explained = s.execute_one(f"EXPLAIN {infer}")
    ran = s.execute_one(infer)
    assert ran.prepared_reads is not None  # this INFER prepared its executor
    assert explained.reads.total_reads == ran.prepared_reads
    assert explained.reads.total_bytes == ran.prepared_bytes
    assert explained.executed_layers == ran.executed_layers
    assert explained.prompt.ids == ran.prompt.ids
