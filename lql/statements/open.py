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

fam.doc('OPEN',
        "OPEN 'path' [SHARDS n] | USE 'path' | OPEN DEFAULT [SHARDS n]",
        'bind a container (OPEN DEFAULT: the built-in default model, encoded on first use; SHARDS n: its layers run as n Ray actors)',
        "OPEN 'model.vindex3';", order=0, aliases=('USE',))
fam.doc('USE REMOTE',
        "USE REMOTE 'http://host:port' [MODEL 'id']",
        'bind the session to an lql server: later statements run there and print here (OPEN comes back)',
        "USE REMOTE 'http://127.0.0.1:8088';", order=10)
fam.doc('USE MODEL',
        "USE MODEL 'checkpoint dir' [AUTO_EXTRACT]",
        'encode a local checkpoint into a container beside it (once) and bind it; a model hub id is refused by name: nothing is downloaded',
        "USE MODEL 'path/to/hf-checkpoint';", order=300)


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
