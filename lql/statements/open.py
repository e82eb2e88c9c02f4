"""Binding a session: OPEN a container (or the built-in default model), USE REMOTE a server,
USE MODEL a local checkpoint (encoded beside it once, the reference dialect's spelling)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from .. import ast, files
from ..binding import mix
from ..planner import Context, Node, RemoteMirror, RemoteStatement, err, positive
from ..registry import family
from ..results import MixEntry, Result
from ..syntax import Children
from ..text import fields, fmt_mix

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
def open_path(c: Children) -> Open:
    return Open(path=c.string(c.first.type), shards=c.int("SHARDS"))


@fam.rule
def open_default(c: Children) -> Open:
    return Open(default=True, shards=c.int("SHARDS"))


@fam.rule
def use_remote(c: Children) -> UseRemote:
    return UseRemote(url=c.string("USE", "REMOTE"), model=c.string("MODEL"))


@fam.rule
def use_model_stmt(c: Children) -> UseModel:
    return UseModel(model=c.string("USE", "MODEL"), auto_extract=c.has("AUTO_EXTRACT"))


class Open(ast.Statement):
    keyword: ClassVar[str] = "OPEN"
    paths: ClassVar[tuple[str, ...]] = ("path",)
    read_only: ClassVar[bool | str] = "it names a container on the server; this server serves fixed models (the request's model field)"
    local_when_remote: ClassVar[bool] = True  # OPEN leaves the server
    kind: Literal["open"] = "open"
    path: str | None = None  # None with default=True
    default: bool = False
    shards: int | None = None  # SHARDS n: run the layers as n Ray actors (vindex3.shards)

    def refused_read_only(self) -> str | None:
        if self.default:
            return "it binds another model; this server serves fixed models (the request's model field)"
        return super().refused_read_only()


class UseRemote(ast.Statement):
    """USE REMOTE 'http://host:port' [MODEL 'id']: later statements run on that server."""

    keyword: ClassVar[str] = "USE REMOTE"
    paths: ClassVar[tuple[str, ...]] = ()  # a URL, and refused by every server anyway
    read_only: ClassVar[bool | str] = "it connects to another server"
    local_when_remote: ClassVar[bool] = True  # USE REMOTE moves to another server
    never_on_server: ClassVar[tuple[str, str]] = ("a server does not connect to other servers",
                                                  "run USE REMOTE in your own lql session")
    kind: Literal["use_remote"] = "use_remote"
    url: str
    model: str | None = None


class UseModel(ast.Statement):
    """USE MODEL 'dir' [AUTO_EXTRACT]: encode a local checkpoint directory (once) and bind it."""

    keyword: ClassVar[str] = "USE MODEL"
    paths: ClassVar[tuple[str, ...]] = ("model",)
    read_only: ClassVar[bool | str] = "it encodes a checkpoint and binds another model on the server"
    kind: Literal["use_model"] = "use_model"
    model: str
    auto_extract: bool = False


class OpenResult(Result):
    kind: Literal["open"] = "open"
    name: str
    path: str
    default_model: bool
    component: str
    role: str
    layers: int
    operator_mix: list[MixEntry]
    tokenizer: bool
    generation: int
    draft_reset: int | None = None  # the session's draft depth that OPEN cleared
    shards: int = 0  # layer-range actors the model runs in (0: this process)
    rebuilt: str | None = None  # OPEN DEFAULT: why the cached default model was rebuilt (None: it was not)


class RemoteResult(Result):
    """USE REMOTE: the server and model a session is now bound to."""

    kind: Literal["use_remote"] = "use_remote"
    url: str
    model: str
    name: str
    layers: int
    operator_mix: list[MixEntry]
    digest: str
    session: str  # the X-Session-Id the server keeps this session's state under


@dataclass(frozen=True, eq=False)
class OpenPlan(Node):
    path: str | None
    default: bool
    shards: int  # 0: one process; n: n layer-range actors


@dataclass(frozen=True, eq=False)
class UseRemotePlan(Node):
    """USE REMOTE: bind the session to a server (the URL already checked)."""

    url: str
    model: str | None


@dataclass(frozen=True, eq=False)
class UseModelPlan(Node):
    """USE MODEL 'dir': encode the checkpoint into ``into`` unless a container is already there,
    then bind it."""

    checkpoint: str
    into: str
    encoded: bool  # ``into`` already holds a container: open it, encode nothing


@fam.plans(Open)
def plan_open(s: Open, ctx: Context) -> Node:
    positive(s, s.shards, "SHARDS", "OPEN 'model.vindex3' SHARDS 2")
    if not s.default:
        files.container_dir(s.path)
    return OpenPlan(s, path=s.path, default=s.default, shards=s.shards if s.shards is not None else ctx.settings.shards)


@fam.plans(UseRemote)
def plan_use_remote(s: UseRemote, ctx: Context) -> Node:
    from ..server.client import check_url

    if s.model is not None and not s.model:
        raise err(s, "USE REMOTE ... MODEL '' names no model", hint="leave MODEL out to use the server's only model")
    return UseRemotePlan(s, url=check_url(s.url), model=s.model)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@fam.plans(UseModel)
def plan_use_model(s: UseModel, ctx: Context) -> Node:
    import os
    from pathlib import Path

    src = Path(files.container_dir(os.path.expanduser(s.model)))  # empty, NUL, over-long names refused by name
    try:
        exists = src.exists()
    except OSError as e:
        raise err(s, f"USE MODEL {s.model!r}: the path cannot be read ({e.strerror})",
                   hint="USE MODEL takes a local checkpoint directory (or .gguf)") from None
    if not exists:
        if _HUB_ID.match(s.model):
            raise err(s, f"USE MODEL {s.model!r} names a model hub id, and this build downloads nothing",
                       hint="download the checkpoint yourself, then USE MODEL 'path/to/checkpoint' (or ENCODE it)")
        raise err(s, f"USE MODEL {s.model!r}: there is no such directory or file",
                   hint="USE MODEL takes a local checkpoint directory (or .gguf); USE 'x.vindex3' opens a container")
    if (src / "index.json").is_file():
        return OpenPlan(s, path=str(src), default=False, shards=ctx.settings.shards)  # a container already
    into = src.parent / (src.name.removesuffix(".gguf") + ".vindex3")
    if not os.access(src.parent, os.W_OK):
        from vindex3 import default_model

        into = Path(default_model.cache_dir()) / into.name
    encoded = (into / "index.json").is_file()
    return UseModelPlan(s, checkpoint=str(src), into=str(into), encoded=encoded)


@fam.runs(OpenPlan)
def run_open_container(session, node: OpenPlan) -> OpenResult:
    from ..prepared import acquire, check

    rebuilt = None
    if node.default:
        from vindex3 import default_model

        cached = default_model.container_path()
        if session.memory_ceiling is not None and (cached / "index.json").is_file():
            from vindex3.errors import VindexError

            try:  # before the cache is verified or rebuilt; a damaged one is ensure's to rebuild
                check(cached, ceiling=session.memory_ceiling, what="OPEN DEFAULT")
            except VindexError:
                pass
        ensured = default_model.ensure_detailed(session.on_progress, notice=session.on_notice)
        path, rebuilt = ensured.path, ensured.rebuilt_because
    else:
        path = node.path
    # one container per directory in the process, shared by every session that opens it; a new
    # one is refused by name past the session's memory ceiling (a server's), before it is opened
    prepared = acquire(path, ceiling=session.memory_ceiling, what=f"OPEN {Path(path).name!r}")
    c = prepared.container
    cleared = session.draft_depth
    session.bind(c, default_model=node.default, shards=node.shards, prepared=prepared)
    comp = c.graph.component
    return OpenResult(
        name=c.name, path=str(c.path), default_model=session.default_model, component=comp.name, role=comp.role,
        layers=c.graph.num_layers, operator_mix=mix(c), tokenizer=c.has_tokenizer,
        generation=c.generation, draft_reset=cleared, shards=node.shards, rebuilt=rebuilt,
    )


@fam.runs(UseRemotePlan)
def run_use_remote(session, node: UseRemotePlan) -> RemoteResult:
    from ..errors import StatementError
    from ..server.client import Remote

    remote = Remote(node.url, node.model)
    models = remote.models()
    ids = [m.get("id") for m in models]
    if node.model is None:
        if len(models) != 1:
            raise StatementError(f"{remote.url} serves {len(models)} models; name one with MODEL",
                                 hint="models: " + ", ".join(map(str, ids)))
        info = models[0]
    else:
        found = [m for m in models if m.get("id") == node.model]
        if not found:
            raise StatementError(f"{remote.url} does not serve a model {node.model!r}",
                                 hint="models: " + ", ".join(map(str, ids)))
        info = found[0]
    remote.model = str(info["id"])
    session.bind_remote(remote)
    return RemoteResult(
        url=remote.url, model=remote.model, name=str(info.get("name", remote.model)), layers=int(info.get("layers", 0)),
        operator_mix=[MixEntry(**m) for m in info.get("operator_mix", [])], digest=str(info.get("digest", "")),
        session=remote.session_id,
    )


@fam.runs(RemoteStatement)
def run_remote_statement(session, node: RemoteStatement) -> Result:
    return node.remote.run_statement(node.statement)


@fam.runs(RemoteMirror)
def run_remote_mirror(session, node: RemoteMirror) -> Result:
    from ..registry import run

    node.remote.run_statement(node.statement)  # the server refuses what it would not take
    return run(session, node.local)


@fam.runs(UseModelPlan)
def run_use_model(session, node: UseModelPlan) -> OpenResult:
    if not node.encoded:
        import vindex3

        Path(node.into).parent.mkdir(parents=True, exist_ok=True)
        vindex3.encode(node.checkpoint, node.into, progress=session.on_progress)
    opened = OpenPlan(node.statement, path=node.into, default=False, shards=session.settings.shards)
    return run_open_container(session, opened)


@fam.layout(OpenResult)
def layout_open(r: OpenResult, timing: bool) -> list[str]:
    out = [f"opened {r.name}" + (" (the default model)" if r.default_model else "")]
    out += fields([
        ("path", r.path),
        ("component", f"{r.component} ({r.role})"),
        ("layers", str(r.layers)),
        ("operators", fmt_mix(r.operator_mix)),
        ("tokenizer", "yes" if r.tokenizer else "no (use INFER TOKENS (...))"),
        ("draft", None if r.draft_reset is None else f"DRAFT DEPTH {r.draft_reset} cleared; the full model runs"),
        ("shards", f"{r.shards} layer-range actors (Ray)" if r.shards else None),
        ("rebuilt", None if r.rebuilt is None else f"the cached default model was rebuilt: {r.rebuilt}"),
    ])
    return out


@fam.layout(RemoteResult)
def layout_remote(r: RemoteResult, timing: bool) -> list[str]:
    return [f"using {r.url}: statements run there"] + fields([
        ("model", f"{r.model} ({r.name})" if r.name != r.model else r.model),
        ("layers", str(r.layers)),
        ("operators", fmt_mix(r.operator_mix)),
        ("digest", r.digest),
        ("session", r.session),
    ])
