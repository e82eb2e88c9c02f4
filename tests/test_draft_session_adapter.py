"""The session-wide DRAFT DEPTH d WITH ADAPTER: later INFER, GENERATE, TRACE, EXPLAIN and DUMP
LOGITS run Draft(d) read through the exit adapter stored for d. Through an identity adapter they
are the bare draft bit for bit; through a fitted one they equal the adapter applied by numpy to
the bare draft's residual; an absent or stale adapter is refused by name, and so is a statement
that would run the bare draft while the session reads through an adapter."""

import json
from pathlib import Path

import numpy as np
import pytest

import lql
import vindex3
from vindex3.container import rewrite_index
from vindex3.draft import store
from vindex3.draft.adapter import ExitAdapter, fit_adapter
from vindex3.exec.engine import small_pass_threads

CORPUS = [list(range(3, 200, 7)), [5, 17, 99, 3, 250, 42, 7, 7, 123, 310, 64, 1, 200, 11]]
IDS = "1, 5, 9, 33, 100, 7"
PROMPT = [1, 5, 9, 33, 100, 7]


@pytest.fixture()
def c(tiny_llama_copy):
    return tiny_llama_copy


def _runs(s: lql.Session, tmp_path: Path, tag: str):
    """TOP logits, a greedy continuation, a trace and a dump of the session's default slice."""
    (top,) = s.execute(f"INFER TOKENS ({IDS}) TOP 5")
    (gen,) = s.execute(f"INFER TOKENS ({IDS}) GENERATE 8 EXACTLY")
    (tr,) = s.execute(f"TRACE TOKENS ({IDS})")
    (dump,) = s.execute(f"DUMP LOGITS TOKENS ({IDS}) INTO '{tmp_path / (tag + '.f32')}'")
    return top, gen, tr, dump


def test_session_draft_through_identity_adapter_is_the_bare_draft_bit_for_bit(c, tmp_path):
    from vindex3.draft.dumps import read_dump

    store.store_adapter(c, ExitAdapter.identity(c, 2))
    bare = lql.connect(c.path)
    bare.execute("DRAFT DEPTH 2")
    b = _runs(bare, tmp_path, "bare")
    s = lql.connect(c.path)
    (d,) = s.execute("DRAFT DEPTH 2 WITH ADAPTER")
    assert d.adapter["key"] == "drafter_adapter_d2" and d.adapter["sha256"] and d.adapter["edge"]["after_layer"] == 1
    assert "read through its exit adapter" in d.to_text() and "'drafter_adapter_d2' (sha256 " in d.to_text()
    a = _runs(s, tmp_path, "adapted")
    assert np.array_equal(a[0]._logits, b[0]._logits)  # h @ I + 0 is h exactly
    assert a[1].generated_ids == b[1].generated_ids
    assert [r.next_id for r in a[2].rows] == [r.next_id for r in b[2].rows]
    assert np.array_equal(read_dump(tmp_path / "adapted.f32")[1], read_dump(tmp_path / "bare.f32")[1])
    # every result names the adapter it read through; the bare ones do not
    for r in a[:3]:
        assert r.slice == "draft depth 2 through exit adapter 'drafter_adapter_d2'"
    assert b[0].slice == "draft depth 2"
    assert a[3].meta["adapter"]["key"] == "drafter_adapter_d2" and "adapter" not in b[3].meta


def test_session_draft_through_a_fitted_adapter_is_the_adapter_applied_to_the_bare_residual(c):
    ad = fit_adapter(c, 2, CORPUS, corpus="toy", ridge=0.5)
    store.store_adapter(c, ad)
    s = lql.connect(c.path)
    s.execute("DRAFT DEPTH 2 WITH ADAPTER")
    (r,) = s.execute(f"INFER TOKENS ({IDS}) TOP 5")
    # numpy: the bare draft's residual at every prompt position (the rows the prefill reads out
    # together), mapped by W and b, read by the draft's own final norm and head
    ex = c.executor(slice=vindex3.Draft(2))
    st = ex.start()
    st.prefill(PROMPT)
    h = np.asarray(st.last_hidden, dtype=np.float32)
    with small_pass_threads():  # BLAS at the thread count the executor's own passes hold it to (same bytes)
        want = ex.readout(h @ ad.W + ad.b)[-1]
    assert np.asarray(r._logits).dtype == np.float32
    assert np.array_equal(np.asarray(r._logits), want)
    (bare,) = s.execute(f"INFER TOKENS ({IDS}) TOP 5 DRAFT DEPTH 2")  # a depth on the statement: the bare draft
    assert bare.slice == "draft depth 2" and not np.array_equal(bare._logits, r._logits)
    # GENERATE through the adapter: each greedy pick is the adapted draft's argmax
    (g,) = s.execute(f"INFER TOKENS ({IDS}) GENERATE 6 EXACTLY")
    st = ex.start()
    ids, picks = list(PROMPT), []
    for _ in range(6):
        if len(ids) == len(PROMPT):
            st.prefill(ids)
        else:
            st.step(ids[-1])
        hl = np.asarray(st.last_hidden, dtype=np.float32)[-1:]
        with small_pass_threads():
            picks.append(int(np.argmax(ex.readout(hl @ ad.W + ad.b)[-1])))
        ids.append(picks[-1])
    assert g.generated_ids == picks


def test_explain_and_stats_name_the_session_adapter(c):
    store.store_adapter(c, fit_adapter(c, 2, CORPUS, corpus="toy", ridge=0.5))
    s = lql.connect(c.path)
    s.execute("DRAFT DEPTH 2 WITH ADAPTER")
    (ex,) = s.execute("EXPLAIN")
    assert ex.adapter["key"] == "drafter_adapter_d2" and ex.adapter["corpus"] == "toy" and ex.adapter["ridge"] == 0.5
    text = ex.to_text()
    assert "plan: draft depth 2 through exit adapter 'drafter_adapter_d2'" in text
    assert "exit adapter: 'drafter_adapter_d2' (sha256 " in text and "ridge 0.5 on" in text
    (ei,) = s.execute(f"EXPLAIN INFER TOKENS ({IDS}) TOP 3")
    assert ei.adapter["key"] == "drafter_adapter_d2"
    (st,) = s.execute("STATS")
    assert st.session_draft["depth"] == 2 and st.session_draft["adapter"]["key"] == "drafter_adapter_d2"
    assert "depth 2 through exit adapter 'drafter_adapter_d2'" in st.to_text()
    s.execute("DRAFT OFF")
    (st,) = s.execute("STATS")
    assert st.session_draft is None and "session draft" not in st.to_text()
    (ex,) = s.execute("EXPLAIN")
    assert ex.adapter is None


def test_session_adapter_refusals_name_what_is_missing(c):
    s = lql.connect(c.path)
    with pytest.raises(lql.LqlError, match="(?s)DRAFT DEPTH 2 WITH ADAPTER: .* stores no exit adapter at depth 2.*"
                                           "FIT ADAPTER AT DEPTH 2"):
        s.execute("DRAFT DEPTH 2 WITH ADAPTER")
    assert s.draft_depth is None and not s.draft_adapter  # a refused statement leaves the session as it was
    store.store_adapter(c, fit_adapter(c, 2, CORPUS, corpus="toy", ridge=0.5))
    s = lql.connect(c.path)
    with pytest.raises(lql.LqlError, match=r"stores no exit adapter at depth 3 \(adapters are stored for depths 2\)"):
        s.execute("DRAFT DEPTH 3 WITH ADAPTER")
    s.execute("DRAFT DEPTH 2 WITH ADAPTER")
    # a statement that would run the bare draft is refused while the session reads through one
    with pytest.raises(lql.LqlError, match="(?s)session's DRAFT DEPTH 2 WITH ADAPTER .* runs the bare draft"):
        s.execute(f"SHOW ATTENTION TOKENS ({IDS}) AT LAYER 0")
    # gone stale since DRAFT DEPTH: refused by name at the next statement that reads it
    derived = json.loads((c.path / "index.json").read_text())["derived"]
    derived["drafter_adapter_d2"]["source_digest"] = "0" * 64
    rewrite_index(c.path, derived=derived)
    s.container.index = json.loads((c.path / "index.json").read_text())
    with pytest.raises(lql.LqlError, match="(?s)INFER \\(the session's DRAFT DEPTH 2 WITH ADAPTER\\): the exit adapter "
                                           "stored as 'drafter_adapter_d2' was fitted on another container \\(stale\\)"):
        s.execute(f"INFER TOKENS ({IDS}) TOP 3")
    s2 = lql.connect(c.path)
    with pytest.raises(lql.LqlError, match="DRAFT DEPTH 2 WITH ADAPTER: the exit adapter .* \\(stale\\)"):
        s2.execute("DRAFT DEPTH 2 WITH ADAPTER")
