"""USE REMOTE, and every statement of a remote-bound session: it runs on the server and comes
back as the typed result it was rendered from there (see `lql.server.client`)."""

from __future__ import annotations

from .. import planner
from .. import results as R
from . import command


@command(planner.UseRemote)
def use_remote(session, node: planner.UseRemote) -> R.RemoteResult:
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
    return R.RemoteResult(
        url=remote.url, model=remote.model, name=str(info.get("name", remote.model)), layers=int(info.get("layers", 0)),
        operator_mix=[R.MixEntry(**m) for m in info.get("operator_mix", [])], digest=str(info.get("digest", "")),
        session=remote.session_id,
    )


@command(planner.RemoteStatement)
def remote_statement(session, node: planner.RemoteStatement) -> R.Result:
    return node.remote.run_statement(node.statement)


@command(planner.RemoteMirror)
def remote_mirror(session, node: planner.RemoteMirror) -> R.Result:
    from . import execute

    node.remote.run_statement(node.statement)  # the server refuses what it would not take
    return execute(session, node.local)
