"""Drafter components stored in the container: an exit adapter and a vocabulary cut written as
derived representations with provenance, listed without reading a file, read back bit for bit,
and refused by name when absent, fitted on another container, or damaged."""

import json

import numpy as np
import pytest

import vindex3
from vindex3.container import rewrite_index
from vindex3.draft import store
from vindex3.draft.adapter import fit_adapter
from vindex3.draft.vocab import fit_vocab_cut
from vindex3.errors import DerivedStale, VindexError

CORPUS = [list(range(3, 200, 7)), [5, 17, 99, 3, 250, 42, 7, 7, 123, 310, 64, 1, 200, 11]]


@pytest.fixture()
def c(tiny_llama_copy):
    return tiny_llama_copy


def test_adapter_round_trips_through_the_container(c):
    a = fit_adapter(c, 2, CORPUS, corpus="toy", ridge=0.5)
    digest = c.digest
    entry = store.store_adapter(c, a)
    assert entry["role"] == "drafter" and entry["edge"] == {"kind": "hidden_state", "component": "primary_text",
                                                            "after_layer": 1, "depth": 2}
    again = vindex3.open(c.path)  # read back at OPEN: listed from index.json, no file read
    assert again.digest == digest
    (row,) = store.components(again)
    assert row["key"] == "drafter_adapter_d2" and row["fresh"] and row["params"]["corpus"] == "toy"
    assert any(d.key == "drafter_adapter_d2" and d.fresh for d in again.derived)  # SHOW REPRESENTATIONS lists it
    b = store.load_adapter(again, 2)
    assert np.array_equal(b.W, a.W) and np.array_equal(b.b, a.b) and b.facts == a.facts


def test_vocab_cut_round_trips_through_the_container(c):
    cut = fit_vocab_cut(c, 40, CORPUS, corpus="toy")
    store.store_vocab_cut(c, cut, depth=1)
    got = store.load_vocab_cut(vindex3.open(c.path), 40)
    assert got == cut


def test_absent_stale_and_damaged_components_are_refused_by_name(c):
    with pytest.raises(VindexError, match="(?s)stores no exit adapter at depth 3.*FIT ADAPTER AT DEPTH 3"):
        store.load_adapter(c, 3)
    store.store_adapter(c, fit_adapter(c, 2, CORPUS, corpus="toy", ridge=1e-2))
    # another container's digest in the entry: stale
    derived = json.loads((c.path / "index.json").read_text())["derived"]
    derived["drafter_adapter_d2"]["source_digest"] = "0" * 64
    rewrite_index(c.path, derived=derived)  # resealed: only the provenance changed
    with pytest.raises(DerivedStale, match="derived from container 000000000000"):
        store.load_adapter(vindex3.open(c.path), 2)
    store.store_adapter(c, fit_adapter(c, 2, CORPUS, corpus="toy", ridge=1e-2))
    f = c.path / "derived/drafters/drafter_adapter_d2.npz"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(DerivedStale, match="differs from the SHA-256"):
        store.load_adapter(vindex3.open(c.path), 2)


def test_lql_fit_adapter_stores_a_drafter_component(c, tmp_path):
    import lql

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"token_ids": t}) for t in CORPUS) + "\n")
    s = lql.connect(c.path)
    (r,) = s.execute(f"FIT ADAPTER AT DEPTH 2 ON '{corpus}' RIDGE 0.5")
    assert r.kind == "fit_adapter" and r.key == "drafter_adapter_d2" and r.facts["corpus"] == "corpus.jsonl"
    assert "stored as drafter component 'drafter_adapter_d2'" in r.to_text()
    want = fit_adapter(c, 2, CORPUS, corpus="corpus.jsonl", ridge=0.5)
    got = store.load_adapter(vindex3.open(c.path), 2)
    assert np.array_equal(got.W, want.W) and np.array_equal(got.b, want.b)
    (rep,) = s.execute("SHOW REPRESENTATIONS")
    assert "drafter_adapter_d2" in rep.to_text()
    with pytest.raises(lql.LqlError, match="deeper than the model"):
        s.execute("FIT ADAPTER AT DEPTH 9")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"words": 3}\n')
    with pytest.raises(Exception, match="line 1 holds neither"):
        s.execute(f"FIT ADAPTER AT DEPTH 2 ON '{bad}'")


def test_speculation_reads_the_stored_adapter(c):
    from vindex3.draft import greedy_generate, speculative_generate

    prompt = [1, 5, 9, 33, 100, 7]
    with pytest.raises(VindexError, match="stores no exit adapter at depth 2"):
        speculative_generate(c, prompt, 8, 2, 3, adapter="stored")
    store.store_adapter(c, fit_adapter(c, 2, CORPUS, corpus="toy", ridge=1e-2))
    r = speculative_generate(c, prompt, 12, 2, 3, adapter="stored")
    assert r.adapter and r.tokens == greedy_generate(c, prompt, 12).tokens


def test_tuned_lens_through_identity_adapters_is_the_logit_lens(c):
    # tuned-lens readout through identity adapters (h @ I + 0 is h exactly) gives the logit lens's
    # rows bit for bit at the last position: the same residuals, and both read them with the
    # head's rows kernel (at most 8 rows a call, each row's arithmetic independent of the others)
    import lql
    from vindex3.draft.adapter import ExitAdapter

    s = lql.connect(c.path)
    with pytest.raises(lql.LqlError, match="stores no exit adapter"):
        s.execute("TRACE TOKENS (1, 5, 9, 33) FOR 7 LENS TUNED")
    for d in range(1, c.graph.num_layers + 1):
        store.store_adapter(c, ExitAdapter.identity(c, d))
    s = lql.connect(c.path)
    (plain,) = s.execute("TRACE TOKENS (1, 5, 9, 33) FOR 7")
    (tuned,) = s.execute("TRACE TOKENS (1, 5, 9, 33) FOR 7 LENS TUNED")
    assert tuned.lens == "tuned" and "tuned lens" in tuned.to_text()
    want = [x for x in plain.rows if x.layer is not None]
    assert [(x.layer, x.position, x.rank, x.logit, x.top_id) for x in tuned.rows] == \
        [(x.layer, x.position, x.rank, x.logit, x.top_id) for x in want]
    (every,) = s.execute("TRACE TOKENS (1, 5, 9, 33) FOR 7 POSITIONS ALL LENS TUNED")
    assert [(x.layer, x.position) for x in every.rows] == [(i, p) for i in range(4) for p in range(4)]


def test_tuned_lens_refuses_what_it_cannot_read(c):
    import lql

    store.store_adapter(c, fit_adapter(c, 2, CORPUS, corpus="toy", ridge=1e-2))
    s = lql.connect(c.path)
    (r,) = s.execute("TRACE TOKENS (1, 5, 9, 33) FOR 7 LENS TUNED")
    assert [x.layer for x in r.rows] == [1]
    with pytest.raises(lql.LqlError, match="layer 0 has no stored exit adapter"):
        s.execute("TRACE TOKENS (1, 5, 9, 33) FOR 7 LAYERS 0-1 LENS TUNED")
    with pytest.raises(lql.LqlError, match="does not run DRAFT DEPTH 2"):
        s.execute("TRACE TOKENS (1, 5, 9, 33) FOR 7 DRAFT DEPTH 2 LENS TUNED")


def test_lql_speculate_with_adapter_reads_the_stored_component(c):
    # SPECULATE DEPTH d WITH ADAPTER: the draft's head reads the residual through the adapter
    # stored for d; absent is refused by name at planning (EXPLAIN too), the tokens equal greedy
    # and the result and EXPLAIN INFER name the component
    import lql

    s = lql.connect(c.path)
    q = "INFER TOKENS (1, 5, 9, 33, 100, 7) GENERATE 12 SPECULATE DEPTH 2 WITH ADAPTER LOOKAHEAD 3"
    for stmt in (q, "EXPLAIN " + q):
        with pytest.raises(lql.LqlError, match="(?s)stores no exit adapter at depth 2.*FIT ADAPTER AT DEPTH 2"):
            s.execute(stmt)
    store.store_adapter(c, fit_adapter(c, 2, CORPUS, corpus="toy", ridge=0.5))
    s = lql.connect(c.path)
    with pytest.raises(lql.LqlError, match="stores no exit adapter at depth 3 \\(adapters are stored for depths 2\\)"):
        s.execute(q.replace("DEPTH 2", "DEPTH 3"))
    (plain,) = s.execute("INFER TOKENS (1, 5, 9, 33, 100, 7) GENERATE 12")
    (r,) = s.execute(q)
    assert r.generated_ids == plain.generated_ids and r.matches_plain is True
    assert r.adapter["key"] == "drafter_adapter_d2" and r.adapter["corpus"] == "toy" and r.adapter["ridge"] == 0.5
    assert r.adapter["edge"]["after_layer"] == 1
    assert "through exit adapter 'drafter_adapter_d2'" in r.to_text()
    (bare,) = s.execute(q.replace(" WITH ADAPTER", ""))
    assert bare.adapter is None and bare.generated_ids == plain.generated_ids
    # the adapter changes what the draft proposes: a different acceptance than the bare draft's is
    # not asserted (it may coincide on a toy model), only that the draft ran through it
    (ex,) = s.execute("EXPLAIN " + q)
    assert "through the exit adapter stored as drafter component 'drafter_adapter_d2'" in ex.to_text()
    # with a vocabulary cut, in either order
    for tail in ("WITH ADAPTER VOCAB TOP 64", "VOCAB TOP 64 WITH ADAPTER"):
        (both,) = s.execute(f"INFER TOKENS (1, 5, 9, 33, 100, 7) GENERATE 12 SPECULATE DEPTH 2 {tail} LOOKAHEAD 3")
        assert both.generated_ids == plain.generated_ids and both.vocab_top == 64
        assert both.adapter["key"] == "drafter_adapter_d2"
        assert "(through exit adapter 'drafter_adapter_d2', head over the 64 most frequent tokens)" in both.to_text()
    with pytest.raises(lql.LqlError, match="syntax error"):
        s.execute("INFER TOKENS (1, 2) GENERATE 4 SPECULATE DRAFTER LOOKUP WITH ADAPTER")


def test_lql_speculate_with_a_damaged_adapter_is_refused_by_name(c):
    import lql

    store.store_adapter(c, fit_adapter(c, 2, CORPUS, corpus="toy", ridge=1e-2))
    f = c.path / "derived/drafters/drafter_adapter_d2.npz"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    s = lql.connect(c.path)
    with pytest.raises(Exception, match="differs from the SHA-256"):
        s.execute("INFER TOKENS (1, 5, 9) GENERATE 4 SPECULATE DEPTH 2 WITH ADAPTER")
    derived = json.loads((c.path / "index.json").read_text())["derived"]
    derived["drafter_adapter_d2"]["source_digest"] = "0" * 64
    rewrite_index(c.path, derived=derived)
    with pytest.raises(lql.LqlError, match="(?s)fitted on another container \\(stale\\).*FIT ADAPTER AT DEPTH 2"):
        lql.connect(c.path).execute("EXPLAIN INFER TOKENS (1, 5, 9) GENERATE 4 SPECULATE DEPTH 2 WITH ADAPTER")


def test_lql_fit_vocab_cut_is_what_speculate_vocab_top_reads(c, tmp_path):
    # FIT VOCAB CUT TOP k stores the cut; SPECULATE ... VOCAB TOP k then reads it (not the seed
    # list's count), names it, and its tokens still equal greedy; a stale stored cut is refused
    import lql
    from vindex3.draft.seeds import SEED_TEXTS

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"token_ids": t}) for t in CORPUS) + "\n")
    s = lql.connect(c.path)
    q = "INFER TOKENS (1, 5, 9, 33, 100, 7) GENERATE 12 SPECULATE DEPTH 2 VOCAB TOP 40 LOOKAHEAD 3"
    (plain,) = s.execute("INFER TOKENS (1, 5, 9, 33, 100, 7) GENERATE 12")
    (seeded,) = s.execute(q)  # none stored: counted on the seed list, as before
    assert seeded.vocab_cut["corpus"] == "seeds" and seeded.vocab_cut["stored"] is None
    (r,) = s.execute(f"FIT VOCAB CUT TOP 40 ON '{corpus}'")
    assert r.kind == "fit_vocab_cut" and r.key == "drafter_vocab_top40" and r.facts["corpus"] == "corpus.jsonl"
    assert "stored as drafter component 'drafter_vocab_top40'" in r.to_text()
    got = store.load_vocab_cut(vindex3.open(c.path), 40)
    assert got == fit_vocab_cut(c, 40, CORPUS, corpus="corpus.jsonl")
    s = lql.connect(c.path)
    (sp,) = s.execute(q)
    assert sp.generated_ids == plain.generated_ids and sp.matches_plain is True
    assert sp.vocab_cut["stored"] == "drafter_vocab_top40" and sp.vocab_cut["corpus"] == "corpus.jsonl"
    assert "head over the 40 most frequent tokens of 'drafter_vocab_top40'" in sp.to_text()
    (ex,) = s.execute("EXPLAIN " + q)
    assert "(stored as drafter component 'drafter_vocab_top40')" in ex.to_text()
    (other,) = s.execute(q.replace("TOP 40", "TOP 41"))  # another k: its own count on the seed list
    assert other.vocab_cut["stored"] is None and other.vocab_cut["texts"] == len(SEED_TEXTS)
    (r,) = s.execute("FIT VOCAB CUT TOP 40")  # default corpus: the seed list, replacing the stored one
    assert r.facts["corpus"] == "seeds"
    for bad, needle in [("FIT VOCAB CUT TOP 0", "at least 1"), ("FIT VOCAB CUT TOP 100000", "more than the vocabulary")]:
        with pytest.raises(lql.LqlError, match=needle):
            s.execute(bad)
    derived = json.loads((c.path / "index.json").read_text())["derived"]
    derived["drafter_vocab_top40"]["source_digest"] = "0" * 64
    rewrite_index(c.path, derived=derived)
    with pytest.raises(lql.LqlError, match="(?s)counted on another container \\(stale\\).*FIT VOCAB CUT TOP 40"):
        lql.connect(c.path).execute(q)


def test_lql_dump_draft_depth_with_adapter_outside_speculation(c, tmp_path):
    # DUMP LOGITS ... DRAFT DEPTH d WITH ADAPTER: the draft's rows read through the stored exit
    # adapter, the sidecar names it and SCORE DRAFT reports it; an identity adapter changes no bit
    # (the same rows as the bare draft); the full model, an absent adapter and a target read
    # through one are refused by name
    import lql
    from vindex3.draft.adapter import ExitAdapter
    from vindex3.draft.dumps import read_dump

    s = lql.connect(c.path)
    q = "DUMP LOGITS TOKENS (1, 5, 9, 33, 100, 7) DRAFT DEPTH 2 WITH ADAPTER INTO '{}'"
    with pytest.raises(lql.LqlError, match="(?s)stores no exit adapter at depth 2.*FIT ADAPTER AT DEPTH 2"):
        s.execute(q.format(tmp_path / "a.f32"))
    with pytest.raises(lql.LqlError, match="this run is the full model"):
        s.execute(f"DUMP LOGITS TOKENS (1, 5, 9) WITH ADAPTER INTO '{tmp_path / 'x.f32'}'")
    store.store_adapter(c, ExitAdapter.identity(c, 2))
    s = lql.connect(c.path)
    (r,) = s.execute(q.format(tmp_path / "id.f32"))
    assert r.meta["adapter"]["key"] == "drafter_adapter_d2" and "through exit adapter 'drafter_adapter_d2'" in r.to_text()
    s.execute(f"DUMP LOGITS TOKENS (1, 5, 9, 33, 100, 7) DRAFT DEPTH 2 INTO '{tmp_path / 'bare.f32'}'")
    assert np.array_equal(read_dump(tmp_path / "id.f32")[1], read_dump(tmp_path / "bare.f32")[1])
    assert "adapter" not in read_dump(tmp_path / "bare.f32")[0]  # a plain dump's sidecar is as before
    store.store_adapter(c, fit_adapter(c, 2, CORPUS, corpus="toy", ridge=0.5))
    s = lql.connect(c.path)
    s.execute(q.format(tmp_path / "fit.f32"))
    assert not np.array_equal(read_dump(tmp_path / "fit.f32")[1], read_dump(tmp_path / "bare.f32")[1])
    s.execute(f"DUMP LOGITS TOKENS (1, 5, 9, 33, 100, 7) INTO '{tmp_path / 'full.f32'}'")
    (sc,) = s.execute(f"SCORE DRAFT '{tmp_path / 'fit.f32'}' AGAINST '{tmp_path / 'full.f32'}'")
    assert sc.draft_adapter["key"] == "drafter_adapter_d2" and sc.draft_adapter["ridge"] == 0.5
    assert "through exit adapter 'drafter_adapter_d2'" in sc.to_text()
    L = c.graph.num_layers  # Draft(L) through an (identity) adapter is full depth, yet no target
    store.store_adapter(c, ExitAdapter.identity(c, L))
    s = lql.connect(c.path)
    s.execute(f"DUMP LOGITS TOKENS (1, 5, 9, 33, 100, 7) DRAFT DEPTH {L} WITH ADAPTER INTO '{tmp_path / 'L.f32'}'")
    with pytest.raises(lql.LqlError, match=f"read through exit adapter 'drafter_adapter_d{L}'"):
        s.execute(f"SCORE DRAFT '{tmp_path / 'fit.f32'}' AGAINST '{tmp_path / 'L.f32'}'")


def test_lql_draft_ladder_with_adapter(c, tmp_path):
    # DRAFT LADDER ... WITH ADAPTER: each depth read through its stored exit adapter, named per
    # row; identity adapters give the plain ladder's scores exactly, a fitted one changes them; a
    # depth without an adapter is refused by name before any dump
    import lql
    from vindex3.draft.adapter import ExitAdapter

    bank = tmp_path / "bank.jsonl"
    bank.write_text("\n".join(json.dumps({"id": f"p{i}", "category": "toy", "token_ids": t})
                              for i, t in enumerate(CORPUS)) + "\n")
    s = lql.connect(c.path)
    q = f"DRAFT LADDER DEPTHS (1, 2) ON '{bank}' WITH ADAPTER"
    with pytest.raises(lql.LqlError, match="DRAFT LADDER ... WITH ADAPTER \\(depth 1\\): .* stores no exit adapter"):
        s.execute(q)
    for d in (1, 2):
        store.store_adapter(c, ExitAdapter.identity(c, d))
    s = lql.connect(c.path)
    (plain,) = s.execute(f"DRAFT LADDER DEPTHS (1, 2) ON '{bank}'")
    (ident,) = s.execute(q)
    assert [r["adapter"]["key"] for r in ident.rows] == ["drafter_adapter_d1", "drafter_adapter_d2"]
    assert all(r.get("adapter") is None for r in plain.rows)
    assert [r["summary"] for r in ident.rows] == [r["summary"] for r in plain.rows]
    assert "drafts read through exit adapters (1: 'drafter_adapter_d1', 2: 'drafter_adapter_d2')" in ident.to_text()
    store.store_adapter(c, fit_adapter(c, 2, CORPUS, corpus="toy", ridge=0.5))
    (fit,) = lql.connect(c.path).execute(q)
    assert fit.rows[1]["adapter"]["ridge"] == 0.5 and fit.rows[1]["summary"] != plain.rows[1]["summary"]
