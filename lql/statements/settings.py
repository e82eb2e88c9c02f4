"""The session's settings: SET name = value, SHOW SETTINGS."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel

from .. import ast, catalog
from ..errors import SettingError
from ..planner import Node
from ..registry import family
from ..results import Result, dump
from ..syntax import Children, literal_float, literal_int, literal_string
from ..text import fmt_value, table

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


class Set(ast.Statement):
    keyword: ClassVar[str] = "SET"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool] = True
    remote_mirror: ClassVar[bool] = True  # a remote-bound session sets it on the server and here
    kind: Literal["set"] = "set"
    name: str
    value: str | int | float

    def check_on_server(self, config) -> None:
        """A limit setting may only be lowered on a server: at most the catalogue's default, and
        max_positions at most the positions one request may use (prompt + generated). A setting
        that names a file (SET templates) is refused: the server reads no file a statement did not
        name as its own confined path."""
        if self.name in catalog.FILE_SETTINGS:
            from ..server.policy import ProfileRefusal

            raise ProfileRefusal(f"SET {self.name} names a file for the session to read, which a server does not take",
                                 hint="give INSERT a TEMPLATE 'The {entity} is located in' clause instead")
        if self.name not in catalog.LIMIT_SETTINGS:
            return
        doc = catalog.setting(self.name)
        try:
            value = doc.parse(self.value)
        except ValueError:
            return  # the planner refuses it by name
        lim = config.limits
        ceiling = lim.max_prompt_tokens + lim.max_tokens if self.name == "max_positions" else doc.default
        if value is None or value > ceiling:
            from ..server.policy import LimitRefusal

            raise LimitRefusal(f"SET {self.name} = {shown(doc, value)} would raise a limit this server holds its "
                               f"sessions to ({self.name} may be at most {shown(doc, ceiling)} here)",
                               hint=f"a server session may lower {self.name}, not raise it")


class ShowSettings(ast.Statement):
    keyword: ClassVar[str] = "SHOW SETTINGS"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool] = True
    local_when_remote: ClassVar[bool] = True  # the settings table is this session's
    kind: Literal["show_settings"] = "show_settings"


@dataclass(frozen=True, eq=False)
class SetSetting(Node):
    name: str
    value: Any  # parsed by the setting's own parser


class SettingRow(BaseModel):
    name: str
    value: Any
    description: str


class SettingsResult(Result):
    kind: Literal["show_settings"] = "show_settings"
    settings: list[SettingRow]

    def layout(self, timing: bool) -> list[str]:
        return table(["setting", "value", "meaning"], [[s.name, fmt_value(s.value), s.description] for s in self.settings])

    def records(self) -> list[dict[str, Any]]:
        return [dump(x) for x in self.settings]


class SetResult(Result):
    kind: Literal["set"] = "set"
    name: str
    value: Any
    previous: Any

    def layout(self, timing: bool) -> list[str]:
        was = "" if self.previous == self.value else f" (was {fmt_value(self.previous)})"
        return [f"{self.name} = {fmt_value(self.value)}{was}"]


@fam.rule
def set_stmt(c: Children) -> Set:
    name, value = c.values(2)
    return Set(name=name.value.lower(), value=value)


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
def show_settings(c: Children) -> ShowSettings:
    return ShowSettings()


@fam.plans(Set)
def plan_set(s: Set, ctx) -> SetSetting:
    doc = catalog.setting(s.name)
    if doc is None:
        raise SettingError(f"there is no setting named {s.name!r}",
                           hint="settings: " + ", ".join(x.name for x in catalog.SETTINGS))
    try:
        value = doc.parse(s.value)
    except ValueError as e:
        raise SettingError(f"setting {s.name} {e}; got {s.value!r}") from None
    return SetSetting(s, name=s.name, value=value)


def setting_text(v: Any) -> Any:
    if isinstance(v, bool):
        return "on" if v else "off"
    return v


def shown(doc: catalog.SettingDoc, v: Any) -> Any:
    """A setting's value as SHOW SETTINGS and SET write it."""
    return doc.show(v) if doc.show is not None else setting_text(v)


@fam.runs(ShowSettings)
def show_settings_run(session, node) -> SettingsResult:
    return SettingsResult(settings=[
        SettingRow(name=s.name, value=shown(s, session.settings[s.name]), description=s.description)
        for s in catalog.SETTINGS
    ])


@fam.runs(SetSetting)
def set_setting(session, node: SetSetting) -> SetResult:
    previous = session.settings[node.name]
    if node.name == "shards" and session.bound and node.value != previous:
        session.reshard(node.value)  # the setting is the bound model's placement
    session.settings[node.name] = node.value
    doc = catalog.setting(node.name)
    return SetResult(name=node.name, value=shown(doc, node.value), previous=shown(doc, previous))
