"""The depth ladder on a tiny random container, and the prompt bank it reads."""

import json
from pathlib import Path

import pytest

import vindex3
from vindex3.draft import run_ladder
from vindex3.draft.bank import bank_candidates, default_bank, file_sha256, load_prompts
from vindex3.errors import ConfigError, ContextLengthExceeded, SliceError, TokenizerMissing

ROOT = Path(__file__).resolve().parents[1]

# Token-id prompts: the tiny fixture carries no tokenizer of its own.
BANK = [
    {"id": "a-1", "category": "alpha", "token_ids": [1, 5, 9, 33, 100, 7]},
    {"id": "a-2", "category": "alpha", "token_ids": [2, 2, 8]},
    {"id": "b-1", "category": "beta", "token_ids": [40, 41, 42, 43, 44, 45, 46, 47]},
]


@pytest.fixture(scope="module")
def c(tiny_llama_container):
    x = tiny_llama_container
    return vindex3.open(x) if isinstance(x, (str, Path)) else x


@pytest.fixture
def bank(tmp_path):
    p = tmp_path / "bank.jsonl"
    p.write_text("".join(json.dumps(b) + "\n" for b in BANK))
    return p


def test_ladder_rows_pool_per_prompt_and_per_category(c, bank, tmp_path):
    L = c.graph.num_layers
    seen = []
    out = tmp_path / "ladder.json"
    rep = run_ladder(c, [1, L], bank, out_path=out, progress=lambda d, t, label: seen.append((d, t, label)),
                     work_dir=tmp_path / "work")
    positions = sum(len(b["token_ids"]) for b in BANK)
    assert [r.depth for r in rep.rows] == [1, L]
    for r in rep.rows:
        assert r.summary.positions == positions
        assert [p.id for p in r.per_prompt] == ["a-1", "a-2", "b-1"]
        assert r.per_category["alpha"].positions == 9 and r.per_category["beta"].positions == 8
        assert r.per_prompt[0].summary.positions == 6 and len(r.per_prompt[0].detail) == 6
        assert r.prepare_seconds > 0 and r.ms_per_position > 0
    full = rep.rows[-1]
    assert full.executed_layers == L
    assert full.summary.top1 == 1.0 and full.summary.kl_max == 0.0
    assert rep.rows[0].summary.kl_mean > 0
    # Progress: one call per dump (target once, then each depth), ending at total.
    assert len(seen) == 3 * 3 and seen[-1][:2] == (9, 9) and seen[0][2] == "full: a-1"
    # JSON carries the per-position detail and the bank's identity.
    j = json.loads(out.read_text())
    assert j["prompts_sha256"] == file_sha256(bank) and j["prompts_file"] == "bank.jsonl"
    assert len(j["rows"][0]["per_prompt"][2]["detail"]) == 8
    assert j["container_digest"] == c.digest
    # Kept dumps, each with its sidecar.
    assert (tmp_path / "work" / "d1-b-1.meta.json").is_file()
    from lql.statements.drafts import ladder_text  # vindex3's report is plain data; LQL lays it out

    lines = ladder_text(rep, timing=False).splitlines()
    assert "KL p50" in lines[1] and [ln.split()[0] for ln in lines[3:]] == [str(d) for d in rep.depths]


def test_ladder_refuses_impossible_depths_before_any_work(c, bank):
    L = c.graph.num_layers
    for depths, needle in [([0], "at least one layer"), ([L + 1], "deeper than the model"),
                           ([1, 1], "listed twice"), ([], "at least one depth"), ([1.5], "not an integer")]:
        with pytest.raises(SliceError, match=needle):
            run_ladder(c, depths, bank)


def test_the_frozen_bank_runs_through_the_container_tokenizer(c, tmp_path):
    # The first prompt of each category (the whole bank takes ~10 s on the tiny model's decode path).
    firsts = {}
    for line in default_bank(ROOT).read_text().splitlines():
        firsts.setdefault(json.loads(line)["category"], line)
    sub = tmp_path / "firsts.jsonl"
    sub.write_text("\n".join(firsts.values()) + "\n")
    L = c.graph.num_layers
    # The tiny tokenizer spends hundreds of tokens on some bank prompts: past the fixture's
    # context length of 256, which is refused by name before any dump unless raised explicitly.
    with pytest.raises(ContextLengthExceeded, match="context length"):
        run_ladder(c, [2, L], sub)
    rep = run_ladder(c, [2, L], sub, max_positions=1024)
    assert rep.prompts == 7 and len(rep.categories) == 7
    assert rep.rows[0].summary.positions == sum(len(c.tokenizer.encode(p.text)) for p in load_prompts(sub))
    assert set(rep.rows[0].per_category) == set(rep.categories)
    assert rep.rows[1].summary.top1 == 1.0 and rep.rows[1].summary.kl_max == 0.0


def test_text_prompts_need_a_tokenizer(tmp_path):
    from fixtures import build_checkpoint

    src = build_checkpoint("llama", tmp_path / "src", tokenizer=False)
    bare = vindex3.open(vindex3.encode(src, tmp_path / "bare.vindex3"))
    assert not bare.has_tokenizer
    with pytest.raises(TokenizerMissing, match="'fact-01' first"):
        run_ladder(bare, [1], default_bank(ROOT))


@pytest.mark.parametrize(
    "line, needle",
    [
        ('{"id": "x", "category": "c"}', "exactly one of text and token_ids"),
        ('{"id": "x", "category": "c", "text": "a", "token_ids": [1]}', "exactly one of text and token_ids"),
        ('{"id": "x", "text": "a"}', "category"),
        ('{"id": "x", "category": "c", "text": "a", "colour": "red"}', "colour"),
        ("{oops", "malformed JSON"),
    ],
)
def test_malformed_banks_are_refused_with_the_line(tmp_path, line, needle):
    p = tmp_path / "b.jsonl"
    p.write_text('{"id": "ok", "category": "c", "text": "fine"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=needle) as e:
        load_prompts(p)
    assert "line 2" in str(e.value)


def test_duplicate_prompt_ids_are_refused(tmp_path):
    p = tmp_path / "b.jsonl"
    p.write_text('{"id": "x", "category": "c", "text": "a"}\n{"id": "x", "category": "c", "text": "b"}\n')
    with pytest.raises(ConfigError, match="'x' appears twice"):
        load_prompts(p)


def test_frozen_bank_is_found_and_the_vendored_copy_is_unchanged():
    shared, vendored = bank_candidates(ROOT)
    assert vendored.is_file()
    assert default_bank(ROOT) == (shared if shared.is_file() else vendored)
    if shared.is_file():
        assert file_sha256(shared) == file_sha256(vendored)
    prompts = load_prompts(vendored)
    assert len(prompts) == 37
    assert {p.category for p in prompts} == {"fact", "code", "arithmetic", "narrative", "instruction", "list", "long"}
