"""Training loop: loss goes down, a few sequences are learned, and resume equals an uninterrupted run."""

import dataclasses
import json

import pytest
import torch
from conftest import interrupted_copy, random_llama_target
from safetensors.torch import load_file

from wingspan.config import TrainConfig
from wingspan.data.batching import collate, plan_epoch
from wingspan.data.template import TokenizedConversation
from wingspan.errors import ConfigError
from wingspan.models.target import TargetModel
from wingspan.train.distributed import World
from wingspan.train.features import OnlineFeatures
from wingspan.train.trainer import (
    DEFAULT_LR,
    MAX_DEFAULT_EPOCHS,
    learning_rate,
    prepare_draft,
    read_metrics,
    train,
    train_step,
    training_rate,
    with_defaults,
)
from wingspan.train.ttt import step_weights_of, ttt_forward

VOCAB = 128

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_target() -> TargetModel:
    target = random_llama_target(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    target.model.model.norm.weight.data *= 10  # a confident target, so that matching it shows in the loss
    return target


def sequences(n: int, length: int, seed: int = 0) -> list[TokenizedConversation]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        size = length - (i % 3)
        ids = torch.randint(2, VOCAB, (size,), generator=g).tolist()
        out.append(TokenizedConversation(ids, [0] * 4 + [1] * (size - 4)))
    return out


def identity_vocab() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(VOCAB, dtype=torch.long), torch.ones(VOCAB, dtype=torch.bool)


def config(tmp_path, **overrides) -> TrainConfig:
    fields = dict(
        output_dir=str(tmp_path / "run"),
        num_hidden_layers=2,
        max_length=32,
        batch_tokens=64,
        ttt_steps=3,
        lr=3e-3,
        warmup_ratio=0.05,
        max_steps=12,
        save_every=4,
        log_every=4,
        target_dtype="float32",
    )
    fields.update(overrides)
    return TrainConfig(**fields)


def test_learning_rate_warms_up_then_decays():
    cfg = TrainConfig(lr=1.0, warmup_ratio=0.1, min_lr_ratio=0.1)
    lrs = [learning_rate(s, 100, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_the_training_rate_weighs_each_window_by_its_time(tmp_path):
    windows = [
        {"step": 10, "tokens": 100, "tokens_per_s": 50.0},
        {"step": 20, "tokens": 300, "tokens_per_s": 100.0},
        {"step": 30, "tokens": 0, "tokens_per_s": 0.0},  # skipped steps only: no tokens, no rate
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(w) + "\n" for w in windows) + "\n")
    assert read_metrics(tmp_path) == windows
    assert training_rate(windows) == pytest.approx(400 / (2 + 3))  # the mean of the two rates would say 75


def test_unset_lr_and_epochs_follow_the_targets_width_and_the_datas_size(tiny_target, tmp_path, capsys):
    assert with_defaults(TrainConfig(), 576, 95_000).lr == pytest.approx(2e-3)  # the measured recipe's
    assert with_defaults(TrainConfig(), 4096, 95_000).lr == pytest.approx(2e-3 * 576 / 4096)
    assert with_defaults(TrainConfig(), 64, 95_000).lr == pytest.approx(2e-3)  # never above the measured value
    epochs = [with_defaults(TrainConfig(), 576, tokens).epochs for tokens in (10_000, 400_000, 800_000, 5_000_000)]
    assert epochs == [3.0, 2.5, 1.25, 1.0]
    chosen = TrainConfig(lr=1e-3, epochs=0.5)
    assert with_defaults(chosen, 576, 10_000) == chosen

    d2t, t2d = identity_vocab()
    data = sequences(4, 20)
    cfg = config(tmp_path, lr=None, epochs=None, max_steps=None, grad_accum=1)
    train(cfg, tiny_target, data, d2t, t2d)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())  # what the run used, for resume and export
    assert saved["lr"] == pytest.approx(DEFAULT_LR) and saved["epochs"] == MAX_DEFAULT_EPOCHS
    out = capsys.readouterr().out
    assert "lr: 2.00e-03, the default for a target 48 wide" in out
    assert "epochs: 3, the default for 77 tokens a pass" in out
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps_per_epoch = len(plan_epoch([len(s.input_ids) for s in data], cfg, 0, shuffle=False))
    assert metrics[-1]["step"] == 3 * steps_per_epoch


def test_overfitting_a_few_sequences_reaches_high_accuracy(tiny_target, tmp_path):
    d2t, t2d = identity_vocab()
    cfg = config(tmp_path, max_steps=150, lr=1e-2, log_every=10, save_every=1000, num_hidden_layers=1)
    train(cfg, tiny_target, sequences(2, 24), d2t, t2d)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["loss_0"] < 0.6 * metrics[0]["loss_0"]  # the floor is the target entropy (~2.2)
    assert metrics[-1]["acc_0"] > 0.98
    assert metrics[-1]["acc_1"] > 0.9


def test_a_parallel_draft_learns_its_mask_slots(tiny_target, tmp_path):
    d2t, t2d = identity_vocab()
    cfg = config(
        tmp_path, max_steps=150, lr=1e-2, log_every=10, save_every=1000, num_hidden_layers=1,
        draft_mode="parallel", num_parallel_tokens=3,
    )  # fmt: skip
    draft_dir = train(cfg, tiny_target, sequences(2, 24), d2t, t2d)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [key for key in metrics[-1] if key.startswith("acc_")] == ["acc_0", "acc_1", "acc_2"]
    assert metrics[-1]["acc_0"] > 0.98
    assert metrics[-1]["acc_1"] > 0.9 and metrics[-1]["acc_2"] > 0.8  # the mask slots, two and three ahead
    assert metrics[0]["acc_1"] < 0.2
    saved = json.loads((draft_dir / "draft_config.json").read_text())
    assert (saved["draft_mode"], saved["mask_token_id"]) == ("parallel", VOCAB - 1)  # the default: the last id
    assert saved["num_parallel_tokens"] == 3  # what export and serve default K to
    assert "mask_hidden" in load_file(str(draft_dir / "model.safetensors"))


def test_parallel_settings_are_checked():
    with pytest.raises(ConfigError, match="ttt_steps: chain drafts only"):
        TrainConfig(draft_mode="parallel", ttt_steps=7)
    with pytest.raises(ConfigError, match="mask_token_id: for parallel drafts only"):
        TrainConfig(mask_token_id=5)
    with pytest.raises(ConfigError, match="num_parallel_tokens: must be >= 2"):
        TrainConfig(draft_mode="parallel", num_parallel_tokens=1)
    assert TrainConfig(draft_mode="parallel", num_parallel_tokens=5).unroll_steps == 5


def test_the_topk_term_settings_are_checked():
    with pytest.raises(ConfigError, match="topk_loss_weight: must be >= 0"):
        TrainConfig(topk_loss_weight=-1.0)
    with pytest.raises(ConfigError, match="topk_loss_k: 9000 is more than the draft vocab's 8192 tokens"):
        TrainConfig(topk_loss_weight=1.0, topk_loss_k=9000, draft_vocab_size=8192)
    assert TrainConfig(topk_loss_k=9000, draft_vocab_size=8192).topk_loss_k == 9000  # unused while the term is off


@pytest.mark.parametrize("pack, mode", [(True, "chain"), (False, "chain"), (True, "parallel")])
def test_resume_after_interruption_equals_uninterrupted_run(tiny_target, tmp_path, pack, mode):
    d2t, t2d = identity_vocab()
    data = sequences(16, 11)  # 11, 10 and 9 tokens: packed, three conversations share a 32-token row
    fields = dict(grad_accum=2, pack=pack)
    if mode == "parallel":
        fields |= dict(draft_mode="parallel", num_parallel_tokens=3, mask_token_id=5)
    full = train(config(tmp_path / "a", **fields), tiny_target, data, d2t, t2d)
    interrupted_copy(tmp_path / "a" / "run", tmp_path / "b" / "run", at=8)
    resumed = train(config(tmp_path / "b", **fields), tiny_target, data, d2t, t2d, resume=True)
    a, b = load_file(str(full / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_a_paced_run_ends_where_its_pace_says_and_a_resume_ends_there_too(tiny_target, tmp_path, capsys):
    d2t, t2d = identity_vocab()
    data = sequences(16, 11)
    calls = []

    def pace(step: int, steps_per_epoch: int) -> int | None:
        calls.append((step, steps_per_epoch))
        return 10 if step == 4 else None

    # 6 steps a pass, 12 in all; a checkpoint every 4
    fields = dict(
        pack=True, batch_tokens=32, grad_accum=1, max_steps=None, epochs=2.0, keep_checkpoints=3, warmup_ratio=0.25
    )
    cfg = config(tmp_path / "a", **fields)
    full = train(cfg, tiny_target, data, d2t, t2d, pace=pace)
    assert calls == [(4, 6), (8, 6)]  # at each checkpoint before the end
    metrics = [json.loads(line) for line in (tmp_path / "a" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [4, 8, 10]
    # the cosine follows the new end, the warmup stays that of the 12 steps planned
    assert metrics[1]["lr"] == pytest.approx(learning_rate(7, 10, cfg, planned=12))
    assert learning_rate(7, 10, cfg, planned=12) != learning_rate(7, 10, cfg)

    def unpaced(step: int, steps_per_epoch: int) -> int | None:
        raise AssertionError("a resumed run ends where its checkpoint says")

    interrupted_copy(tmp_path / "a" / "run", tmp_path / "b" / "run", at=4)  # written once the end was fitted
    resumed = train(config(tmp_path / "b", **fields), tiny_target, data, d2t, t2d, resume=True, pace=unpaced)
    logged = (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in logged] == [4, 8, 10]
    a, b = load_file(str(full / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)

    train(cfg, tiny_target, data, d2t, t2d, resume=True)  # the finished run, resumed as `wingspan train` would
    assert "the run ends at 10: nothing to train" in capsys.readouterr().out
    interrupted_copy(tmp_path / "a" / "run", tmp_path / "c" / "run", at=4)
    train(config(tmp_path / "c", **fields | {"epochs": 3.0}), tiny_target, data, d2t, t2d, resume=True)
    logged = (tmp_path / "c" / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(logged[-1])["step"] == 18  # other passes asked for: the end moves with them


def test_the_step_called_alone_is_the_loops_step(tiny_target, tmp_path):
    """`train_step` outside `train` (as the throughput bench and any later training mode call it) gives the
    loop's weights and metrics: one step of two accumulated micro-batches, compared bit for bit."""
    d2t, t2d = identity_vocab()
    data = sequences(8, 11)
    cfg = config(tmp_path, grad_accum=2, max_steps=1, log_every=1, save_every=1)
    final = train(cfg, tiny_target, data, d2t, t2d)
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])

    with pytest.raises(ValueError, match="config.lr is unset"):
        prepare_draft(tiny_target, dataclasses.replace(cfg, lr=None), d2t, t2d, World())
    torch.manual_seed(cfg.seed)
    trainee = prepare_draft(tiny_target, cfg, d2t, t2d, World())
    plan = plan_epoch([len(s.input_ids) for s in data], cfg, 0, cfg.shuffle)
    group = [collate(data, plan[0], pad_id=0), collate(data, plan[1], pad_id=0)]
    step = train_step(trainee, group, OnlineFeatures(tiny_target, d2t), learning_rate(0, 1, cfg), cfg, World())

    written = load_file(str(final / "model.safetensors"))
    for name, tensor in trainee.draft.trainable_state_dict().items():
        torch.testing.assert_close(tensor, written[name], rtol=0, atol=0)
    loss_sum, correct, count = step.sums[:3], step.sums[3:6], step.sums[6:9]
    assert (loss_sum / count).tolist() == pytest.approx([logged[f"loss_{j}"] for j in range(3)], rel=1e-12)
    assert (correct / count).tolist() == pytest.approx([logged[f"acc_{j}"] for j in range(3)], rel=1e-12)
    assert float(step.grad_norm) == pytest.approx(logged["grad_norm"], rel=1e-6)
    assert step.sums[9] == sum(int(m.attention_mask.sum()) for m in group)


def test_the_repeat_weight_and_the_loss_reach_the_step_objective(tiny_target, tmp_path):
    """A step of two accumulated micro-batches optimises the weighted mean over both: each micro-batch's own
    weighted mean (`ttt_forward` alone, with the run's loss), weighed by its share of the step's weights."""
    d2t, t2d = identity_vocab()
    g = torch.Generator().manual_seed(1)
    data = [TokenizedConversation(torch.randint(2, 6, (20,), generator=g).tolist(), [0] * 4 + [1] * 16) for _ in "ab"]
    objectives = {}
    for weight, loss, topk in ((1.0, "kl", 0.0), (3.0, "kl", 0.0), (3.0, "lk", 0.0), (3.0, "kl", 2.0)):
        run = tmp_path / f"{weight}-{loss}-{topk}"
        cfg = config(
            run, max_steps=1, grad_accum=2, batch_tokens=32, ttt_steps=1, repeat_weight=weight, loss=loss,
            topk_loss_weight=topk, topk_loss_k=2,
        )  # fmt: skip
        torch.manual_seed(cfg.seed)
        trainee = prepare_draft(tiny_target, cfg, d2t, t2d, World())
        plan = plan_epoch([20, 20], cfg, 0, cfg.shuffle)
        group = [collate(data, plan[0], pad_id=0), collate(data, plan[1], pad_id=0)]
        features = OnlineFeatures(tiny_target, d2t)
        alone = [
            float(ttt_forward(trainee.draft, features(m), 1, [1.0], None, weight, loss, (topk, 2)).loss.detach())
            for m in group
        ]
        shares = [float(step_weights_of(m.loss_mask, m.positions, m.input_ids, 1, weight).sum()) for m in group]
        expected = sum(loss * share for loss, share in zip(alone, shares)) / sum(shares)
        step = train_step(trainee, group, features, learning_rate(0, 1, cfg), cfg, World())
        assert float(step.loss) == pytest.approx(expected, rel=1e-6)
        objectives[weight, loss, topk] = float(step.loss)
    assert objectives[3.0, "kl", 0.0] != pytest.approx(objectives[1.0, "kl", 0.0], rel=1e-3)
    assert objectives[3.0, "lk", 0.0] != pytest.approx(objectives[3.0, "kl", 0.0], rel=1e-3)
    assert objectives[3.0, "kl", 2.0] > objectives[3.0, "kl", 0.0] * 1.1


def test_resume_refuses_the_other_batch_layout(tiny_target, tmp_path):
    """The data position indexes the plan, which packing changes."""
    d2t, t2d = identity_vocab()
    train(config(tmp_path, max_steps=2, save_every=1), tiny_target, sequences(4, 11), d2t, t2d)
    interrupted_copy(tmp_path / "run", tmp_path / "b" / "run", at=1)
    with pytest.raises(ConfigError, match="pack: True -> False"):
        train(config(tmp_path / "b", max_steps=2, pack=False), tiny_target, sequences(4, 11), d2t, t2d, resume=True)


def test_refuses_to_overwrite_a_run_without_resume(tiny_target, tmp_path):
    d2t, t2d = identity_vocab()
    train(config(tmp_path, max_steps=4), tiny_target, sequences(4, 20), d2t, t2d)
    with pytest.raises(FileExistsError, match="--resume"):
        train(config(tmp_path, max_steps=4), tiny_target, sequences(4, 20), d2t, t2d)


def test_training_starts_from_an_imported_draft(tiny_target, tmp_path):
    """init_from: a draft exported for SGLang and imported back starts a new run where the first one ended
    (its first loss is the first run's last, far below a fresh start's), with a fresh optimizer."""
    from wingspan.export import export_draft
    from wingspan.export.importers import import_draft
    from wingspan.models.draft import Eagle3Draft

    d2t, t2d = identity_vocab()
    data = sequences(4, 24)
    first = train(config(tmp_path / "a", max_steps=60, log_every=1), tiny_target, data, d2t, t2d)
    export_draft(Eagle3Draft.load(first), tmp_path / "sglang", "sglang")
    _, imported = import_draft(tmp_path / "sglang", tmp_path / "imported")
    train(config(tmp_path / "b", max_steps=2, log_every=1, init_from=str(imported)), tiny_target, data, d2t, t2d)
    train(config(tmp_path / "c", max_steps=2, log_every=1), tiny_target, data, d2t, t2d)

    def losses(run):
        return [json.loads(line)["loss_0"] for line in (run / "run" / "metrics.jsonl").read_text().splitlines()]

    ended, started, fresh_start = losses(tmp_path / "a")[-1], losses(tmp_path / "b")[0], losses(tmp_path / "c")[0]
    assert started == pytest.approx(ended, rel=0.1) and started < 0.8 * fresh_start  # bf16 export: not exact
    with pytest.raises(ConfigError, match="num_hidden_layers: the draft has 2, the run 1"):
        train(config(tmp_path / "d", num_hidden_layers=1, init_from=str(imported)), tiny_target, data, d2t, t2d)

    # A chain draft starts a parallel run: its step 0 is kept (the first loss is where the chain ended), the
    # mask starts fresh; a parallel draft cannot start a chain run.
    parallel = dict(draft_mode="parallel", num_parallel_tokens=3, max_steps=2, log_every=1)
    run = train(config(tmp_path / "e", init_from=str(imported), **parallel), tiny_target, data, d2t, t2d)
    assert losses(tmp_path / "e")[0] == pytest.approx(started, rel=1e-6)
    with pytest.raises(ConfigError, match="a parallel draft; set draft_mode: parallel to train it further"):
        train(config(tmp_path / "f", init_from=str(run)), tiny_target, data, d2t, t2d)

    # A parallel draft continued keeps its mask token unless the run names another one.
    mark = dict(init_from=str(imported), mask_token_id=7)
    marked = train(config(tmp_path / "g", **mark, **parallel), tiny_target, data, d2t, t2d)
    continued = train(config(tmp_path / "h", init_from=str(marked), **parallel), tiny_target, data, d2t, t2d)
    assert Eagle3Draft.load(continued).config.mask_token_id == 7
    with pytest.raises(ConfigError, match="mask_token_id: the draft has 7, the run 9"):
        train(config(tmp_path / "i", init_from=str(marked), mask_token_id=9, **parallel), tiny_target, data, d2t, t2d)


def test_a_cpu_run_hands_freed_memory_back_every_few_steps(tiny_target, tmp_path, monkeypatch):
    import wingspan.train.trainer as trainer

    releases = []
    monkeypatch.setattr(trainer, "release_freed_memory", lambda: releases.append(1))
    d2t, t2d = identity_vocab()
    train(config(tmp_path, max_steps=2 * trainer.RELEASE_MEMORY_EVERY + 3), tiny_target, sequences(6, 20), d2t, t2d)
    assert len(releases) == 2
