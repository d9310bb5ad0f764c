"""init_copy_head: a draft planted with a copy head proposes what followed the input token's earlier occurrence."""

import pytest
import torch
from conftest import random_llama_target, tiny_draft_config

from wingspan.config import TrainConfig
from wingspan.data.template import TokenizedConversation
from wingspan.errors import ConfigError
from wingspan.eval.replay import draft_hits
from wingspan.models.draft import Eagle3Draft
from wingspan.models.target import TargetModel
from wingspan.train.copy_head import check_plantable, plant_copy_head, with_copy_head_default
from wingspan.train.trainer import build_draft, draft_config_for, train

VOCAB = 512
LENGTH = 64

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> TargetModel:
    """Tied embeddings, as SmolLM2's: lm_head reads a token's embedding direction as that token."""
    return random_llama_target(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )


def random_conversations(n: int, seed: int) -> list[TokenizedConversation]:
    g = torch.Generator().manual_seed(seed)
    return [
        TokenizedConversation(torch.randint(2, VOCAB, (LENGTH,), generator=g).tolist(), [1] * LENGTH) for _ in range(n)
    ]


def trained_draft(target, tmp_path, plant: bool) -> Eagle3Draft:
    """One step at a negligible lr: the draft as it starts."""
    config = TrainConfig(
        output_dir=str(tmp_path / ("planted" if plant else "plain")),
        aux_layer_ids=[0, 1, 2],
        init_copy_head=plant,
        max_length=LENGTH,
        batch_tokens=4 * LENGTH,
        ttt_steps=2,
        lr=1e-12,
        max_steps=1,
        target_dtype="float32",
    )
    d2t, t2d = torch.zeros(VOCAB, dtype=torch.long), torch.ones(VOCAB, dtype=torch.bool)
    final = train(config, target, random_conversations(64, seed=1), d2t, t2d)
    return Eagle3Draft.load(final, target.embed_weight())


def copy_rates(draft: Eagle3Draft, target: TargetModel) -> tuple[float, float]:
    """Step 0's hit rate on fresh random text (first half) and on the same text again (second half), where the
    right draft at origin i is what followed the same token in the first half."""
    half = torch.randint(2, VOCAB, (LENGTH // 2,), generator=torch.Generator().manual_seed(7))
    tokens = torch.cat([half, half])
    hits = draft_hits(draft, tokens, target.forward(tokens[None]).aux_hidden[0], 1)[0, :-2].float()
    middle = LENGTH // 2 - 1  # origin i predicts x_{i+2}: from here on, a token of the repeat
    return float(hits[: middle - 1].mean()), float(hits[middle:].mean())


def test_a_planted_draft_proposes_what_followed_the_earlier_occurrence(target, tmp_path, capsys):
    fresh, repeated = copy_rates(trained_draft(target, tmp_path, plant=True), target)
    assert "init_copy_head: a copy head planted in layer 0" in capsys.readouterr().out
    assert repeated > 0.8 and fresh < 0.1, (fresh, repeated)
    fresh, repeated = copy_rates(trained_draft(target, tmp_path, plant=False), target)
    assert repeated < 0.1 and fresh < 0.1, (fresh, repeated)


def test_the_match_needs_head_dims_that_rope_barely_turns():
    draft = Eagle3Draft(tiny_draft_config(vocab_size=VOCAB, draft_vocab_size=VOCAB))  # head_dim 8
    with pytest.raises(
        ConfigError, match="init_copy_head: only 2 head dims turn by less than 1.0 rad over max_length 512"
    ):
        check_plantable(draft.config, 512)


@pytest.mark.parametrize(
    "other", [{"init_from": "runs/x/draft"}, {"init_layers_from_target": True}, {"init_from_target": False}]
)
def test_a_copy_head_is_planted_in_a_new_draft_from_the_target_only(other):
    with pytest.raises(ConfigError, match="init_copy_head: plants a head in a new draft"):
        TrainConfig(init_copy_head=True, **other)


def test_an_unset_copy_head_is_planted_where_a_new_chain_draft_can_hold_one(target, capsys):
    def chosen(**settings) -> bool:
        config = TrainConfig(**{"max_length": LENGTH, **settings})
        return with_copy_head_default(config, draft_config_for(target, config, VOCAB, VOCAB)).init_copy_head

    assert chosen() is True
    assert "init_copy_head: on, the default for a new draft" in capsys.readouterr().out
    assert chosen(draft_mode="parallel") is False
    assert chosen(init_from="runs/x/draft") is False
    assert chosen(init_layers_from_target=True) is False
    assert (
        chosen(max_length=100_000, batch_tokens=100_000) is False
    )  # no RoPE pair of head_dim 32 stays still over that length
    assert "off, only 0 head dims turn by less than 1.0 rad over max_length 100000" in capsys.readouterr().out
    assert chosen(init_copy_head=False) is False


def synthetic_features(target: TargetModel, tokens: torch.Tensor, sink: bool, seed: int) -> torch.Tensor:
    """Aux features [rows * LENGTH, 3H] of rows of LENGTH tokens, shaped as a real target's: layer 0 is the
    embeddings, the last layer has a near-constant dim and noise, and (`sink`) each row's first position has an
    outsized activation, the target's attention sink."""
    g = torch.Generator().manual_seed(seed)
    hidden = target.hidden_size
    embeddings = target.embed_weight().float()[tokens]
    middle = torch.randn(len(tokens), hidden, generator=g)
    last = torch.randn(len(tokens), hidden, generator=g)
    last[:, 0] += 8  # a dim that hardly varies (as massive activations do)
    if sink:
        last[::LENGTH, 1] += 300
    return torch.cat([embeddings, middle, last], dim=1)


def copy_head_loudness(target: TargetModel, sink: bool) -> tuple[float, float]:
    """The planted head's output (its first query head's share of o_proj's input) on fresh text, then on its
    repeat, with features that have a sink or none."""
    config = TrainConfig(init_copy_head=True, max_length=LENGTH, target_dtype="float32")
    d2t, t2d = torch.zeros(VOCAB, dtype=torch.long), torch.ones(VOCAB, dtype=torch.bool)
    draft = build_draft(target, config, d2t, t2d)  # it reads the target's aux layers, [2, 1, 0] here
    draft.config.aux_layer_ids = [0, 1, 2]  # the features' order below
    samples = torch.randint(4, VOCAB, (64, LENGTH), generator=torch.Generator().manual_seed(1))
    samples[:, :2] = torch.tensor([2, 3])  # every row opens as a chat template's does
    samples = samples.flatten()
    _, sinks = plant_copy_head(
        draft, synthetic_features(target, samples, sink, seed=2), samples, LENGTH, torch.Generator().manual_seed(0)
    )
    assert sinks == (64 if sink else 0)
    half = torch.randint(4, VOCAB, (LENGTH // 2,), generator=torch.Generator().manual_seed(7))
    half[:2] = torch.tensor([2, 3])
    tokens = torch.cat([half, half])
    heads = []
    hook = draft.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda _, args: heads.append(args[0]))
    draft_hits(draft, tokens, synthetic_features(target, tokens, sink, seed=3), 1)
    hook.remove()
    loudness = heads[0][0, :, : draft.config.head_dim].norm(dim=-1)
    return float(loudness[2 : LENGTH // 2 - 1].mean()), float(loudness[LENGTH // 2 :].mean())


def test_where_nothing_matches_the_head_rests_on_the_sink(target):
    """With a sink in the features the head is quieter where nothing matches (about half as loud here: a
    non-match outscores the sink at some positions) and as loud where the repeat matches as without one."""
    fresh, repeated = copy_head_loudness(target, sink=True)
    fresh_without, repeated_without = copy_head_loudness(target, sink=False)
    assert fresh < 0.65 * fresh_without and repeated > 0.9 * repeated_without, (fresh, fresh_without)
