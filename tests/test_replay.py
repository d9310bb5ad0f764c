"""Replayed acceptance: the references file, and rounds equal to greedy speculative decoding's."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from test_speculative import FAVOURED, load_predictable_target, make_draft

from wingspan.decode.lookup import lookup_outcomes
from wingspan.decode.speculative import speculative_generate
from wingspan.errors import ConfigError
from wingspan.eval.prompts import EvalPrompt
from wingspan.eval.replay import References, build_references, comparison, markdown, replay
from wingspan.models.draft import write_draft
from wingspan.models.target import TargetModel

PROMPTS = {
    "chat": [EvalPrompt("a", ["Count from one to ten."]), EvalPrompt("b", ["Name a colour.", "And another one?"])],
    "math": [EvalPrompt("c", ["What is 2 + 2?"])],
}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama_dir) -> TargetModel:
    return load_predictable_target(tiny_llama_dir)


@pytest.fixture(scope="module")
def references(target) -> References:
    return build_references(target, "tiny", "float32", PROMPTS, 20, first_turns=False, batch_size=2)


@pytest.mark.parametrize(
    "layers, seed, favour, parallel", [(1, 12, 6.0, False), (2, 11, 3.0, False), (1, 24, 15.0, True)]
)
def test_replayed_rounds_are_the_decoders(target, references, layers, seed, favour, parallel):
    """Drafts biased towards FAVOURED that propose it in some rounds only: acceptance depends on their hidden
    states (a parallel draft's: on its mask slots'), so a draft fed otherwise than in decoding would give other
    rounds."""
    draft = make_draft(target, layers, seed=seed, favour=favour, parallel=parallel)
    assert [(r.set_name, r.prompt_id, r.turn) for r in references.items] == [
        ("chat", "a", 0),
        ("chat", "b", 0),
        ("chat", "b", 1),
        ("math", "c", 0),
    ]
    accepted = beyond_first = 0
    for k in (1, 3):
        sets = replay(draft, references, k)
        rounds = {p.id: p.accepted_per_round for s in sets for p in s.prompts}
        drafted = {p.id: p.drafted_per_round for s in sets for p in s.prompts}
        matched = {p.id: p.lookup_matched for s in sets for p in s.prompts}
        firsts = {p.id: p.first_tokens for s in sets for p in s.prompts}
        expected, expected_drafted, expected_matched, expected_firsts, positions = {}, {}, {}, {}, {}
        for item in references.items:
            prompt = item.tokens[: item.prompt_length].tolist()
            result = speculative_generate(target, draft, prompt, 20, num_draft_tokens=k)
            assert prompt + result.tokens == item.tokens[: item.prompt_length + len(result.tokens)].tolist()
            expected.setdefault(item.prompt_id, []).extend(result.accepted_per_round)
            expected_drafted.setdefault(item.prompt_id, []).extend(result.drafted_per_round)
            outcomes = lookup_outcomes(prompt, result, 2, 4)
            expected_matched.setdefault(item.prompt_id, []).extend(o is not None for o in outcomes)
            # at each round's start the first tokens are the decoder's: its first draft accepted, lookup's agreeing
            start, produced = positions.get(item.prompt_id, 0), 1
            for accepted_here, drafted_here, outcome in zip(
                result.accepted_per_round, result.drafted_per_round, outcomes
            ):
                if drafted_here:
                    lookup_hit = None if outcome is None else outcome >= 1
                    expected_firsts[item.prompt_id, start + produced - 1] = (accepted_here >= 1, lookup_hit)
                produced += accepted_here + 1
            positions[item.prompt_id] = start + item.reply_length - 1
        assert rounds == expected, k
        assert drafted == expected_drafted, k
        assert matched == expected_matched and any(any(m) for m in matched.values())
        assert {key: len(value) for key, value in firsts.items()} == positions
        assert {key: firsts[key[0]][key[1]] for key in expected_firsts} == expected_firsts
        assert any(hit for row in firsts.values() for hit, _ in row)
        assert any(lookup is not None for row in firsts.values() for _, lookup in row)
        accepted += sum(sum(r) for r in rounds.values())
        beyond_first += sum(a >= 2 for r in rounds.values() for a in r)
        chat = sets[0]
        assert chat.name == "chat" and chat.num_prompts == 2
        assert chat.rounds == len(rounds["a"]) + len(rounds["b"])
        assert chat.acceptance_length == (chat.rounds + sum(rounds["a"]) + sum(rounds["b"])) / chat.rounds
    assert 0 < accepted and (beyond_first > 0 or not parallel)  # a parallel draft: mask slots accepted too


def test_stopped_replies_carry_their_stop_token(target, tiny_llama_dir):
    target.eos_token_ids = [FAVOURED]
    try:
        stopped = build_references(target, "tiny", "float32", PROMPTS, 20, first_turns=True)
    finally:
        target.eos_token_ids = TargetModel.load(str(tiny_llama_dir), dtype="float32").eos_token_ids
    assert [item.turn for item in stopped.items] == [0, 0, 0]  # first turns only
    assert any(item.stopped for item in stopped.items)
    for item in stopped.items:
        assert len(item.tokens) == item.prompt_length + item.reply_length
        assert item.aux.shape == (len(item.tokens) - int(item.stopped), 3 * target.hidden_size)
        reply = item.tokens[item.prompt_length :].tolist()
        assert (reply[-1] == FAVOURED) == item.stopped and FAVOURED not in reply[:-1]
    # the decoder's rounds, bar the last of a stopped reply (a draft past the stop token counts as rejected)
    draft = make_draft(target, 1, seed=12, favour=6.0)
    replayed = [p for s in replay(draft, stopped, 3) for p in s.prompts]
    for item, row in zip(stopped.items, replayed, strict=True):
        prompt = item.tokens[: item.prompt_length].tolist()
        result = speculative_generate(target, draft, prompt, 20, num_draft_tokens=3, stop_ids=[FAVOURED])
        assert len(row.accepted_per_round) == len(result.accepted_per_round)
        end = -1 if item.stopped else None
        assert row.accepted_per_round[:end] == result.accepted_per_round[:end]


def test_references_save_and_load(references, tmp_path):
    path = tmp_path / "refs.safetensors"
    references.save(path)
    loaded = References.load(path)
    assert (loaded.target, loaded.dtype, loaded.aux_layer_ids, loaded.max_new_tokens) == (
        "tiny",
        "float32",
        [1, 2, 3],
        20,
    )
    for a, b in zip(references.items, loaded.items, strict=True):
        assert (a.set_name, a.prompt_id, a.turn, a.prompt_length, a.reply_length) == (
            b.set_name,
            b.prompt_id,
            b.turn,
            b.prompt_length,
            b.reply_length,
        )
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.aux, b.aux)
    References("tiny", "float32", [1, 2, 3], 20, False, []).save(tmp_path / "empty.safetensors")
    with pytest.raises(ConfigError, match="hold no reply"):
        References.load(tmp_path / "empty.safetensors")
    with pytest.raises(ConfigError, match="no such references file"):
        References.load(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(ConfigError, match="not a readable references file"):
        References.load(tmp_path / "junk.safetensors")


def test_a_draft_reading_other_layers_is_refused(target, references):
    draft = make_draft(target, 1, seed=0)
    draft.config.aux_layer_ids = [0, 1, 2]
    with pytest.raises(ConfigError, match=r"aux layers \[0, 1, 2\]"):
        replay(draft, references, 3)


def test_references_may_hold_more_layers_than_a_draft_reads(target, references):
    """Layers stored in another order, with one the draft does not read (noise): the draft reads its own columns."""
    draft = make_draft(target, 1, seed=12, favour=6.0)
    ids = references.aux_layer_ids
    hidden = references.items[0].aux.shape[1] // len(ids)
    noise = torch.Generator().manual_seed(0)

    def reordered(aux: torch.Tensor) -> torch.Tensor:
        slots = aux.split(hidden, dim=1)
        return torch.cat([slots[2], torch.randn(aux.shape[0], hidden, generator=noise), slots[0], slots[1]], dim=1)

    items = [replace(item, aux=reordered(item.aux)) for item in references.items]
    wider = replace(references, aux_layer_ids=[ids[2], 99, ids[0], ids[1]], items=items)
    expected = replay(draft, references, 3)
    assert [s.acceptance_length for s in replay(draft, wider, 3)] == [s.acceptance_length for s in expected]
    assert [p.accepted_per_round for s in replay(draft, wider, 3) for p in s.prompts] == [
        p.accepted_per_round for s in expected for p in s.prompts
    ]


def test_comparison_pairs_the_same_prompts(target, references):
    good, bad = make_draft(target, 1, seed=12, favour=10.0), make_draft(target, 2, seed=3, favour=3.0)
    rows = comparison(
        {"good": replay(good, references, 3), "bad": replay(bad, references, 3), "again": replay(good, references, 3)}
    )
    assert rows[0]["difference"] is None
    assert rows[1]["tau"] < rows[0]["tau"]
    low, high = rows[1]["difference_interval"]
    assert low <= rows[1]["difference"] <= high < 0
    assert rows[2]["difference"] == 0 and rows[2]["difference_interval"] == (0, 0)
    low, high = rows[0]["tau_interval"]
    assert low <= rows[0]["tau"] <= high
    for row in rows:
        assert 0 < row["rounds_with_match"] < 1 and row["tau_with_match"] >= 1 and row["tau_without_match"] >= 1
        assert 0 < row["positions_with_match"] < 1
        assert all(
            0 <= row[name] <= 1 for name in ("first_with_match", "lookup_first_with_match", "first_without_match")
        )
    text = markdown(rows, references, "refs.safetensors", 3)
    assert "| good | " in text and "| chat | math |" in text
    json.dumps(rows)  # results.json takes them as they are


def wingspan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wingspan", *args], capture_output=True, text=True, timeout=600)


def test_the_commands(target, tiny_llama_dir, tmp_path):
    """`wingspan replay references` then `score` of two drafts; their figures are the library's."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Count from one to ten.\nName a colour.\n")
    refs = tmp_path / "refs.safetensors"
    made = wingspan(
        "replay",
        "references",
        "--out",
        str(refs),
        "--target",
        str(tiny_llama_dir),
        "--sets",
        f"p={prompts}",
        "--aux-layer-ids",
        "1,2,3",
        "--max-new-tokens",
        "12",
        "--dtype",
        "fp32",
        "--device",
        "cpu",
    )
    assert made.returncode == 0, made.stderr
    assert "2 replies, aux layers [1, 2, 3]" in made.stdout
    drafts = []
    for name, seed in (("a", 12), ("b", 11)):
        draft = make_draft(target, 1, seed=seed, favour=6.0)
        write_draft(tmp_path / name, draft.trainable_state_dict(), draft.config)
        drafts.append(draft)
    out = tmp_path / "score"
    scored = wingspan(
        "replay",
        "score",
        "--references",
        str(refs),
        "--draft",
        str(tmp_path / "a"),
        "--draft",
        str(tmp_path / "b"),
        "--num-draft-tokens",
        "2",
        "--out",
        str(out),
        "--device",
        "cpu",
    )
    assert scored.returncode == 0, scored.stderr
    rows = json.loads((out / "results.json").read_text())["drafts"]
    # the sharpened target of these tests is not the saved one: score the saved target's references here
    references = References.load(refs)
    for row, draft in zip(rows, drafts, strict=True):
        (expected,) = replay(draft, references, 2)
        assert row["sets"] == {"p": expected.acceptance_length}
        assert row["prompts"] == {"p": [[p.id, p.rounds, p.accepted] for p in expected.prompts]}
    assert (out / "results.md").read_text() in scored.stdout
    missing = wingspan("replay", "score", "--references", str(tmp_path / "none"), "--draft", str(tmp_path / "a"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "no such references file" in missing.stderr
    # a draft of another target: refused in one line, before any draft is scored
    config = json.loads((tmp_path / "a" / "draft_config.json").read_text())
    config["target_hidden_size"] *= 2
    (tmp_path / "b" / "draft_config.json").write_text(json.dumps(config))
    other = wingspan("replay", "score", "--references", str(refs), "--draft", str(tmp_path / "b"), "--device", "cpu")
    last = other.stderr.strip().splitlines()[-1]
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr
    assert last.startswith("error: ") and "trained on a target with hidden size 64" in last
    twice = wingspan(
        "replay", "score", "--references", str(refs), "--draft", str(tmp_path / "a"), "--draft", str(tmp_path / "a")
    )
    assert twice.returncode == 2 and "given twice" in twice.stderr
