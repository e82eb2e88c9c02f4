"""The session's settings: SET name = value, SHOW SETTINGS."""

from __future__ import annotations

from .. import ast
from ..registry import family
from ..syntax import Children, literal_float, literal_int, literal_string

fam = family("settings", module=__name__, statements=("set_stmt", "show_settings"), grammar=r"""
set_stmt: SET NAME _EQ value

?value: STRING -> string_value
      | INT    -> int_value
      | FLOAT  -> float_value
      | NAME   -> word_value
      | ON     -> word_value
      | OFF    -> word_value

show_settings: SHOW SETTINGS
""")

fam.doc('SHOW SETTINGS',
        'SHOW SETTINGS',
        "the session's settings",
        'SHOW SETTINGS;', order=100)
fam.doc('SET',
        'SET name = value',
        'change a setting (see SHOW SETTINGS)',
        'SET timing = off;', order=450, aliases=('SETTINGS', 'OVERWRITE', 'LIMITS'))


@fam.rule
def set_stmt(c: Children) -> ast.Set:
    name, value = c.values(2)
    return ast.Set(name=name.value.lower(), value=value)


@fam.rule
def string_value(c: Children) -> str:
    return literal_string(c.first)


@fam.rule
def int_value(c: Children) -> int:
    return literal_int(c.first)


@fam.rule
def float_value(c: Children) -> float:
    return literal_float(c.first)


@fam.rule
def word_value(c: Children) -> str:
    return c.first.value.lower()


@fam.rule
def show_settings(c: Children) -> ast.ShowSettings:
    return ast.ShowSettings()
