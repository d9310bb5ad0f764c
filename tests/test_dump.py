"""Offline mode: `write_dump` / `HiddenStateDump` on a tiny random Llama, and training from a dump."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from wingspan.config import TrainConfig, from_dict, read_mapping, to_dict
from wingspan.data.batching import collate
from wingspan.data.hidden_states import (
    MANIFEST,
    DumpIdentity,
    DumpManifest,
    DumpMismatchError,
    HiddenStateDump,
    bytes_per_token,
    write_dump,
)
from wingspan.data.template import TokenizedConversation
from wingspan.errors import ConfigError, DataError
from wingspan.models.target import TargetModel
from wingspan.pipeline import run_dump, run_training, tokenized_dataset
from wingspan.train.features import DumpFeatures, OnlineFeatures
from wingspan.train.trainer import build_draft
from wingspan.train.ttt import ttt_forward

H = 32  # the tiny model's hidden size
SHARD_BYTES = 40 * bytes_per_token(H, 3)  # about 40 tokens a shard: several shards from a dozen records


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama_dir) -> TargetModel:
    model = TargetModel.load(str(tiny_llama_dir), dtype="float32")
    # A confident target (a random one is near uniform over the draft vocab), so that the loss depends on
    # the features: a misplaced or mis-scaled feature shows.
    model.norm_weight().data *= 10
    return model


@pytest.fixture(scope="module")
def conversations(counting_chat):
    return counting_chat(12, spread=4)


def config_for(tmp_path, tiny_llama_dir, conversations, **overrides) -> TrainConfig:
    fields = dict(
        target=str(tiny_llama_dir),
        data=[str(conversations)],
        output_dir=str(tmp_path / "run"),
        target_dtype="float32",
        num_hidden_layers=2,
        draft_vocab_size=64,
        max_length=64,
        batch_tokens=256,
        ttt_steps=3,
        lr=1e-3,
        max_steps=4,
        save_every=2,
        log_every=1,
    )
    fields.update(overrides)
    return TrainConfig(**fields)


def dump(config: TrainConfig, target: TargetModel, out, **kwargs) -> DumpManifest:
    return run_dump(config, out, shard_bytes=SHARD_BYTES, target=target, **kwargs)


@pytest.fixture(scope="module")
def dumped(target, tiny_llama_dir, conversations, tmp_path_factory):
    """(config, dump directory) of one complete dump, shared by the read-only tests."""
    tmp = tmp_path_factory.mktemp("dumped")
    config = config_for(tmp, tiny_llama_dir, conversations)
    dump(config, target, tmp / "dump")
    return config, tmp / "dump"


def test_manifest_round_trips_and_records_match_the_data(dumped, target):
    config, directory = dumped
    data = read_mapping(directory / MANIFEST)
    manifest = from_dict(DumpManifest, data)
    assert to_dict(manifest) == data
    assert manifest.format_version == 1 and manifest.loss_input == "last_hidden" and manifest.hidden_size == H
    assert manifest.identity.aux_layer_ids == target.aux_layer_ids == [2, 2, 1]  # default [2, N//2, N-3], N=4
    assert manifest.identity.max_length == 64 and manifest.identity.target_dtype == "float32"
    assert len(manifest.shards) >= 3 and all(s.done for s in manifest.shards)
    assert sorted(p.name for p in directory.iterdir()) == [MANIFEST] + [s.file for s in manifest.shards]

    records = tokenized_dataset(config.data, target.tokenizer, config.max_length)
    loaded = HiddenStateDump(directory)
    assert loaded.records == records
    assert manifest.num_tokens == sum(len(r.input_ids) for r in records)


def test_a_dump_of_whole_conversations_stores_their_masks(target, tiny_llama_dir, conversations, tmp_path):
    config = config_for(tmp_path, tiny_llama_dir, conversations, learn_prompts=True)
    manifest = dump(config, target, tmp_path / "dump")
    assert manifest.identity.learn_prompts
    records = HiddenStateDump(tmp_path / "dump").records
    assert records == tokenized_dataset(config.data, target.tokenizer, config.max_length, learn_prompts=True)
    assert all(all(r.loss_mask) for r in records)
    replies_only = tokenized_dataset(config.data, target.tokenizer, config.max_length)
    assert not all(all(r.loss_mask) for r in replies_only)


def test_stored_features_are_the_targets_in_bf16(dumped, target):
    config, directory = dumped
    loaded = HiddenStateDump(directory)
    for index in (0, 5, len(loaded.records) - 1):
        ids = torch.tensor([loaded.records[index].input_ids])
        aux, last, argmax = loaded.features([[index]], ids.shape[1])
        out = target.forward(ids)
        # bf16 storage: relative error 2^-9, and the dump's packed rows may differ from this lone forward
        # by float32 rounding before that.
        torch.testing.assert_close(aux.float(), out.aux_hidden, rtol=2**-8, atol=1e-5)
        torch.testing.assert_close(
            last.float(), target.forward(ids, return_last_hidden=True).last_hidden, rtol=2**-8, atol=1e-5
        )
        assert torch.equal(argmax, out.logits.max(dim=-1).indices)


def test_disk_use_is_printed_before_the_dump_and_matches_the_files(
    target, tiny_llama_dir, conversations, tmp_path, capsys, monkeypatch
):
    config = config_for(tmp_path, tiny_llama_dir, conversations)
    per_token = 3 * H * 2 + H * 2 + 4 + 1 + 4  # aux + last hidden in bf16; ids, argmax int32; mask uint8

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:  # the first target forward fails: what was printed came before it
        patch.setattr(target, "forward", interrupted)
        with pytest.raises(KeyboardInterrupt):
            dump(config, target, tmp_path / "stopped")
    assert f"{per_token:,} bytes/token" in capsys.readouterr().out

    manifest = dump(config, target, tmp_path / "dump")
    printed = capsys.readouterr().out
    assert manifest.bytes_per_token == per_token
    assert f"{per_token:,} bytes/token" in printed and f"{manifest.num_tokens:,} tokens" in printed
    payload = sum((tmp_path / "dump" / s.file).stat().st_size for s in manifest.shards)
    # safetensors adds a JSON header (~600 bytes) and the record offsets to each shard
    assert manifest.num_tokens * per_token < payload < manifest.num_tokens * per_token + 1000 * len(manifest.shards)


def test_resume_after_interruption_is_byte_identical(target, tiny_llama_dir, conversations, tmp_path):
    config = config_for(tmp_path, tiny_llama_dir, conversations)
    full = dump(config, target, tmp_path / "full")
    partial = dump(config, target, tmp_path / "resumed", max_shards=2)  # interrupted after two shards
    assert [s.done for s in partial.shards] == [True, True] + [False] * (len(partial.shards) - 2)
    with pytest.raises(DataError, match="unfinished dump"):
        HiddenStateDump(tmp_path / "resumed")
    with pytest.raises(FileExistsError, match="--resume"):
        dump(config, target, tmp_path / "resumed")
    # A crash while writing the third shard leaves only its temp file behind.
    (tmp_path / "resumed" / f".{partial.shards[2].file}.tmp").write_bytes(b"half a shard")
    dump(config, target, tmp_path / "resumed", resume=True)
    files = sorted(p.name for p in (tmp_path / "full").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "resumed").iterdir() if not p.name.endswith(".tmp"))
    for name in files:
        assert (tmp_path / "full" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes(), name
    assert len(full.shards) >= 3


def test_resume_refuses_a_dump_of_other_settings(dumped, target, tiny_llama_dir, tmp_path):
    config, directory = dumped
    copy = tmp_path / "dump"
    shutil.copytree(directory, copy)
    other_aux = TargetModel(target.model, target.tokenizer, target.name, aux_layer_ids=[0, 1, 3])
    with pytest.raises(DumpMismatchError, match=r"aux_layer_ids: dump has \[2, 2, 1\], config has \[0, 1, 3\]"):
        dump(config, other_aux, copy, resume=True)
    with pytest.raises(DumpMismatchError, match="max_length: dump has 64, config has 128"):
        dump(TrainConfig(**{**to_dict(config), "max_length": 128}), target, copy, resume=True)


@pytest.mark.parametrize("rows", [[[3], [0], [7]], [[3, 0, 7], [1, 5]]], ids=["padded", "packed"])
def test_offline_loss_equals_online_loss(dumped, target, rows):
    """The TTT loss of a micro-batch from the dump equals the one from running the target, up to the bf16
    storage of the features: under 1e-3 relative (3e-5 measured; aux features one token off give 1e-2)."""
    config, directory = dumped
    loaded = HiddenStateDump(directory)
    d2t = torch.arange(64) * 7 - torch.arange(64)  # draft id i -> target id 7i: a strict subset of the vocab
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[torch.arange(64) * 7] = True
    torch.manual_seed(0)
    draft = build_draft(target, config, d2t, t2d)
    micro = collate(loaded.records, rows, pad_id=2)
    online, offline = OnlineFeatures(target, d2t)(micro), DumpFeatures(loaded, target, d2t)(micro)
    assert offline.target_logits.shape == online.target_logits.shape == (len(rows), micro.input_ids.shape[1], 64)
    real = micro.attention_mask.bool()
    torch.testing.assert_close(offline.target_logits[real], online.target_logits[real], rtol=1e-2, atol=1e-2)
    assert torch.equal(offline.target_argmax[real], online.target_argmax[real])
    weights = [0.8**j for j in range(config.ttt_steps)]
    a = ttt_forward(draft, online, config.ttt_steps, weights)
    b = ttt_forward(draft, offline, config.ttt_steps, weights)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-3, atol=0)
    torch.testing.assert_close(b.loss_sum, a.loss_sum, rtol=1e-3, atol=0)
    assert torch.equal(b.count, a.count)


def test_training_from_a_dump_never_runs_the_target_and_matches_online(dumped, target, tmp_path, monkeypatch):
    config, directory = dumped
    online = config_for(tmp_path / "online", config.target, config.data[0], epochs=3.0, max_steps=None, save_every=100)
    run_training(online, target=target)
    calls = []
    monkeypatch.setattr(target, "forward", lambda *args, **kwargs: calls.append(args))
    offline = config_for(
        tmp_path / "offline",
        config.target,
        config.data[0],
        epochs=3.0,
        max_steps=None,
        save_every=100,
        from_dump=str(directory),
    )
    run_training(offline, target=target)
    assert calls == []  # three epochs, and the target never ran

    def metrics(run):
        return [json.loads(line) for line in (run / "run" / "metrics.jsonl").read_text().splitlines()]

    a, b = metrics(tmp_path / "online"), metrics(tmp_path / "offline")
    assert [m["step"] for m in a] == [m["step"] for m in b] and len(a) >= 3
    for x, y in zip(a, b):  # same data order, same draft init: the same run up to bf16 features
        assert y["loss_0"] == pytest.approx(x["loss_0"], rel=1e-3)  # 2e-4 measured
        assert y["loss_2"] == pytest.approx(x["loss_2"], rel=1e-3)
    saved = json.loads((tmp_path / "offline" / "run" / "config.json").read_text())
    assert saved["from_dump"] == str(directory)


def test_training_refuses_a_dump_of_other_settings(dumped, target, tmp_path, conversations):
    config, directory = dumped
    for field, value, message in [
        ("max_length", 128, "max_length: dump has 64, config has 128"),
        ("target_dtype", "bfloat16", "target_dtype: dump has 'float32', config has 'bfloat16'"),
        ("learn_reasoning", False, "learn_reasoning: dump has True, config has False"),  # other loss masks
        ("learn_prompts", True, "learn_prompts: dump has False, config has True"),
    ]:
        other = TrainConfig(
            **{**to_dict(config), field: value, "from_dump": str(directory), "output_dir": str(tmp_path / field)}
        )
        with pytest.raises(DumpMismatchError, match=message):
            run_training(other, target=target)
    other_data = tmp_path / "other.jsonl"
    other_data.write_text(conversations.read_text().replace("Done!", "Finished!"))
    other = TrainConfig(**{**to_dict(config), "data": [str(other_data)], "from_dump": str(directory)})
    with pytest.raises(DumpMismatchError, match=r"data: dump has \[.*chat.jsonl'\], config has \[.*other.jsonl'\]"):
        run_training(other, target=target)
    torch.manual_seed(1)
    different = TargetModel.load(config.target, dtype="float32")
    with torch.no_grad():
        different.layers[-1].mlp.down_proj.weight.mul_(1.01)  # a fine-tune of the same architecture
    with pytest.raises(DumpMismatchError, match="target: dump has .* config has .*fingerprint"):
        run_training(TrainConfig(**{**to_dict(config), "from_dump": str(directory)}), target=different)


def test_refuses_a_target_whose_logits_are_not_its_lm_head(tmp_path):
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        logits_scaling=4.0,
    )
    target = TargetModel(
        GraniteForCausalLM(config), SimpleNamespace(pad_token_id=0, eos_token_id=1, chat_template=None), "granite"
    )
    records = [TokenizedConversation(list(range(3, 20)), [0] * 8 + [1] * 9)]
    identity = DumpIdentity("granite", "f", "t", target.aux_layer_ids, "float32", 64, [])
    with pytest.raises(ConfigError, match="granite: its logits are not lm_head"):
        write_dump(target, records, identity, tmp_path / "dump", batch_tokens=64)
