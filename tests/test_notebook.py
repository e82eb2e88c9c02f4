"""Results in a notebook show what the text output shows: rendered the way a notebook renders
them (`_repr_html_`, `_repr_png_`, `_repr_mimebundle_`, and IPython's `_render_traceback_` for a
failure), without a notebook server. A headless nbconvert run is done only where nbconvert is
installed, and skipped loudly otherwise."""

from __future__ import annotations

import html
import json
import re
import sys

import pytest

import lql

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def s(tiny_llama_container):
    return lql.connect(tiny_llama_container)


def q(path) -> str:
    return "'" + str(path).replace("\\", "\\\\").replace("'", "\\'") + "'"


def cells(page: str) -> list[str]:
    return [html.unescape(x) for x in re.findall(r"<td>(.*?)</td>", page, re.DOTALL)]


def test_tokens_keep_their_leading_space_and_show_control_characters(s):
    r = s.execute_one("INFER 'Water boils at' TOP 5")
    page = r._repr_html_()
    shown = cells(page)
    assert all(repr(t.token) in shown for t in r.top)  # quoted as the text output quotes them
    assert all(repr(t.token) in r.to_text() for t in r.top)
    g = s.execute_one("INFER 'Water boils' GENERATE 6 EXACTLY")
    rows = re.findall(r"<tr>(.*?)</tr>", g._repr_html_(), re.DOTALL)
    texts = [html.unescape(re.findall(r"<td>(.*?)</td>", row)[2]) for row in rows[1:]]
    assert texts == [repr(s.catalog.token_text(i)) for i in g.generated_ids]


def test_an_html_cell_shows_what_text_hides_in_html():
    from lql.render import _html_cell

    assert _html_cell("token", " Paris") == "' Paris'"
    assert _html_cell("top.token", "\n") == "'\\n'"
    assert _html_cell("generated_text", " Paris.\n\nThe") == "' Paris.\\n\\nThe'"
    assert _html_cell("name", "llama") == "llama"  # an ordinary string stays as it is
    assert _html_cell("name", " padded") == "' padded'"  # whose edge spaces HTML would swallow
    assert _html_cell("name", "bell\x07") == "'bell\\x07'"
    assert _html_cell("tokens", [" a", "b"]) == "[' a', 'b']"


def test_floats_show_the_text_outputs_digits(s):
    r = s.execute_one("INFER 'Water boils at' TOP 3")
    shown = cells(r._repr_html_())
    floats = [c for c in shown if re.fullmatch(r"-?\d+\.\d+(e-?\d+)?", c)]
    assert floats and all(len(re.sub(r"^[0.-]+|e.*$", "", c).replace(".", "")) <= 4 for c in floats)  # 4 digits
    assert [f"{t.probability:.4g}" for t in r.top] == [c for c in shown if c in {f"{t.probability:.4g}" for t in r.top}]


def test_wide_tables_scroll_and_the_caption_is_never_cut(s):
    long = "water boils at one hundred degrees " * 6
    page = s.execute_one(f"INFER '{long}' TOP 2")._repr_html_()
    assert '<div class="lql-table" style="overflow-x:auto' in page  # the table scrolls sideways
    caption = page[page.index('<div class="lql-caption"'):page.index('<div class="lql-table"')]
    assert "overflow-wrap:anywhere" in caption and html.escape(long.strip()) in caption  # whole, and it wraps
    assert "<caption>" not in page  # not inside the scrolling table, where it would be cut


def test_a_ladder_shows_its_figure_inline(s, tmp_path):
    pytest.importorskip("matplotlib", reason="SKIPPED LOUDLY: matplotlib (the notebook extra) is not installed")
    bank = tmp_path / "p.jsonl"
    bank.write_text(json.dumps({"id": "a", "category": "x", "text": "Water boils at"}) + "\n")
    r = s.execute_one(f"DRAFT LADDER DEPTHS (1, 2, 4) ON {q(bank)}")
    png = r._repr_png_()
    assert png[:8] == PNG
    bundle = r._repr_mimebundle_()
    assert bundle["image/png"][:8] == PNG and bundle["text/plain"] == r.to_text()
    assert '<img class="lql-figure"' in bundle["text/html"] and "data:image/png;base64," in bundle["text/html"]
    assert s.execute_one("SHOW LAYERS")._repr_png_() is None  # no figure: nothing, and no error
    assert "image/png" not in s.execute_one("SHOW LAYERS")._repr_mimebundle_()


def test_without_matplotlib_a_ladder_shows_its_table_and_no_error(s, tmp_path, monkeypatch):
    bank = tmp_path / "p.jsonl"
    bank.write_text(json.dumps({"id": "a", "category": "x", "text": "Water boils at"}) + "\n")
    r = s.execute_one(f"DRAFT LADDER DEPTHS (1, 2) ON {q(bank)}")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert r._repr_png_() is None
    bundle = r._repr_mimebundle_()
    assert "image/png" not in bundle and "<table>" in bundle["text/html"] and "<img" not in bundle["text/html"]


def test_a_refusal_shows_its_message_not_a_traceback(s):
    with pytest.raises(lql.LqlError) as e:
        s.execute_one("SHOW LAYERS RANGE 0-9")
    shown = e.value._render_traceback_()
    assert shown[0].startswith("error: ") and "9" in shown[0]
    assert not any("Traceback" in ln or "File \"" in ln for ln in shown)
    with pytest.raises(lql.LqlError) as e:
        s.execute_one("SHOW LAYRES")
    shown = e.value._render_traceback_()
    assert shown[0].startswith("syntax error at line 1, column 6") and shown[2].strip() == "^"
    assert shown[-1] == "  hint: did you mean LAYERS?"


def test_a_bug_keeps_its_traceback_in_a_notebook():
    from lql.errors import InternalError

    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError as z:
        err = InternalError.wrap(z, line=1, column=1, statement="STATS")
    shown = err._render_traceback_()
    assert shown[0].startswith("Traceback") and any("ZeroDivisionError: boom" in ln for ln in shown)


def test_a_headless_notebook_run(s, tiny_llama_container, tmp_path):
    """nbconvert runs a notebook: the ladder's figure is an image output and ' Paris'-style
    tokens keep their space in the HTML output."""
    nbformat = pytest.importorskip("nbformat", reason="SKIPPED LOUDLY: nbformat/nbconvert are not installed")
    nbconvert = pytest.importorskip("nbconvert", reason="SKIPPED LOUDLY: nbconvert is not installed")
    bank = tmp_path / "p.jsonl"
    bank.write_text(json.dumps({"id": "a", "category": "x", "text": "Water boils at"}) + "\n")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"import lql\ns = lql.connect({str(tiny_llama_container)!r})"),
                nbformat.v4.new_code_cell("s.execute_one(\"INFER 'Water boils at' TOP 5\")"),
                nbformat.v4.new_code_cell(f"s.execute_one(\"DRAFT LADDER DEPTHS (1, 2) ON {q(bank)}\")")]
    nbconvert.preprocessors.ExecutePreprocessor(timeout=600).preprocess(nb, {"metadata": {"path": str(tmp_path)}})
    infer_html = nb.cells[1].outputs[0]["data"]["text/html"]
    top = s.execute_one("INFER 'Water boils at' TOP 5").top
    assert all(html.escape(repr(t.token)) in infer_html for t in top)
    assert nb.cells[2].outputs[0]["data"]["image/png"]
