"""Binding a session: OPEN a container (or the built-in default model), USE REMOTE a server,
USE MODEL a local checkpoint (encoded beside it once, the reference dialect's spelling)."""

from __future__ import annotations

from .. import ast
from ..registry import family
from ..syntax import Children

fam = family("open", module=__name__, statements=("open_path", "open_default", "use_remote", "use_model_stmt"),
             path_keywords=("OPEN", "USE"), grammar=r"""
open_path: (OPEN | USE) STRING [SHARDS INT]
open_default: (OPEN | USE) DEFAULT [SHARDS INT]
use_remote: USE REMOTE STRING [MODEL STRING]   // statements then run on that server
// USE MODEL 'dir' [AUTO_EXTRACT]: a local checkpoint directory, encoded and bound
use_model_stmt: USE MODEL STRING [AUTO_EXTRACT]
""")


@fam.rule
def open_path(c: Children) -> ast.Open:
    return ast.Open(path=c.string(c.first.type), shards=c.int("SHARDS"))


@fam.rule
def open_default(c: Children) -> ast.Open:
    return ast.Open(default=True, shards=c.int("SHARDS"))


@fam.rule
def use_remote(c: Children) -> ast.UseRemote:
    return ast.UseRemote(url=c.string("USE", "REMOTE"), model=c.string("MODEL"))


@fam.rule
def use_model_stmt(c: Children) -> ast.UseModel:
    return ast.UseModel(model=c.string("USE", "MODEL"), auto_extract=c.has("AUTO_EXTRACT"))
