"""The OpenAPI document (generated from the request models, every route in it, request bodies
validating against it exactly as the server validates them) and CORS (off unless origins are
configured; a preflight from a configured origin is answered without a key, never a 401)."""

from __future__ import annotations

import pytest
from server_fixtures import config
from starlette.routing import Route
from starlette.testclient import TestClient

from lql.server.app import create_app


def test_openapi_document_lists_every_route_and_the_request_models(tiny_llama_container):
    jsonschema = pytest.importorskip("jsonschema", reason="SKIPPED LOUDLY: jsonschema is needed to check the schemas")
    from lql.server import completions as C
    from lql.server.app import _QUERY_FIELDS

    with TestClient(create_app(config(tiny_llama_container, api_key="k"))) as c:
        r = c.get("/openapi.json", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200
        doc = r.json()
        assert doc["openapi"] == "3.1.0" and doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        routes = {(m, rt.path.replace("{model:path}", "{model}")) for rt in c.app.routes if isinstance(rt, Route)
                  for m in rt.methods - {"HEAD"}}
        documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
        assert routes == documented
        assert "security" not in doc["paths"]["/health"]["get"] and doc["paths"]["/v1/query"]["post"]["security"]
        schemas = doc["components"]["schemas"]
        assert set(schemas["CompletionRequest"]["properties"]) == set(C.CompletionRequest.model_fields)
        assert set(schemas["ChatRequest"]["properties"]) == set(C.ChatRequest.model_fields)
        assert set(schemas["QueryRequest"]["properties"]) == _QUERY_FIELDS

        def check(path: str, body: dict) -> bool:
            ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            schema = {**ref, "components": doc["components"]}
            try:
                jsonschema.Draft202012Validator(schema).validate(body)
            except jsonschema.ValidationError:
                return False
            return True

        # what the document accepts, the server accepts, and the other way round
        for body in ({"prompt": "Water", "max_tokens": 2, "temperature": 0, "n": 2},
                     {"prompt": [5, 6], "max_tokens": 1, "logprobs": 2},
                     {"prompt": "x", "n": 17}, {"prompt": "x", "frobnicate": 1}, {"prompt": "x", "max_tokens": "2"},
                     {"max_tokens": 2}):
            served = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer k"}).status_code
            assert check("/v1/completions", body) == (served == 200), (body, served)
        assert check("/v1/query", {"lql": "STATS"}) and not check("/v1/query", {"lql": "STATS", "x": 1})

        assert c.get("/openapi.json").status_code == 401  # behind the key like the API it describes
    with TestClient(create_app(config(tiny_llama_container))) as c:
        doc = c.get("/openapi.json").json()
        assert "securitySchemes" not in doc["components"] and "security" not in doc["paths"]["/v1/query"]["post"]


def test_cors_is_off_by_default(tiny_llama_container):
    with TestClient(create_app(config(tiny_llama_container))) as c:
        r = c.get("/v1/models", headers={"Origin": "http://localhost:3000"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = c.options("/v1/completions", headers={"Origin": "http://localhost:3000",
                                                  "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in r.headers


def test_cors_answers_configured_origins_only(tiny_llama_container):
    cfg = config(tiny_llama_container, api_key="k", cors_origins=("http://localhost:3000",))
    with TestClient(create_app(cfg)) as c:
        pre = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
        r = c.options("/v1/completions", headers=pre)
        assert r.status_code == 200  # a preflight carries no key: answered, not a 401
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = c.options("/v1/completions", headers={**pre, "Origin": "http://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        # the request itself still needs the key, and carries the header for the configured origin only
        r = c.get("/v1/models", headers={"Origin": "http://localhost:3000"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = c.get("/v1/models", headers={"Origin": "http://localhost:3000", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = c.get("/v1/models", headers={"Origin": "http://evil.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_origin_flag(tiny_llama_container):
    from lql.server.cli import UsageError, arg_parser, config_from_args

    args = arg_parser().parse_args([str(tiny_llama_container), "--cors-origin", "http://localhost:3000",
                                    "--cors-origin", "https://app.example:8443"])
    assert config_from_args(args)[0].cors_origins == ("http://localhost:3000", "https://app.example:8443")
    assert config_from_args(arg_parser().parse_args([str(tiny_llama_container)]))[0].cors_origins == ()
    for bad in ("localhost:3000", "http://localhost:3000/", "http://x/path"):
        with pytest.raises(UsageError, match="is not an origin"):
            config_from_args(arg_parser().parse_args([str(tiny_llama_container), "--cors-origin", bad]))


def test_results_and_errors_over_http_name_containers_by_their_served_name(tiny_llama_container, tmp_path):
    import shutil

    data = tmp_path / "data"
    data.mkdir()
    shutil.copytree(tiny_llama_container, data / "other.vindex3")
    cfg = config(tiny_llama_container, model_id="tiny", data_dir=data)
    with TestClient(create_app(cfg)) as c:
        stats = c.get("/v1/models/tiny/stats").text
        assert str(tiny_llama_container) not in stats and str(tmp_path) not in stats
        assert c.get("/v1/models/tiny/stats").json()["result"]["path"] == "tiny"
        r = c.post("/v1/query", json={"lql": "STATS; OPEN 'other.vindex3'; STATS; OPEN 'missing.vindex3'"}).json()
        text = str(r)
        assert str(tiny_llama_container) not in text and str(data) not in text and str(tmp_path) not in text
        assert r["results"][0]["result"]["path"] == "tiny"
        assert r["results"][2]["result"]["path"] == "other.vindex3"  # relative to the data directory
        assert r["results"][3]["ok"] is False and "missing.vindex3" in r["results"][3]["error"]["message"]
