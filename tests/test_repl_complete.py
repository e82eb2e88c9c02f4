"""The REPL's completer and highlighter, called directly with documents: no terminal, no model."""

from __future__ import annotations

import pytest
from prompt_toolkit.completion import CompleteEvent
from prompt_toolkit.document import Document

from lql import catalog, parser
from lql.repl import Shell, _setting_choices, should_submit
from lql.repl_complete import LqlCompleter, SettingInfo, context_at, current_statement
from lql.repl_lexer import LqlLexer, highlight, is_meta
from lql.repl_meta import META

TAB = CompleteEvent(completion_requested=True)
TYPING = CompleteEvent(text_inserted=True)

SETTINGS = [
    SettingInfo("format", "output format", ("text", "json")),
    SettingInfo("timing", "timings", ("on", "off")),
    SettingInfo("editing_mode", "keys", ("emacs", "vi")),
]


@pytest.fixture
def completer() -> LqlCompleter:
    return LqlCompleter(settings=lambda: SETTINGS, meta_commands=META.completions)


def texts(completer: LqlCompleter, text: str, event: CompleteEvent = TAB) -> list[str]:
    return [c.text for c in completer.get_completions(Document(text), event)]


def accepted_keywords(text: str) -> list[str]:
    """What the LALR parser itself accepts next: the oracle the completer must match."""
    return sorted(
        parser.KEYWORDS[n] for n in parser.interactive(text).accepts() if n in parser.KEYWORDS
    )


# ---- keywords: exactly what the parser accepts next ------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "",
        "SHOW ",
        "DRAFT ",
        "INFER 'x' ",
        "INFER 'x' TOP 3 ",
        "STATS ",
        "STATS AT 10 ",
        "EXPLAIN ",
        "EXPLAIN INFER 'x' ",
        "ENCODE 'a' ",
        "SCORE DRAFT 'a' ",
        "DUMP ",
        "DUMP LOGITS 'x' ",
        "OPEN ",
        "STATS; ",
        "OPEN 'm';\nSHOW ",
    ],
)
def test_keywords_offered_are_exactly_those_the_parser_accepts(completer, text):
    """The parser's candidates, less the two rules it cannot state (LOOKAHEAD only after
    SPECULATE; an INFER clause not twice)."""
    stmt = current_statement(text)
    expected = accepted_keywords(stmt)
    if "INFER" in stmt:
        used = set(stmt.upper().split())
        expected = [k for k in expected if not (k == "LOOKAHEAD" and "SPECULATE" not in used)
                    and not (k in ("TOP", "GENERATE", "DRAFT", "SPECULATE", "LOOKAHEAD", "CHAT") and k in used)]
    assert texts(completer, text) == expected


def test_keywords_at_the_start_are_the_statement_keywords(completer):
    assert texts(completer, "") == sorted(parser.STATEMENT_KEYWORDS)


def test_a_begun_word_filters_and_replaces(completer):
    got = list(completer.get_completions(Document("SHOW LAY"), TAB))
    assert [c.text for c in got] == ["LAYERS"]
    assert got[0].start_position == -3


def test_keywords_follow_the_case_being_typed(completer):
    assert texts(completer, "sh") == ["show"]
    assert texts(completer, "Sh") == ["SHOW"]


def test_every_offered_keyword_continues_a_valid_prefix(completer):
    """Appending any candidate keeps the text a prefix the parser can continue."""
    for prefix in ["", "SHOW ", "INFER 'x' ", "DRAFT ", "EXPLAIN ", "STATS "]:
        for kw in texts(completer, prefix):
            parser.interactive(prefix + kw + " ")  # raises if the grammar disagrees


def test_nothing_is_offered_where_the_text_is_not_lql(completer):
    assert texts(completer, "OPEN model ") == []
    assert texts(completer, "FOO ") == []


def test_while_typing_nothing_pops_up_until_a_word_is_begun(completer):
    assert texts(completer, "SHOW ", TYPING) == []
    assert texts(completer, "SHOW L", TYPING) == ["LAYERS"]


def test_no_completion_inside_a_prompt_string_or_a_comment(completer):
    assert texts(completer, "INFER 'hel") == []
    assert texts(completer, "STATS -- sho") == []


# ---- paths inside OPEN, ENCODE and PLAN strings ----------------------------------------


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "model.vindex3").mkdir()
    (tmp_path / "mixed.gguf").write_text("x")
    (tmp_path / ".hidden").write_text("x")
    (tmp_path / "other").write_text("x")
    return tmp_path


@pytest.mark.parametrize("head", ["OPEN '", 'USE "', "PLAN '", "ENCODE '", "ENCODE 'a' INTO '"])
def test_paths_are_offered_inside_path_strings(completer, tree, head):
    q = head[-1]  # a file closes the string; a directory does not (the next Tab goes inside)
    assert texts(completer, f"{head}{tree}/m") == [f"mixed.gguf{q}", "model.vindex3/"]
    assert texts(completer, f"{head}{tree}/") == [f"mixed.gguf{q}", "model.vindex3/", f"other{q}"]


def test_paths_pop_up_while_typing_and_relative_to_the_working_directory(
    completer, tree, monkeypatch
):
    monkeypatch.chdir(tree)
    got = list(completer.get_completions(Document("OPEN 'mo"), TYPING))
    assert [(c.text, c.start_position) for c in got] == [("model.vindex3/", -2)]


def test_hidden_entries_only_when_asked_for(completer, tree):
    assert texts(completer, f"OPEN '{tree}/.") == [".hidden'"]


def test_home_is_expanded(completer, tree, monkeypatch):
    monkeypatch.setenv("HOME", str(tree))
    assert texts(completer, "OPEN '~/mod") == ["model.vindex3/"]


def test_a_quote_in_a_file_name_is_escaped(completer, tmp_path):
    (tmp_path / "it's").write_text("x")
    assert texts(completer, f"OPEN '{tmp_path}/it") == ["it\\'s'"]
    assert texts(completer, f'OPEN "{tmp_path}/it') == ["it's\""]


def test_score_skips_sidecars_and_closes_the_quote(completer, tmp_path):
    for name in ("draft.f32", "draft.f32.meta.json", "full.f32", "full.meta.json"):
        (tmp_path / name).write_text("x")
    assert texts(completer, f"SCORE DRAFT '{tmp_path}/") == ["draft.f32'", "full.f32'"]
    assert texts(completer, f"SCORE DRAFT 'a' AGAINST \"{tmp_path}/f") == ['full.f32"']
    assert "full.meta.json'" in texts(completer, f"OPEN '{tmp_path}/f")  # other statements show every file


# ---- numbers where the grammar takes one -------------------------------------------------


@pytest.fixture
def with_layers() -> LqlCompleter:
    return LqlCompleter(settings=lambda: SETTINGS, meta_commands=META.completions, model_layers=lambda: 4)


@pytest.mark.parametrize("text,expected", [
    ("DRAFT DEPTH ", ["1", "2", "3", "4"]),
    ("INFER 'x' DRAFT DEPTH ", ["1", "2", "3", "4"]),
    ("INFER 'x' GENERATE 5 SPECULATE DEPTH ", ["1", "2", "3", "4"]),
    ("SHOW OPERANDS LAYER ", ["0", "1", "2", "3"]),
    ("SHOW LAYERS RANGE ", ["0", "1", "2", "3"]),
    ("SHOW LAYERS RANGE 2-", ["2", "3"]),
    ("DRAFT LADDER DEPTHS (", ["1", "2", "3", "4"]),
    ("DRAFT LADDER DEPTHS (1, 3, ", ["2", "4"]),
    ("INFER 'x' TOP ", ["1", "3", "5", "10", "20"]),
    ("INFER 'x' TOP 1", ["1", "10"]),
    ("DRAFT DEPTH 3", ["3"]),
])
def test_whole_numbers_where_the_grammar_takes_one(with_layers, text, expected):
    assert texts(with_layers, text) == expected
    for t in expected:  # each keeps the text valid LQL so far
        parser.interactive(text[: len(text) - len(text.split()[-1]) if text[-1].isdigit() else len(text)] + t)


def test_layers_and_depths_are_not_guessed_without_a_model(completer):
    assert texts(completer, "DRAFT DEPTH ") == []
    assert texts(completer, "SHOW OPERANDS LAYER ") == []


def test_keywords_match_fuzzily_when_no_prefix_does(completer):
    assert texts(completer, "SHOW opd") == ["operands"]
    assert texts(completer, "SHOW rps") == ["representations"]
    assert texts(completer, "SHOW LAY") == ["LAYERS"]  # a prefix wins


def test_lookahead_only_after_speculate_and_no_clause_twice(completer):
    assert "LOOKAHEAD" not in texts(completer, "INFER 'x' ")
    assert "LOOKAHEAD" in texts(completer, "INFER 'x' GENERATE 9 SPECULATE DEPTH 2 ")
    assert "TOP" not in texts(completer, "INFER 'x' TOP 3 ")
    assert "GENERATE" in texts(completer, "INFER 'x' TOP 3 ")


def test_no_paths_for_strings_that_are_not_paths(completer, tree):
    assert texts(completer, f"INFER '{tree}/") == []
    assert texts(completer, f"SHOW REPRESENTATIONS '{tree}/") == []


# ---- settings, HELP, meta commands -----------------------------------------------------


def test_setting_names_after_set(completer):
    assert texts(completer, "SET ") == ["format", "timing", "editing_mode"]
    assert texts(completer, "SET ti") == ["timing"]


def test_setting_values_after_equals(completer):
    assert texts(completer, "SET format = ") == ["text", "json"]
    assert texts(completer, "SET editing_mode = v") == ["vi"]


def test_the_shell_offers_every_session_setting_and_its_own():
    names = [s.name for s in Shell.setting_infos(None)]  # no instance state is read
    assert names[: len(catalog.SETTINGS)] == [s.name for s in catalog.SETTINGS]
    assert "editing_mode" in names and "history" in names


def test_setting_choices_come_from_the_catalogue():
    assert _setting_choices(catalog.setting("format")) == ("text", "json", "csv", "tsv", "markdown", "jsonl")
    assert _setting_choices(catalog.setting("expanded")) == ("on", "off", "auto")
    assert _setting_choices(catalog.setting("timing")) == ("on", "off")
    assert _setting_choices(catalog.setting("top")) == ()


def test_statement_names_after_help(completer):
    got = texts(completer, "HELP ")
    assert "SHOW LAYERS" in got and "DRAFT DEPTH" in got and "INFER" in got
    assert "LAYERS" not in got  # a statement's name, not any keyword
    assert texts(completer, "HELP SHOW ") == [
        "ATTENTION",  # the interventions family's SHOW ATTENTION
        "COMPACT STATUS",
        "COMPONENTS",
        "ENTITIES",
        "EXPERTS",
        "FEATURES",
        "LAYERS",
        "MODELS",
        "OPERANDS",
        "PATCHES",
        "PROVENANCE",
        "RELATIONS",
        "REPRESENTATIONS",
        "SETTINGS",
    ]
    assert texts(completer, "HELP dr") == ["draft depth", "draft ladder", "draft off"]


def test_meta_commands_after_a_backslash(completer):
    assert texts(completer, "\\ti") == ["\\timing"]
    assert set(texts(completer, "\\")) >= {"\\?", "\\q", "\\timing", "\\json", "\\i", "\\history"}


def test_paths_after_include(completer, tree):
    assert texts(completer, f"\\i {tree}/o") == ["other"]


def test_context_kinds():
    assert context_at("SET ").kind == "setting"
    assert context_at("SET x = ").kind == "setting_value"
    assert context_at("HELP ").kind == "help"
    assert context_at("OPEN '").kind == "path"
    assert context_at("INFER '").kind == "none"
    assert context_at("\\").kind == "meta"
    assert context_at("DRAFT DEPTH 3").kind == "integer"  # completing the number being typed
    assert context_at("DRAFT DEPTH 3x").kind == "none"


# ---- Enter: submit or continue ---------------------------------------------------------


@pytest.mark.parametrize(
    "text, submit",
    [
        ("", True),
        ("   ", True),
        ("STATS;", True),
        ("STATS", False),
        ("SHOW\nLAYERS", False),
        ("SHOW\nLAYERS\n;", True),
        ("STATS; SHOW LAYERS", False),
        ("OPEN 'a;b'", False),  # the ';' is inside the string
        ("STATS -- done;", False),  # ... or inside a comment
        ("STATS; -- done", True),
        ("OPEN bad;", True),  # complete but wrong: submitting shows the error
        ("\\timing", True),
        ("exit", True),
        ("quit;", True),
    ],
)
def test_enter_submits_only_a_complete_statement_or_a_meta_command(text, submit):
    assert should_submit(text) is submit


# ---- highlighting from the grammar's lexer ---------------------------------------------


def classes(text: str) -> dict[str, str]:
    return {frag: style for style, frag in highlight(text) if frag.strip()}


def test_highlight_covers_every_character_in_order():
    text = "OPEN 'm'; -- c\nINFER 'x' TOP 3;\n  STATS AT 1.5"
    assert "".join(f for _, f in highlight(text)) == text


def test_highlight_classes():
    c = classes("open 'm.vindex3'; STATS AT 4096 POSITIONS; SET x = 1.5; -- note")
    assert c["open"] == c["STATS"] == c["POSITIONS"] == "class:lql.keyword"
    assert c["'m.vindex3'"] == "class:lql.string"
    assert c["4096"] == c["1.5"] == "class:lql.number"
    assert c["-- note"] == "class:lql.comment"
    assert c["x"] == "class:lql.name"
    assert c[";"] == "class:lql.punct"


def test_highlight_marks_errors():
    assert classes("STATS $;")["$"] == "class:lql.error"  # no terminal matches
    assert classes("OPEN model ;")["model"] == "class:lql.error"  # the parser stops here
    assert classes("INFER 'abc\nSTATS;")["'abc"] == "class:lql.error"  # not closed on its line


def test_highlight_does_not_flag_what_is_still_being_typed():
    assert classes("OPE")["OPE"] == "class:lql.name"
    assert classes("INFER 'abc")["'abc"] == "class:lql.string"


def test_meta_command_lines():
    assert highlight("\\timing on") == [("class:lql.meta", "\\timing on")]
    assert is_meta("  exit ") and is_meta("quit;") and not is_meta("exits")


def test_lexer_splits_lines_for_prompt_toolkit():
    get = LqlLexer().lex_document(Document("SHOW\n  LAYERS;"))
    assert get(0) == [("class:lql.keyword", "SHOW")]
    assert get(1) == [("", "  "), ("class:lql.keyword", "LAYERS"), ("class:lql.punct", ";")]
    assert get(5) == []


def test_every_help_topic_offered_has_an_entry():
    from lql import registry
    from lql.repl_complete import help_topics
    from lql.statements.help import help_text

    topics = help_topics()
    assert {d.name for d in registry.docs()} <= set(topics)
    assert all(help_text(t) for t in topics)
