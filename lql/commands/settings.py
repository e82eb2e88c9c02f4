"""SET, SHOW SETTINGS, HELP: the session's settings and the statement catalogue."""

from __future__ import annotations

from typing import Any

from .. import catalog, planner
from .. import results as R
from . import command


def setting_text(v: Any) -> Any:
    if isinstance(v, bool):
        return "on" if v else "off"
    return v


def shown(doc: catalog.SettingDoc, v: Any) -> Any:
    """A setting's value as SHOW SETTINGS and SET write it."""
    return doc.show(v) if doc.show is not None else setting_text(v)


@command(planner.ShowSettings)
def show_settings(session, node: planner.ShowSettings) -> R.SettingsResult:
    return R.SettingsResult(settings=[
        R.SettingRow(name=s.name, value=shown(s, session.settings[s.name]), description=s.description)
        for s in catalog.SETTINGS
    ])


@command(planner.SetSetting)
def set_setting(session, node: planner.SetSetting) -> R.SetResult:
    previous = session.settings[node.name]
    if node.name == "shards" and session.bound and node.value != previous:
        session.reshard(node.value)  # the setting is the bound model's placement
    session.settings[node.name] = node.value
    doc = catalog.setting(node.name)
    return R.SetResult(name=node.name, value=shown(doc, node.value), previous=shown(doc, previous))

