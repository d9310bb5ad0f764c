"""Greedy chain speculative decoding returns exactly the target's greedy tokens, with the draft fed as in TTT."""

import pytest
import torch

from wingspan.config import DraftConfig
from wingspan.decode.speculative import greedy_generate, speculative_generate
from wingspan.models.draft import Eagle3Draft
from wingspan.models.target import TargetModel
from wingspan.train.ttt import unroll

PROMPTS = [[5, 17, 300, 4000], [1, 2000, 42], list(range(100, 112)), [7]]
FAVOURED = 1234  # the token the predictable target and the biased drafts like


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a loaded 2-core machine a 2-thread pool made each
    few-token target forward ~100x slower (14 ms per 4x32x64 linear)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target(tiny_llama_dir) -> TargetModel:
    return TargetModel.load(str(tiny_llama_dir), dtype="float32", aux_layer_ids=[1, 2, 3])


@pytest.fixture(scope="module")
def predictable_target(tiny_llama_dir) -> TargetModel:
    """The tiny llama with its FAVOURED lm_head row scaled: its greedy output is about 1/3 FAVOURED."""
    target = TargetModel.load(str(tiny_llama_dir), dtype="float32", aux_layer_ids=[1, 2, 3])
    target.model.lm_head.weight.data[FAVOURED] *= 20
    return target


def make_draft(
    target: TargetModel, layers: int, seed: int, draft_vocab: int = 2000, favour: float | None = None
) -> Eagle3Draft:
    """A random draft over a real draft vocab (sorted target ids, FAVOURED first); `favour` scales the
    lm_head row of FAVOURED so that the draft proposes it often; favour=0 zeroes the whole lm_head, so
    every proposal is draft id 0 = FAVOURED (argmax of a tie is the first index)."""
    config = DraftConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        target_hidden_size=32, vocab_size=target.vocab_size, draft_vocab_size=draft_vocab,
        aux_layer_ids=[1, 2, 3], num_hidden_layers=layers,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    others = torch.randperm(target.vocab_size, generator=generator)
    others = others[others != FAVOURED][: draft_vocab - 1].sort().values
    vocab = torch.cat([torch.tensor([FAVOURED]), others])
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        draft = Eagle3Draft(config)
    draft.d2t.copy_(vocab - torch.arange(draft_vocab))
    draft.t2d[vocab] = True
    draft.embed_tokens.weight.data.copy_(target.embed_weight())
    if favour == 0:
        draft.lm_head.weight.data.zero_()
    elif favour is not None:
        draft.lm_head.weight.data[0] *= favour
    return draft.eval()


def reference(target: TargetModel, prompt: list[int], max_new_tokens: int, stop_ids: list[int]) -> list[int]:
    return target.generate([prompt], max_new_tokens, temperature=0.0, stop_ids=stop_ids)[0].tokens


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_random_draft_gives_the_greedy_tokens(target, layers):
    draft = make_draft(target, layers, seed=layers)
    for prompt in PROMPTS[:3]:
        expected = reference(target, prompt, 12, [])
        assert greedy_generate(target, prompt, 12, []).tokens == expected
        for k in (1, 3, 5):
            result = speculative_generate(target, draft, prompt, 12, num_draft_tokens=k, stop_ids=[])
            assert result.tokens == expected, (prompt, k)
            assert result.target_forwards == 1 + len(result.accepted_per_round)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_max_new_tokens_and_stop_edges(predictable_target, k):
    target = predictable_target
    draft = make_draft(target, 1, seed=0, favour=0)
    prompt = PROMPTS[0]
    full = reference(target, prompt, 16, [])
    for n in (0, 1, 2, k, k + 1, k + 2, 16):
        result = speculative_generate(target, draft, prompt, n, num_draft_tokens=k, stop_ids=[])
        assert result.tokens == full[:n], n
        assert not result.stopped
    # A stop id first produced at index `at`: never returned, and it ends decoding even when it is
    # exactly the max_new_tokens-th token.
    at = next(i for i in range(3, len(full)) if full[i] not in full[:i])
    for n in (at + 1, at + 2, 16):
        result = speculative_generate(target, draft, prompt, n, num_draft_tokens=k, stop_ids=[full[at]])
        assert result.tokens == full[:at] == reference(target, prompt, n, [full[at]])
        assert result.stopped
    assert speculative_generate(target, draft, prompt, at, num_draft_tokens=k, stop_ids=[full[at]]).tokens == full[:at]
    # Stopping on an accepted FAVOURED draft token, mid-round.
    at = full.index(FAVOURED)
    result = speculative_generate(target, draft, prompt, 16, num_draft_tokens=k, stop_ids=[FAVOURED])
    assert result.tokens == full[:at] and result.stopped


@pytest.mark.parametrize("k", [1, 3, 5])
def test_accepted_drafts_keep_the_greedy_tokens(predictable_target, k):
    target = predictable_target
    draft = make_draft(target, 1, seed=0, favour=0)  # always proposes FAVOURED
    accepted = 0
    for prompt in PROMPTS:
        expected = reference(target, prompt, 24, [])
        result = speculative_generate(target, draft, prompt, 24, num_draft_tokens=k, stop_ids=[])
        assert result.tokens == expected, (prompt, k)
        assert result.target_forwards == 1 + len(result.accepted_per_round)
        # every round adds its accepted drafts plus one target token; the prefill adds the first
        assert 1 + sum(a + 1 for a in result.accepted_per_round) == len(expected)
        accepted += sum(result.accepted_per_round)
    assert accepted > 0
    assert result.target_forwards < len(expected)


def replayed_acceptance(target, draft, prompt, output, k):
    """Per-round accepted counts from the TTT unroll over the final tokens (tests/test_vllm.py's replay,
    with the same shortening of the last rounds): equal only if the draft is fed as training feeds it."""
    ids = torch.tensor([prompt + output])
    aux = target.forward(ids).aux_hidden
    with torch.no_grad():
        chains = [draft.draft_to_target(draft.logits(h).argmax(-1))[0] for h in unroll(draft, aux, ids, k)]
    rounds, origin, produced = [], len(prompt) - 1, 1
    while produced < len(output):
        steps = min(k, len(output) - produced - 1)
        accepted = 0
        while accepted < steps and chains[accepted][origin] == ids[0, origin + accepted + 2]:
            accepted += 1
        rounds.append(accepted)
        produced += accepted + 1
        origin += accepted + 1
    return rounds


@pytest.mark.parametrize("layers", [1, 2])
def test_draft_proposals_follow_the_ttt_semantics(predictable_target, layers):
    """A random draft biased towards FAVOURED: whether it is accepted depends on its hidden states."""
    target = predictable_target
    draft = make_draft(target, layers, seed=10 + layers, favour=15.0)
    accepted = 0
    for prompt in PROMPTS:
        for k in (2, 4):
            result = speculative_generate(target, draft, prompt, 24, num_draft_tokens=k, stop_ids=[])
            assert result.tokens == reference(target, prompt, 24, [])
            assert result.accepted_per_round == replayed_acceptance(target, draft, prompt, result.tokens, k)
            accepted += sum(result.accepted_per_round)
    assert accepted > 0


def test_fully_accepted_rounds(tiny_llama_dir):
    """A target that always says FAVOURED, and a draft that always proposes it: every round accepts all K
    drafts plus the target's own token. The prefill gives the first token, so 16 tokens take
    1 + ceil(15 / (K + 1)) forwards (the last round proposes fewer drafts so as not to overshoot)."""
    target = TargetModel.load(str(tiny_llama_dir), dtype="float32", aux_layer_ids=[1, 2, 3])
    head = torch.nn.Linear(32, target.vocab_size)
    with torch.no_grad():
        head.weight.copy_(target.model.lm_head.weight)
        head.bias.zero_()
        head.bias[FAVOURED] = 100.0
    target.model.lm_head = head
    draft = make_draft(target, layers=2, seed=0, favour=0)
    for k in (1, 3, 5):
        result = speculative_generate(target, draft, PROMPTS[0], 16, num_draft_tokens=k, stop_ids=[])
        assert result.tokens == [FAVOURED] * 16
        assert result.accepted_per_round[:-1] == [k] * (len(result.accepted_per_round) - 1)
        assert result.target_forwards == 1 + -(-15 // (k + 1))
