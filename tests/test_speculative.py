"""Greedy chain speculative decoding returns exactly the target's greedy tokens, with the draft fed as in TTT."""

import pytest
import torch
from conftest import tiny_draft_config

from wingspan.decode import primitives, speculative
from wingspan.decode.primitives import DraftTree, TreeShape
from wingspan.decode.speculative import plain_generate, speculative_generate
from wingspan.eval.replay import draft_hits, replay_rounds
from wingspan.models.draft import Eagle3Draft, new_kv_caches
from wingspan.models.target import TargetModel

PROMPTS = [[5, 17, 300, 4000], [1, 2000, 42], list(range(100, 112)), [7]]
FAVOURED = 1234  # the token the predictable target and the biased drafts like


pytestmark = pytest.mark.usefixtures("one_thread")


def sharpen(model: torch.nn.Module) -> None:
    """Scale every attention's q/k (peaked attention) and v/o (whose output matters). At init scale (std 0.02)
    a tiny model's attention is near uniform, so its output hardly depends on positions or on which slots
    are masked: a wrong position id or a forgotten mask would go unnoticed (checked by breaking the code)."""
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            for proj, scale in (("q_proj", 8), ("k_proj", 8), ("v_proj", 4), ("o_proj", 4)):
                getattr(module, proj).weight.data *= scale


@pytest.fixture(scope="module")
def target(tiny_llama_dir) -> TargetModel:
    target = TargetModel.load(str(tiny_llama_dir), dtype="float32", aux_layer_ids=[1, 2, 3])
    sharpen(target.model)
    return target


def load_predictable_target(directory) -> TargetModel:
    """The tiny llama with its FAVOURED lm_head row scaled: its greedy output is about 1/3 FAVOURED."""
    target = TargetModel.load(str(directory), dtype="float32", aux_layer_ids=[1, 2, 3])
    target.model.lm_head.weight.data[FAVOURED] *= 20
    sharpen(target.model)
    return target


@pytest.fixture(scope="module")
def predictable_target(tiny_llama_dir) -> TargetModel:
    return load_predictable_target(tiny_llama_dir)


def make_draft(
    target: TargetModel,
    layers: int,
    seed: int,
    draft_vocab: int = 2000,
    favour: float | None = None,
    parallel: bool = False,
) -> Eagle3Draft:
    """A random draft over a real draft vocab (sorted target ids, FAVOURED first); `favour` scales the
    lm_head row of FAVOURED so that the draft proposes it often; favour=0 zeroes the whole lm_head, so
    every proposal is draft id 0 = FAVOURED (argmax of a tie is the first index). `parallel`: a parallel
    draft (mask token: the target's last id)."""
    mode = {"draft_mode": "parallel", "mask_token_id": target.vocab_size - 1} if parallel else {}
    config = tiny_draft_config(
        vocab_size=target.vocab_size, draft_vocab_size=draft_vocab, num_hidden_layers=layers, **mode
    )
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
    sharpen(draft)
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
        assert plain_generate(target, prompt, 12, []).tokens == expected
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
    """Per-round accepted counts from the TTT unroll over the final tokens (`wingspan.eval.replay`): equal only
    if the draft is fed as training feeds it."""
    ids = torch.tensor(prompt + output)
    hits = draft_hits(draft, ids, target.forward(ids[None]).aux_hidden[0], k)
    return replay_rounds(hits, len(prompt), len(output), len(output), k)[0]


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_parallel_draft_gives_the_greedy_tokens(target, layers):
    draft = make_draft(target, layers, seed=layers, parallel=True)
    for prompt in PROMPTS[:3]:
        expected = reference(target, prompt, 12, [])
        for k in (1, 3, 5):
            result = speculative_generate(target, draft, prompt, 12, num_draft_tokens=k, stop_ids=[])
            assert result.tokens == expected, (prompt, k)
            assert result.target_forwards == 1 + len(result.accepted_per_round)
    with pytest.raises(ValueError, match="a parallel draft drafts a chain"):
        speculative_generate(target, draft, PROMPTS[0], 4, tree=TreeShape(2, 2, 3))


@pytest.mark.parametrize("layers, parallel, seed", [(1, False, 11), (2, False, 12), (1, True, 24), (2, True, 20)])
def test_draft_proposals_follow_the_ttt_semantics(predictable_target, layers, parallel, seed):
    """A random draft biased towards FAVOURED: whether it is accepted depends on its hidden states (a parallel
    draft's: on its mask slots'), and the unroll of training predicts every round's accepted count. The
    parallel drafts' seeds are ones whose mask slots get accepted at all."""
    target = predictable_target
    draft = make_draft(target, layers, seed=seed, favour=15.0, parallel=parallel)
    accepted = beyond_first = 0
    for prompt in PROMPTS:
        for k in (2, 4):
            result = speculative_generate(target, draft, prompt, 24, num_draft_tokens=k, stop_ids=[])
            assert result.tokens == reference(target, prompt, 24, [])
            assert result.accepted_per_round == replayed_acceptance(target, draft, prompt, result.tokens, k)
            accepted += sum(result.accepted_per_round)
            beyond_first += sum(a >= 2 for a in result.accepted_per_round)
    assert accepted > 0 and (beyond_first > 0 or not parallel)  # a parallel draft: mask slots accepted too


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


TREES = [TreeShape(3, 2, 5), TreeShape(4, 3, 10), TreeShape(2, 4, 8), TreeShape(5, 2, 12)]


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_tree_gives_the_greedy_tokens(target, layers):
    draft = make_draft(target, layers, seed=layers)
    for prompt in PROMPTS[:3]:
        expected = reference(target, prompt, 12, [])
        for shape in TREES:
            result = speculative_generate(target, draft, prompt, 12, stop_ids=[], tree=shape)
            assert result.tokens == expected, (prompt, shape)
            assert result.target_forwards == 1 + len(result.accepted_per_round)


def first_child_paths_only(monkeypatch) -> list[bool]:
    """Record, per verification, whether the accepted path took a child other than the best-scored one."""
    verify, side_branches = speculative.verify, []

    def recording(tree: DraftTree, logits, temperature, generator):
        path, token = verify(tree, logits, temperature, generator)
        side_branches.append(any(tree.children(tree.parents[node])[0] != node for node in path))
        return path, token

    monkeypatch.setattr(speculative, "verify", recording)
    return side_branches


@pytest.mark.parametrize(("layers", "seed", "favour"), [(1, 11, 4.0), (2, 25, 6.0)])
def test_tree_accepts_side_branches_and_keeps_the_greedy_tokens(predictable_target, layers, seed, favour, monkeypatch):
    """A draft biased towards FAVOURED proposes it first or among its top-k: paths through side branches
    must be accepted, and the target cache rebuilt from them (`keep_rows`) must keep the output exact.
    (Seeds and biases chosen so that side paths occur; the runs are deterministic.)"""
    target = predictable_target
    draft = make_draft(target, layers, seed=seed, favour=favour)
    side_branches = first_child_paths_only(monkeypatch)
    tree_accepted = chain_accepted = 0
    for prompt in PROMPTS:
        expected = reference(target, prompt, 24, [])
        chain = speculative_generate(target, draft, prompt, 24, num_draft_tokens=4, stop_ids=[])
        tree = speculative_generate(target, draft, prompt, 24, stop_ids=[], tree=TreeShape(4, 3, 12))
        assert chain.tokens == tree.tokens == expected
        assert 1 + sum(a + 1 for a in tree.accepted_per_round) == len(expected)
        chain_accepted, tree_accepted = (
            chain_accepted + sum(chain.accepted_per_round),
            tree_accepted + sum(tree.accepted_per_round),
        )
    assert any(side_branches)
    assert tree_accepted > chain_accepted > 0


@pytest.mark.parametrize("shape", [TreeShape(3, 2, 5), TreeShape(4, 3, 10)])
def test_tree_edges(predictable_target, shape):
    target = predictable_target
    draft = make_draft(target, 2, seed=3, favour=6.0)
    prompt = PROMPTS[1]
    full = reference(target, prompt, 16, [])
    for n in (0, 1, 2, 3, 4, 5, 16):
        result = speculative_generate(target, draft, prompt, n, stop_ids=[], tree=shape)
        assert result.tokens == full[:n] and not result.stopped, n
        assert all(d <= shape.depth for d in result.drafted_per_round)
    at = full.index(FAVOURED)
    result = speculative_generate(target, draft, prompt, 16, stop_ids=[FAVOURED], tree=shape)
    assert result.tokens == full[:at] and result.stopped


def test_tree_on_an_eager_attention_target(tiny_llama_dir):
    """Eager attention adds the mask to the scores: the tree mask must reach it as 0 / -inf, not as bools."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation="eager")
    target = TargetModel(model, AutoTokenizer.from_pretrained(tiny_llama_dir), "eager llama", aux_layer_ids=[1, 2, 3])
    sharpen(target.model)
    draft = make_draft(target, 2, seed=2)
    for prompt in PROMPTS[:3]:
        result = speculative_generate(target, draft, prompt, 12, stop_ids=[], tree=TreeShape(4, 3, 10))
        assert result.tokens == reference(target, prompt, 12, [])


def test_tree_nodes_follow_the_chain_semantics(target):
    """Every node's children are the top-k of the draft's logits along that node's path run as a chain
    (fresh caches, no tree mask): the tree attention mask hides exactly the other branches."""
    draft = make_draft(target, 2, seed=7)
    prompt = PROMPTS[2]
    aux = target.forward(torch.tensor([prompt])).aux_hidden
    shape = TreeShape(4, 3, 30)

    def step0(caches):
        positions = torch.arange(len(prompt) - 1)[None]
        ids = torch.tensor([prompt[1:]])
        return draft(draft.project_aux(aux[:, :-1]), ids, positions, caches)[:, -1:]

    with torch.no_grad():
        caches = new_kv_caches(draft)
        tree = speculative._draft_tree(draft, step0(caches), len(prompt) - 2, caches, shape, 0.0, None)
        assert len(tree.tokens) == 30 and max(tree.depths) == 4
        for node in range(len(tree.tokens)):
            children = tree.children(node)
            if not children:
                continue
            path = [node]
            while tree.parents[path[0]] >= 0:
                path.insert(0, tree.parents[path[0]])
            caches = new_kv_caches(draft)
            hidden = step0(caches)
            for depth, step in enumerate(path, start=1):
                position = torch.tensor([[len(prompt) - 2 + depth]])
                hidden = draft(hidden, torch.tensor([[tree.tokens[step]]]), position, caches)
            top = draft.draft_to_target(draft.logits(hidden)[0, -1].topk(3).indices).tolist()
            assert [tree.tokens[c] for c in children] == top[: len(children)], node


def test_tree_verification_matches_plain_forwards(target):
    """The target's tree-masked logits at each node equal a plain forward over prompt + that node's path."""
    tree = DraftTree(
        tokens=[11, 12, 13, 14, 15, 16],
        parents=[-1, -1, 0, 0, 1, 2],
        depths=[1, 1, 2, 2, 2, 3],
        proposals=[None] * 6,
    )
    prompt = PROMPTS[0]
    cache = speculative.DynamicCache()
    speculative._target_step(target, prompt[:-1], cache)
    attention = speculative._tree_attention(tree, cache.get_seq_length(), target)
    logits, aux = speculative._target_step(target, [prompt[-1]] + tree.tokens, cache, attention)
    for node in range(len(tree.tokens)):
        path = [node]
        while tree.parents[path[0]] >= 0:
            path.insert(0, tree.parents[path[0]])
        plain = target.forward(torch.tensor([prompt + [tree.tokens[i] for i in path]]))
        torch.testing.assert_close(logits[node + 1], plain.logits[0, -1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(aux[node + 1], plain.aux_hidden[0, -1], atol=1e-5, rtol=1e-5)
    # Accepting the side path root -> node 1 -> node 4 leaves the cache a plain forward over it would make.
    primitives.keep_rows(cache, len(prompt) - 1, [0, 2, 5])
    plain = speculative.DynamicCache()
    speculative._target_step(target, prompt + [12, 15], plain)
    assert cache.get_seq_length() == plain.get_seq_length() == len(prompt) + 2
    for kept, expected in zip(cache.layers, plain.layers, strict=True):
        torch.testing.assert_close(kept.keys, expected.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kept.values, expected.values, atol=1e-5, rtol=1e-5)


def test_greedy_verification_walks_the_longest_matching_path():
    tree = DraftTree(tokens=[5, 6, 7, 8], parents=[-1, -1, 1, 2], depths=[1, 1, 2, 3], proposals=[None] * 4)
    logits = torch.full((5, 10), -1.0)
    for row, best in enumerate([6, 0, 7, 9, 3]):  # root -> 6 (node 1) -> 7 (node 2) -> 9: not a child
        logits[row, best] = 1.0
    assert speculative.verify(tree, logits, 0.0, None) == ([1, 2], 9)
    logits[3, 9], logits[3, 8] = -1.0, 1.0  # now node 2's best is 8 (node 3), whose best is 3
    assert speculative.verify(tree, logits, 0.0, None) == ([1, 2, 3], 3)


def test_tree_shape_is_validated():
    with pytest.raises(ValueError, match="total_tokens can be at most"):
        TreeShape(2, 2, 7)
    with pytest.raises(ValueError, match=">= 1"):
        TreeShape(0, 2, 2)


SMALL_VOCAB = 12


@pytest.fixture(scope="module")
def small_target(smollm2_tokenizer) -> TargetModel:
    """A random Llama over 12 tokens with logits scaled to about 1.3 nats of entropy: every continuation of
    a few tokens has a probability large enough to count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=SMALL_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = LlamaForCausalLM(config)
    model.lm_head.weight.data *= 6.0
    return TargetModel(model, smollm2_tokenizer, "small-vocab llama", aux_layer_ids=[1, 2, 3])


def small_draft(target: TargetModel) -> Eagle3Draft:
    """A draft over 8 of the 12 tokens: the other 4 have q = 0, so the residual must supply them."""
    config = tiny_draft_config(vocab_size=SMALL_VOCAB, draft_vocab_size=8, num_hidden_layers=2)
    with torch.random.fork_rng():
        torch.manual_seed(2)
        draft = Eagle3Draft(config)
    vocab = torch.tensor([0, 1, 3, 4, 6, 7, 9, 10])
    draft.d2t.copy_(vocab - torch.arange(8))
    draft.t2d[vocab] = True
    draft.embed_tokens.weight.data.copy_(target.embed_weight())
    # Close to the target, as a trained draft is: fc passes the input of the target's last layer through,
    # the draft's own layers add little, and norm and lm_head are the target's (its rows of the vocab).
    draft.fc.weight.data.zero_()
    draft.fc.weight.data[:, 64:] = torch.eye(32)
    for layer in draft.layers:
        layer.self_attn.o_proj.weight.data *= 0.1
        layer.mlp.down_proj.weight.data *= 0.1
    draft.norm.weight.data.copy_(target.norm_weight())
    draft.lm_head.weight.data.copy_(target.lm_head_weight()[vocab])
    return draft.eval()


def exact_distribution(target: TargetModel, prompt: list[int], length: int, temperature: float) -> torch.Tensor:
    """P(x_1..x_length) of the target's sampling, by enumerating every continuation: [V] * length."""
    joint = torch.ones(())
    prefixes = torch.tensor([prompt])
    for _ in range(length):
        with torch.no_grad():
            logits = target.model(input_ids=prefixes).logits[:, -1]
        step = torch.softmax(logits.double() / temperature, dim=-1)  # [prefixes, V]
        joint = (joint.reshape(-1, 1) * step).reshape(*joint.shape, SMALL_VOCAB)
        tokens = torch.arange(SMALL_VOCAB).repeat(prefixes.shape[0])
        prefixes = torch.cat([prefixes.repeat_interleave(SMALL_VOCAB, 0), tokens[:, None]], dim=1)
    return joint


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's test of counts against probs, with cells expected below `min_expected` pooled into one."""
    counts, probs = counts.flatten().double(), probs.flatten()
    expected = probs * counts.sum()
    small = expected < min_expected
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    statistic = float(((observed - expected) ** 2 / expected.clamp_min(1e-12)).sum())
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


@pytest.mark.parametrize("tree", [None, TreeShape(2, 3, 6)], ids=["chain", "tree"])
def test_rejection_sampling_keeps_the_target_distribution(small_target, tree):
    """Sampled speculative decoding of 4 tokens (the prefill token, then rounds of up to 2 drafts), 3000 times:
    the empirical joint of tokens 2-4 and each token's marginal fit the target's exact distribution (chi-square,
    p > 1e-3 each). The draft's proposals alone are far from it: a sampler that accepted every draft, or
    skipped the residual, fails these tests (checked by breaking the code)."""
    target, draft = small_target, small_draft(small_target)
    prompt, temperature, runs = [3, 5, 7], 0.9, 3000
    exact = exact_distribution(target, prompt, 4, temperature)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros([SMALL_VOCAB] * 4)
    accepted = rejected = 0
    for _ in range(runs):
        result = speculative_generate(
            target,
            draft,
            prompt,
            4,
            num_draft_tokens=2,
            stop_ids=[],
            tree=tree,
            temperature=temperature,
            generator=generator,
        )
        assert len(result.tokens) == 4
        counts[tuple(result.tokens)] += 1
        accepted += result.accepted_per_round[0]
        rejected += result.accepted_per_round[0] < 2
    assert accepted > 0.2 * runs and rejected > 0.2 * runs  # both branches of the rule are exercised
    assert chi_square_p_value(counts.sum(0), exact.sum(0)) > 1e-3
    for position in range(4):
        others = tuple(i for i in range(4) if i != position)
        assert chi_square_p_value(counts.sum(others), exact.sum(others)) > 1e-3, position
