"""LQL over layer-range shards: OPEN ... SHARDS n, SET shards = n, and the placement STATS and
EXPLAIN show. Answers are those of one process; a draft leaves the shards above it uncalled."""

from __future__ import annotations

import pytest

import lql
from lql.errors import StatementError

IDS = "5, 17, 42, 7, 99, 3, 250, 12"


@pytest.fixture(scope="module")
def local(containers):
    s = lql.connect(containers("llama"))
    (r,) = s.execute(f"INFER TOKENS ({IDS}) GENERATE 6 EXACTLY;")
    return r


def test_open_shards_answers_as_one_process_and_shows_placement(ray_cluster, containers, local):
    s = lql.Session()
    try:
        opened, stats, explain, infer = s.execute(
            f"OPEN '{containers('llama')}' SHARDS 2; STATS AT 10 POSITIONS; EXPLAIN DRAFT DEPTH 1; "
            f"INFER TOKENS ({IDS}) GENERATE 6 EXACTLY;")
        assert opened.shards == 2 and "2 layer-range actors" in opened.to_text()
        p = stats.placement
        assert [(x.name, x.layers) for x in p.shards] == [("shard-0", [0, 1]), ("shard-1", [2, 3])]
        assert p.bytes_per_hop_per_position == 64 * 4 and p.hops_per_position == 3
        assert sum(x.state_bytes for x in p.shards) == stats.state_bytes_at_positions
        assert "placement (full model" in stats.to_text(timing=False)
        assert explain.placement.untouched == ["shard-1"] and [x.name for x in explain.placement.shards] == ["shard-0"]
        assert "not called  shard-1" in explain.to_text(timing=False)
        assert infer.generated_ids == local.generated_ids and infer.executed_layers == [0, 1, 2, 3]
        (_off,) = s.execute("SET shards = 0;")
        assert s.settings["shards"] == 0 and s.execute("STATS;")[0].placement is None
        (again,) = s.execute(f"INFER TOKENS ({IDS}) GENERATE 6 EXACTLY;")
        assert again.generated_ids == local.generated_ids
    finally:
        s.close()


def test_shards_zero_is_refused_by_name(containers):
    with pytest.raises(StatementError, match="SHARDS must be at least 1"):
        lql.Session().execute(f"OPEN '{containers('llama')}' SHARDS 0;")
