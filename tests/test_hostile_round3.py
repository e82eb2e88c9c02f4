"""Hostile input, round three: what a hostile run through the server and the command lines found.
Each test names the finding it guards (issue 32's numbering) and fails without its fix."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import socket
import threading
import time

import pytest
from server_fixtures import config, free_port

pytest.importorskip("starlette", reason="SKIPPED LOUDLY: the server extra is not installed (pip install -e '.[dev]')")
from starlette.testclient import TestClient

from lql.server.app import create_app


@pytest.fixture
def client(tiny_llama_container):
    with TestClient(create_app(config(tiny_llama_container))) as c:
        yield c


@pytest.fixture
def ro_client(tiny_llama_container):
    with TestClient(create_app(config(tiny_llama_container, profile="read-only"))) as c:
        yield c


def query(c, text: str, **headers) -> list[dict]:
    r = c.post("/v1/query", json={"lql": text}, headers=headers)
    assert r.status_code in (200, 400, 403, 413, 422, 429), r.text
    return r.json().get("results") or [r.json()]


# ---- 1: a completion's lookahead is bounded before anything is allocated ---------------------


def test_1_speculate_lookahead_is_bounded_on_completions(client):
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0,
                                             "speculate": {"depth": 1, "lookahead": 1_000_000_000}})
    assert r.status_code == 400 and "speculate.lookahead" in r.json()["error"]["message"]


def test_1_speculation_allocates_by_what_it_can_use(tiny_llama_container):
    import tracemalloc

    from vindex3.draft import speculative_generate

    tracemalloc.start()
    try:
        res = speculative_generate(tiny_llama_container, [1, 2, 3], 3, 1, lookahead=200_000_000, compare_plain=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(res.accepted_histogram) <= 3 and peak < 200 * 2**20  # a list of 2e8 ints would be 1.6 GB


# ---- 2: a server session cannot raise the limits that guard it ------------------------------


@pytest.mark.parametrize("text", ["SET max_lookahead = 200000000", "SET memory_limit = '1 TiB'",
                                  "SET max_generate = 100000", "SET max_positions = model",
                                  "SET max_positions = 100000000"])
def test_2_limit_settings_only_go_down_on_a_server(ro_client, client, text):
    for c in (ro_client, client):
        res = query(c, text + ";")[0]
        assert not res["ok"] and "would raise a limit" in res["error"]["message"], res


def test_2_lowering_a_limit_is_allowed(ro_client):
    res = query(ro_client, "SET max_generate = 8; SET memory_limit = '1 GiB';")
    assert all(r["ok"] for r in res)


def test_2_a_setting_that_names_a_file_is_refused_on_a_server(ro_client, client):
    for c in (ro_client, client):
        for value in ("'/etc/passwd'", "'templates.json'"):
            res = query(c, f"SET templates = {value};")[0]
            assert not res["ok"] and res["error"]["type"] == "ProfileRefusal", res
            assert "SET templates names a file" in res["error"]["message"]


# ---- 3: STATS 'path' is confined to the data directory --------------------------------------


def test_3_stats_path_is_confined(tiny_llama_container, tmp_path):
    cfg = config(tiny_llama_container, data_dir=tmp_path)
    with TestClient(create_app(cfg)) as c:
        for path in (str(tiny_llama_container), "../x", "/etc", "/nonexistent/deep"):
            res = query(c, f"STATS '{path}';")[0]
            assert not res["ok"] and res["error"]["type"] == "PathRefusal", res
            # the answer does not say whether the outside path exists
            msg = res["error"]["message"]
            assert "does not exist" not in msg and "not a directory" not in msg and "index.json" not in msg


# ---- 5: a pipe's statements count against --max-statements -----------------------------------


def test_5_pipes_count_each_statement(tiny_llama_container):
    with TestClient(create_app(config(tiny_llama_container, max_statements=4))) as c:
        r = c.post("/v1/query", json={"lql": " |> ".join(["SHOW SETTINGS"] * 10) + ";"})
        assert r.status_code == 429 or r.status_code == 400, r.text
        assert "10 statements" in r.text and "--max-statements" in r.text


# ---- 6: 500s from sampling and from nesting ---------------------------------------------------


def test_6_negative_seed_is_refused_by_name(client):
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0.7, "seed": -1})
    assert r.status_code == 400 and "'seed'" in r.json()["error"]["message"]


def test_6_a_tiny_temperature_samples_the_argmax(client):
    greedy = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "temperature": 0}).json()
    tiny = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "temperature": 1e-320, "seed": 1})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy["choices"][0]["text"]


@pytest.mark.parametrize("path", ["/v1/query", "/v1/completions", "/v1/chat/completions"])
def test_6_deeply_nested_json_is_a_named_400(client, path):
    r = client.post(path, content=b"[" * 200_000, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nests" in r.json()["error"]["message"]


# ---- 15: strict request bodies, strict token lists, a script's byte-order mark ----------------


@pytest.mark.parametrize("field,value", [("top_p", True), ("max_tokens", "1"), ("temperature", "0"), ("stream", 1)])
def test_15_request_fields_are_not_coerced(client, field, value):
    r = client.post("/v1/completions", json={"prompt": "Hi", field: value})
    assert r.status_code == 400 and repr(field) in r.json()["error"]["message"]


@pytest.mark.parametrize("tokens", ["1,,2", "\u0661", "1_0", "1, 2,", " "])
def test_15_exec_tokens_take_ascii_whole_numbers(tiny_llama_container, tokens, capsys):
    from vindex3.cli import main

    assert main(["exec", str(tiny_llama_container), "--tokens", tokens]) == 2
    assert "--tokens takes comma-separated whole numbers" in capsys.readouterr().err


def test_15_a_script_with_a_byte_order_mark_runs(tmp_path):
    import lql

    p = tmp_path / "bom.lql"
    p.write_bytes("\ufeffSHOW SETTINGS;\n".encode())
    assert lql.Session().run_file(p)[0].kind == "show_settings"


# ---- 13: connections that send nothing, or go away mid-body ----------------------------------


@contextlib.contextmanager
def bounded_server(app, header_timeout: float):
    from lql.server.transport import server

    port = free_port()
    srv = server(app, "127.0.0.1", port, header_timeout=header_timeout, graceful=1)
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert t.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        srv.should_exit = True
        t.join(10)
        assert not t.is_alive(), "the test server did not stop"


def test_13_a_connection_that_sends_no_head_is_closed(tiny_llama_container):
    with bounded_server(create_app(config(tiny_llama_container)), header_timeout=0.5) as port, \
            socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST /v1/query HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        t0 = time.monotonic()
        assert s.recv(1024) == b""  # closed by the server, not by our timeout
        assert time.monotonic() - t0 < 4


def test_13_a_client_gone_mid_body_is_not_an_internal_error(tiny_llama_container, caplog):
    with bounded_server(create_app(config(tiny_llama_container)), header_timeout=5) as port, \
            caplog.at_level(logging.ERROR):
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"POST /v1/query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 1000\r\n\r\n{\"lql\": ")
        time.sleep(0.5)
    assert not [r for r in caplog.records if "internal" in r.getMessage().lower() or r.exc_info], \
        [r.getMessage() for r in caplog.records]


def test_json_of_refusals_stays_parseable(client):
    r = client.post("/v1/query", content=b'{"lql": ' + b"[" * 5000)
    assert r.status_code == 400 and json.loads(r.text)["error"]
    assert io.StringIO(r.text).read()


# ---- 12: records and shard manifests that are not what they claim -------------------------


@pytest.mark.parametrize("path", ["a" * 5000, "/proc/self/mem"])
def test_12_record_verify_refuses_by_name(path, capsys):
    from vindex3.cli import main

    assert main(["record", "verify", path]) == 2
    assert "record" in capsys.readouterr().err


@pytest.mark.parametrize("mutate,words", [
    (lambda m: [m], "holds a JSON list"),
    (lambda m: {**m, "shards": [{**m["shards"][0], "path": "/etc"}] + m["shards"][1:]}, "is not one name"),
    (lambda m: {**m, "shards": [{**m["shards"][0], "path": "../x"}] + m["shards"][1:]}, "is not one name"),
    (lambda m: {**m, "ends": {**m["ends"], "path": ""}}, "is not one name"),
])
def test_12_a_shard_manifest_is_checked_before_any_member_is_read(tiny_llama_container, tmp_path, mutate, words):
    from vindex3 import jsonio
    from vindex3.shards import ShardError, open_set, write_shards

    out = write_shards(tiny_llama_container, tmp_path / "set", 2)
    mp = out / "manifest.json"
    mp.write_text(json.dumps(mutate(jsonio.load(mp))))
    with pytest.raises(ShardError, match=words):
        open_set(out)


# ---- 14: nothing writes into a container directory but its own writer ------------------------


def test_14_no_statement_writes_into_any_container(tiny_llama_container, tmp_path):
    import shutil

    import lql
    from lql.errors import EngineRefusal

    other = tmp_path / "other.vindex3"
    shutil.copytree(tiny_llama_container, other)
    before = (other / "index.json").read_bytes()
    s = lql.connect(tiny_llama_container)
    for target in (other / "index.json", other / "segments" / "x.f32", other / "new.f32"):
        with pytest.raises(EngineRefusal, match="inside the container"):
            s.execute(f"DUMP LOGITS 'Hi' INTO '{target}' OVERWRITE")
    assert (other / "index.json").read_bytes() == before
    s.execute(f"DUMP LOGITS 'Hi' INTO '{tmp_path / 'beside.f32'}'")  # beside it is fine


# ---- 7 and 11: OBSERVE and TRACE ... FOR are bounded before they run --------------------------


def test_7_observe_generate_is_bounded_by_max_generate_and_the_context(tiny_llama_container, tmp_path):
    import lql
    from lql.errors import LimitError

    s = lql.connect(tiny_llama_container)
    t0 = time.monotonic()
    with pytest.raises(LimitError, match="max_generate"):
        s.execute(f"OBSERVE 'Hi' GENERATE 10000000 RECORD INTO '{tmp_path / 'r.jsonl'}'")
    s.execute("SET max_generate = 100000")
    with pytest.raises(LimitError, match="positions"):
        s.execute(f"OBSERVE 'Hi' GENERATE 99999 RECORD INTO '{tmp_path / 'r.jsonl'}'")
    assert time.monotonic() - t0 < 5 and not (tmp_path / "r.jsonl").exists()


def test_11_trace_for_is_bounded_by_memory_limit_before_it_runs(tiny_llama_container):
    import lql
    from lql.errors import LimitError

    s = lql.connect(tiny_llama_container)
    s.execute("SET memory_limit = '1 MiB'")
    prompt = "TOKENS (" + ", ".join(["5"] * 200) + ")"
    t0 = time.monotonic()
    with pytest.raises(LimitError, match="memory_limit"):
        s.execute(f"TRACE {prompt} FOR 7 POSITIONS ALL")
    assert time.monotonic() - t0 < 5
    s.execute("SET memory_limit = '4 GiB'")
    assert s.execute_one("TRACE TOKENS (5, 6) FOR 7").kind == "trace_for"  # within the limit it runs


# ---- 9: a container modified in place while open -----------------------------------------------


def test_9_a_segment_changed_while_open_is_refused_before_the_next_statement(tiny_llama_container, tmp_path):
    import os
    import shutil

    import lql
    from lql.errors import EngineRefusal

    c = tmp_path / "c.vindex3"
    shutil.copytree(tiny_llama_container, c)
    s = lql.connect(c)
    before = s.execute_one("INFER 'Hi' TOP 1").logits.copy()
    seg = max((c / "segments").glob("*.bin"))
    data = bytearray(seg.read_bytes())
    data[-8:] = b"\x00\x00\x80\x7f" * 2  # rewrite the last bytes in place (same size)
    st = seg.stat()
    seg.write_bytes(bytes(data))
    os.utime(seg, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a modification time that moved
    with pytest.raises(EngineRefusal, match="was modified on disk while the container was open"):
        s.execute("INFER 'Hi' TOP 1")
    with pytest.raises(EngineRefusal):
        s.execute("STATS")
    s2 = lql.Session()
    with pytest.raises(EngineRefusal):  # reopened, it is verified: the altered tensor is refused at first use
        s2.execute(f"OPEN '{c}'; INFER 'Hi' TOP 1")
    assert before is not None


# ---- 8: huge but finite weights never give silent zeros -----------------------------------------


def _huge(tiny, tmp_path, encoding: str, tensor: str, value: float, where: str = "one"):
    """A copy of the tiny container in ``encoding`` with ``value`` written into ``tensor`` of the
    decoder stack through that encoding, resealed (every hash agrees with the bytes)."""
    import shutil

    from corruption import huge_into

    from vindex3.represent import represent

    c = tmp_path / f"{encoding}.vindex3"
    if encoding == "f32":
        shutil.copytree(tiny, c)
    else:
        represent(tiny, c, encoding)
    huge_into("segments/decoder_stack.bin", tensor, value, where=where)(c)
    return c


@pytest.mark.parametrize("encoding,value", [("f32", 3e38), ("f32", -1e25), ("bf16", 3e38), ("int8", 1e30)])
def test_8_the_first_use_scan_bounds_magnitudes_per_encoding(tiny_llama_container, tmp_path, encoding, value):
    """One weight of 3e38 in bf16, or one int8 block scale of 1e30 (its codes make weights of
    ~1e32), passes the NaN/inf scan; the magnitude scan refuses it by name at first use, before
    anything is computed with it, and VERIFY names it too."""
    import vindex3
    from vindex3.errors import IntegrityError

    c = _huge(tiny_llama_container, tmp_path, encoding, "0.mlp.down_proj.weight", value)
    opened = vindex3.open(c)  # opening reads no tensor data
    with pytest.raises(IntegrityError, match=rf"tensor 0\.mlp\.down_proj\.weight \({encoding}\) decodes to a magnitude "
                                             r"of [0-9.e+]+, past the 1\.84e\+19"):
        opened.executor()
    rep = vindex3.verify(c)
    assert not rep.ok and any("0.mlp.down_proj.weight" in p and "magnitude" in p for p in rep.problems)


def test_8_the_scan_costs_one_bounded_pass_and_is_recorded(tiny_llama_container):
    import vindex3
    from vindex3.scan import CHUNK

    c = vindex3.open(tiny_llama_container)
    c.executor(slice=vindex3.Draft(1))
    cost = c.first_use_cost()
    assert [r["encoding"] for r in cost] == ["f32"]
    used = {(ref.object, ref.tensor) for ref in c.plan_slice(vindex3.Draft(1)).operands}
    assert cost[0]["tensors"] == len(used) < sum(len(s.entries) for s in c.segments.values())  # only what was read
    assert 0 < cost[0]["max_abs"] < 1e3 and cost[0]["scan_seconds"] >= 0 and cost[0]["hash_seconds"] >= 0
    assert CHUNK * 4 == 4 << 20  # the scan's temporaries: 4 MiB, whatever the tensor's size
    c.executor()  # a second executor scans only what the first did not
    assert c.first_use_cost()[0]["tensors"] == len(c._checked) > len(used)


def test_8_a_huge_finite_weight_is_a_named_refusal_not_zero_logits(tiny_llama_container, tmp_path):
    """A magnitude under the scan's bound can still carry a run past float32's range: the run is
    refused by name at the layer and site where it breaks, never silent zero logits."""
    import vindex3
    from vindex3.errors import NonFiniteActivation

    c = _huge(tiny_llama_container, tmp_path, "f32", "0.mlp.down_proj.weight", 1e19, where="all")
    ex = vindex3.open(c).executor()  # 1e19 is under the bound: the scan lets it through
    with pytest.raises(NonFiniteActivation, match=r"^layer [01]: ") as e:  # where float32 first breaks
        ex.forward([1, 2, 3])
    assert e.value.layer in (0, 1) and e.value.site in ("norm", "residual_post")


# ---- 10: a read-only server keeps the feature metadata it built ------------------------------


def test_10_walk_on_a_read_only_server_builds_metadata_once(tiny_llama_container):
    with TestClient(create_app(config(tiny_llama_container, profile="read-only"))) as c:
        first = query(c, "WALK 'Paris' TOP 2;")[0]
        second = query(c, "WALK 'Paris' TOP 2;")[0]  # another request, another session
        assert first["ok"] and second["ok"], (first, second)
        built = [json.dumps(x) for x in (first["result"].get("metadata"), second["result"].get("metadata"))]
        assert "built" in built[0] and "built now" not in built[1], built
        host = c.app.state.server.host(None)
        assert host._internals is not None  # the model's one Internals, kept in memory


# ---- 4: sessions that open one container share it; a memory ceiling refuses new opens --------


def test_4_sessions_opening_one_container_share_one_prepared_model(tiny_llama_container, tmp_path):
    import gc
    import os
    import shutil

    import numpy as np

    import lql
    from lql import prepared

    c = tmp_path / "shared.vindex3"
    shutil.copytree(tiny_llama_container, c)
    s1, s2 = lql.connect(c), lql.Session()
    s2.execute(f"OPEN '{c}{os.sep}'")  # another spelling of the same directory
    assert s1.prepared is s2.prepared and s1.base_container is s2.base_container
    a = s1.execute_one("INFER 'Hi' TOP 3").logits.copy()
    checked = len(s1.base_container._checked)
    assert not s2._executors  # per-session state: s1's executor is its own
    b = s2.execute_one("INFER 'Hi' TOP 3").logits.copy()
    assert np.array_equal(a, b)
    assert len(s2.base_container._checked) == checked  # no tensor hashed or scanned again
    assert s1._executors is not s2._executors
    s1.execute("DRAFT DEPTH 1")
    assert s2.draft_depth is None
    s1.close()
    assert s1.prepared is None and s2.prepared is not None
    assert np.array_equal(s2.execute_one("INFER 'Hi' TOP 3").logits, a)  # closing one breaks nothing
    s3 = lql.connect(c)
    assert s3.prepared is s2.prepared
    key = s2.prepared.key
    s2.close()
    s3.close()
    del s1, s2, s3
    gc.collect()
    assert key not in [m.key for m in prepared.held()]  # forgotten when nobody holds it


def test_4_a_container_changed_on_disk_is_opened_afresh(tiny_llama_container, tmp_path):
    import shutil

    import lql

    c = tmp_path / "c.vindex3"
    shutil.copytree(tiny_llama_container, c)
    s1 = lql.connect(c)
    seg = c / "segments" / "final_norm.bin"
    seg.write_bytes(seg.read_bytes())  # the same bytes, written again: a changed file all the same
    s2 = lql.connect(c)
    assert s2.prepared is not s1.prepared  # verified afresh, never the stale one
    s2.execute("INFER 'Hi' TOP 1")


def test_4_a_memory_ceiling_refuses_a_new_open_by_name_before_anything_is_opened(tiny_llama_container, tmp_path):
    import gc
    import os
    import shutil

    from lql import prepared
    from lql.server.config import ModelSpec
    from lql.server.models import ModelHost
    from lql.text import fmt_bytes

    for name in ("a.vindex3", "b.vindex3"):
        shutil.copytree(tiny_llama_container, tmp_path / name)
    host = ModelHost(ModelSpec("tiny", tiny_llama_container))
    gc.collect()
    need = prepared.needs(tmp_path / "a.vindex3")
    ceiling = prepared.in_use() + need  # room for exactly one more model
    cfg = config(tiny_llama_container, data_dir=tmp_path, memory_ceiling=ceiling)
    with TestClient(create_app(cfg, hosts=[host])) as c:
        first = query(c, "OPEN 'a.vindex3';", **{"X-Session-Id": "one"})[0]
        assert first["ok"], first
        t0 = time.monotonic()
        res = query(c, "OPEN 'b.vindex3';", **{"X-Session-Id": "two"})[0]
        assert not res["ok"] and res["error"]["type"] == "MemoryCeiling", res
        msg = res["error"]["message"]
        assert f"needs {fmt_bytes(need)}" in msg and f"ceiling is {fmt_bytes(ceiling)}" in msg
        assert f"{fmt_bytes(ceiling)} is in use" in msg
        assert time.monotonic() - t0 < 5
        b = os.path.realpath(tmp_path / "b.vindex3")
        assert b not in [m.key for m in prepared.held()]  # refused before it was opened
        # the container already open is shared: opening it again needs nothing more
        again = query(c, "OPEN 'a.vindex3'; INFER 'Hi' TOP 1;", **{"X-Session-Id": "three"})
        assert all(r["ok"] for r in again), again
        srv = c.app.state.server
        one, three = (srv.sessions.get(host, sid).session for sid in ("one", "three"))
        assert one.prepared is three.prepared


def test_4_open_default_is_checked_against_the_ceiling_before_the_cache_is_touched(monkeypatch, tmp_path, tiny_llama_container):
    import shutil

    import lql
    from lql.prepared import MemoryCeiling
    from vindex3 import default_model

    cache = tmp_path / "cache"
    shutil.copytree(tiny_llama_container, cache / default_model.CONTAINER_NAME)
    monkeypatch.setenv("VINDEX3_CACHE", str(cache))
    touched = []
    monkeypatch.setattr(default_model, "ensure_detailed", lambda *a, **k: touched.append(1))
    s = lql.Session()
    s.memory_ceiling = 1  # no model fits
    with pytest.raises(MemoryCeiling, match=r"OPEN DEFAULT: the model needs .* and the memory ceiling is 1 bytes"):
        s.execute("OPEN DEFAULT")
    assert not touched and s.prepared is None


def test_4_the_memory_ceiling_is_a_flag(tiny_llama_container):
    from lql.server.cli import UsageError, arg_parser, config_from_args

    cfg, _, _ = config_from_args(arg_parser().parse_args([str(tiny_llama_container), "--memory-ceiling", "1048576"]))
    assert cfg.limits.memory_ceiling == 1 << 20
    with pytest.raises(UsageError, match="--memory-ceiling must be at least 1"):
        config_from_args(arg_parser().parse_args([str(tiny_llama_container), "--memory-ceiling", "0"]))


def test_4_open_refuses_what_it_refused_before_it_shared(tiny_llama_container, tmp_path):
    """The ceiling's look at the index comes first now; what OPEN refuses, and how, is unchanged."""
    import lql
    import vindex3
    from lql.errors import EngineRefusal
    from vindex3.shards import write_shards

    out = write_shards(vindex3.open(tiny_llama_container), tmp_path / "set", 2)
    s = lql.Session()
    s.memory_ceiling = 1 << 40
    for path, words in ((out / "shard-0", "is a member of a shard set"), (tmp_path / "nope", "does not exist"),
                        (tmp_path, "has no index.json")):
        with pytest.raises(EngineRefusal, match=words):
            s.execute(f"OPEN '{path}'")


def test_4_threads_opening_one_container_get_one_model(tiny_llama_container, tmp_path):
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    from lql import prepared

    c = tmp_path / "t.vindex3"
    shutil.copytree(tiny_llama_container, c)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: prepared.acquire(c), range(8)))
    assert all(m is got[0] for m in got)


def test_8_the_scan_decodes_each_encoding_as_its_kernels_do():
    """For every encoding this build writes, the scan's largest magnitude is exactly the largest
    |value| of the decoded tensor (2-D and a stacked bank), and a value past the bound is seen."""
    import numpy as np

    from vindex3 import codecs
    from vindex3.errors import UnsupportedEncoding
    from vindex3.scan import MAGNITUDE_BOUND, scan

    rng = np.random.default_rng(0)
    seen = []
    for shape in ((64, 256), (2, 48, 64)):
        a = (rng.standard_normal(shape) * 3).astype(np.float32)
        for name in codecs.known():
            c = codecs.get(name)
            try:
                raw = np.asarray(c.encode(a)).reshape(-1).view(np.uint8)
            except UnsupportedEncoding:
                continue  # carried from checkpoints only (fp8, nvfp4, the K-quants)
            w = c.weight(raw, shape)
            found = scan(w)
            assert found.max_abs == float(np.abs(w.dense()).max()) and found.nonfinite == 0, name
            seen.append(name)
    assert {"f32", "bf16", "f16", "int8", "q4", "q8_0", "q4_1"} <= set(seen)
    big = np.zeros((4, 32), np.float32)
    big[1, 3] = 1e20
    assert scan(codecs.get("f32").weight(codecs.get("f32").encode(big), big.shape)).max_abs >= MAGNITUDE_BOUND
