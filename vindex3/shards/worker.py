"""The body of one shard: a Ray actor that opens its container (or its member of a shard set)
itself, prepares its layers once, and holds the continuation state of every stream that ran
through it. Hidden states in, hidden states out; the state never leaves the actor (a snapshot
stays here too, under a key the driver holds).

This module does not import Ray: the driver wraps `ShardWorker` with ``ray.remote``."""

from __future__ import annotations

import os
import time
from typing import Any

from ..exec.slice import LayerRange


def blas_facts() -> list[dict]:
    """The BLAS libraries this process runs, with their kernel and current thread count."""
    from threadpoolctl import threadpool_info

    return sorted(({"api": i.get("internal_api"), "version": i.get("version"), "architecture": i.get("architecture"),
                    "threads": i.get("num_threads")} for i in threadpool_info() if i.get("user_api") == "blas"),
                  key=lambda d: (str(d["api"]), str(d["version"])))


class ShardWorker:
    """One shard. `open` is separate from construction so that a refusal while opening reaches
    the driver as its typed error, not as a dead actor."""

    def __init__(self) -> None:
        self.spec: dict = {}
        self.calls = 0
        self._limit = None

    def open(self, spec: dict) -> dict:
        """Open the source, check it is the one the driver names, prepare the layers."""
        t0 = time.perf_counter()
        self.spec = spec
        # The same thread regime as the driver's one-process executor: every pass holds BLAS at one
        # thread and splits large products into blocks fixed by their shape (vindex3.exec.engine
        # pass_threads), so the bytes are the driver's whatever the counts; outside a pass BLAS
        # keeps the driver's default count (a Ray worker starts with OMP_NUM_THREADS=1).
        os.environ["VINDEX3_DECODE_THREADS"] = str(spec["decode_threads"])
        from ..codecs import threads

        threads.set_count(None)  # read again: the rows kernels use the driver's count too
        from threadpoolctl import ThreadpoolController

        self._limit = ThreadpoolController().limit(limits=int(spec["blas_threads"]), user_api="blas")
        rng = LayerRange(*spec["layers"])
        if spec["kind"] == "container":
            from ..container import Container

            src = Container(spec["path"])
            if src.digest != spec["digest"]:
                from .errors import ShardError

                raise ShardError(f"{spec['name']}: the container at {src.path.name} has digest {src.digest[:16]}…, the "
                                 f"driver runs {spec['digest'][:16]}…; both sides must open the same container")
        else:
            from pathlib import Path

            from .store import ShardContainer, check_member

            check_member(Path(spec["set_path"]), spec["entry"], spec["digest"])  # the manifest, before the first call
            src = ShardContainer(Path(spec["set_path"]) / spec["entry"]["path"])
            src.check_holds(rng)
        self.src = src
        self.plan = src.op_plan()
        self.range = rng
        self.executors: dict[int, Any] = {}
        self.streams: dict[str, Any] = {}
        self.snaps: dict[tuple[str, int], Any] = {}
        self._executor(rng.end)  # prepare the whole range now
        import ray

        from ..exec.engine import decode_threads

        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "actor": ray.get_runtime_context().get_actor_id(), "prepare_seconds": time.perf_counter() - t0,
                "blas": blas_facts(), "decode_threads": decode_threads()}

    def _executor(self, end: int):
        ex = self.executors.get(end)
        if ex is None:
            from ..exec.engine import Executor

            r = LayerRange(self.range.start, end)
            if end <= self.range.start or end > self.range.end:
                from .errors import ShardError

                raise ShardError(f"{self.spec['name']} holds layers {self.range.start}..{self.range.end - 1}; "
                                 f"it refuses to run layers {r.start}..{r.end - 1}")
            ex = self.executors[end] = Executor(self.plan, self.src.tensor_source(), r)
        return ex

    def _stream(self, sid: str, end: int):
        st = self.streams.get(sid)
        if st is None:
            st = self.streams[sid] = self._executor(end).start()
        return st

    # -- calls from the driver ---------------------------------------------------------------
    def run(self, sid: str, end: int, h):
        """One pass of hidden states through this shard's layers below ``end``. Two returns:
        the hidden states (handed to the next shard) and what ran."""
        self.calls += 1
        st = self._stream(sid, end)
        out = st.prefill_hidden(h)
        return out, {"layers": list(st.trace.executed_layers), "seconds": st.trace.step_seconds[-1],
                     "position": st.position}

    def snapshot(self, sid: str, end: int, key: int) -> int:
        self.calls += 1
        st = self._stream(sid, end)
        self.snaps[(sid, key)] = st.snapshot()
        return st.position

    def restore(self, sid: str, end: int, key: int) -> int:
        self.calls += 1
        st = self._stream(sid, end)
        snap = self.snaps.get((sid, key))
        if snap is None:
            from ..errors import StateError

            raise StateError(f"{self.spec['name']}: no snapshot {key} of this stream (it was released)")
        st.restore(snap)
        return st.position

    def truncate(self, sid: str, end: int, pos: int) -> int:
        self.calls += 1
        st = self._stream(sid, end)
        st.truncate(pos)
        return st.position

    def state_bytes(self, sid: str) -> int:
        st = self.streams.get(sid)
        return 0 if st is None else st.state.nbytes

    def release(self, sid: str, key: int | None = None) -> None:
        """Forget a snapshot (key) or a whole stream (no key). Not counted as a call."""
        if key is None:
            self.streams.pop(sid, None)
            for k in [k for k in self.snaps if k[0] == sid]:
                del self.snaps[k]
        else:
            self.snaps.pop((sid, key), None)

    def stats(self) -> dict:
        return {"calls": self.calls, "streams": len(self.streams), "snapshots": len(self.snaps),
                "blas": blas_facts()}

    # -- fault injection, for tests and drills -------------------------------------------------
    def pause(self, seconds: float) -> None:
        """Hold the actor busy (calls queue behind this one)."""
        time.sleep(float(seconds))

    def crash(self) -> None:
        """Die at once, as a process killed mid-generation would."""
        os._exit(1)
