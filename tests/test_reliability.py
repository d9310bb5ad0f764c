"""Faults a careful user meets, injected on purpose: changed settings on resume, damaged checkpoints and
shards, non-finite training, invalid settings, file modes. docs/reliability.md tables these cases.

The tiny targets and their data are test_trainer's and test_dump's fixtures, imported (hence F811 below).
"""
# ruff: noqa: F811

import dataclasses
import json
import os
import shutil

import pytest
import torch
from conftest import interrupted_copy
from safetensors.torch import load_file
from test_dump import config_for, conversations, dump, dumped, target  # noqa: F401
from test_trainer import config, identity_vocab, sequences, tiny_target  # noqa: F401

from wingspan.config import TrainConfig
from wingspan.errors import CheckpointError, ConfigError, DataError, TrainingError
from wingspan.train.checkpoint import checkpoint_directories, read_checkpoint, state_sha256
from wingspan.train.features import OnlineFeatures
from wingspan.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")


def same_weights(a, b) -> None:
    a, b = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


@pytest.fixture
def finished(tiny_target, tmp_path):
    """An uninterrupted 12-step run (checkpoints at 4, 8, 12) and a copy of it as it was after step 8."""
    d2t, t2d = identity_vocab()
    final = train(config(tmp_path / "a"), tiny_target, sequences(16, 11), d2t, t2d)
    interrupted = interrupted_copy(tmp_path / "a" / "run", tmp_path / "b" / "run", at=8)
    return final, interrupted


def resume(tmp_path, target, data=None, vocab=None, run="b", **overrides):
    d2t, t2d = vocab or identity_vocab()
    cfg = config(tmp_path / run, **overrides)
    return train(cfg, target, data or sequences(16, 11), d2t, t2d, resume=True)


# ------------------------------------------------------------------------------------------ resume guards


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(overrides=dict(lr=1e-3)), "lr: 0.003 -> 0.001"),
        (dict(overrides=dict(seed=1)), "seed: 0 -> 1"),
        (dict(overrides=dict(ttt_steps=2)), "ttt_steps: 3 -> 2"),
        (dict(overrides=dict(grad_accum=2)), "grad_accum: 1 -> 2"),
        (dict(data=sequences(16, 11, seed=1)), "tokenized data: 16 sequences"),
        (dict(vocab=(torch.zeros(64, dtype=torch.long), torch.ones(128, dtype=torch.bool))), "vocab: the draft vocab"),
    ],
)
def test_resume_refuses_what_would_change_the_training_and_writes_nothing(
    tiny_target, finished, tmp_path, change, message
):
    _, run = finished
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=message) as error:
        resume(tmp_path, tiny_target, change.get("data"), change.get("vocab"), **change.get("overrides", {}))
    assert "step-8" in str(error.value) and "\n" not in str(error.value)
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before  # config.json, metrics.jsonl and the checkpoint as they were


def test_a_field_added_since_the_checkpoint_counts_as_its_default(tiny_target, finished, tmp_path):
    """A checkpoint written before a TrainConfig field existed resumes when the run leaves it at its default."""
    full, run = finished
    state_file = run / "checkpoints" / "step-8" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["run"]["config"]["on_nonfinite"], state["sha256"]
    state_file.write_text(json.dumps(state))
    same_weights(full, resume(tmp_path, tiny_target))


def test_a_checkpoint_from_before_run_records_still_checks_its_batch_layout(tiny_target, finished, tmp_path, capsys):
    full, run = finished
    state_file = run / "checkpoints" / "step-8" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["run"], state["sha256"]
    state_file.write_text(json.dumps(dict(state, pack=True)))
    with pytest.raises(ConfigError, match="pack: True -> False"):
        resume(tmp_path, tiny_target, pack=False)
    same_weights(full, resume(tmp_path, tiny_target))
    assert "records no run settings" in capsys.readouterr().out


def test_aux_layers_are_compared_as_resolved(tiny_target, finished, tmp_path):
    """aux_layer_ids unset, then given as the target's default: the same layers, so the same run."""
    full, _ = finished
    same_weights(full, resume(tmp_path, tiny_target, aux_layer_ids=list(tiny_target.aux_layer_ids)))


def test_a_fresh_start_never_overwrites_a_finished_run(tiny_target, finished):
    full, _ = finished
    shutil.rmtree(full.parent / "checkpoints")
    metrics = (full.parent / "metrics.jsonl").read_text()
    d2t, t2d = identity_vocab()
    for resume_mode in (False, "if-any"):
        with pytest.raises(FileExistsError, match="a finished draft and no checkpoint"):
            train(config(full.parent.parent), tiny_target, sequences(16, 11), d2t, t2d, resume=resume_mode)
    assert (full.parent / "metrics.jsonl").read_text() == metrics


def test_a_changed_data_file_is_named(tiny_target, tmp_path):
    d2t, t2d = identity_vocab()
    data_file = tmp_path / "chat.jsonl"
    data_file.write_text("one\n")
    cfg = config(tmp_path, max_steps=2, save_every=1, data=[str(data_file)])
    train(cfg, tiny_target, sequences(4, 11), d2t, t2d)
    data_file.write_text("two\n")
    with pytest.raises(ConfigError, match=rf"data: {data_file} \(sha256 [0-9a-f]{{12}}\) is not the checkpoint's"):
        train(cfg, tiny_target, sequences(4, 11), d2t, t2d, resume=True)


def test_settings_that_only_change_the_end_or_the_logging_may_change(tiny_target, finished, tmp_path, capsys):
    _, run = finished
    resume(tmp_path, tiny_target, max_steps=16, log_every=2, save_every=8)
    out = capsys.readouterr().out
    assert "resume: max_steps: 12 -> 16 (the run ends at another step" in out
    assert "resume: log_every: 4 -> 2" in out
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4, 8, 10, 12, 14, 16]


def test_metrics_are_cut_back_to_the_checkpoint_resumed(tiny_target, finished, tmp_path):
    """The steps after checkpoint 8 that a killed run had logged are logged once, by the resumed run."""
    full, run = finished
    complete = (full.parent / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(complete) + '\n{"step": 13, "lo')  # and a line cut short
    resume(tmp_path, tiny_target)
    resumed = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in resumed] == [json.loads(x)["step"] for x in complete] == [4, 8, 12]
    drop = ("tokens_per_s",)
    for a, b in zip(resumed, complete):
        assert {k: v for k, v in json.loads(a).items() if k not in drop} == pytest.approx(
            {k: v for k, v in json.loads(b).items() if k not in drop}, rel=1e-12
        )


def test_resume_without_a_checkpoint_is_an_error_unless_asked_to_start(tiny_target, tmp_path):
    d2t, t2d = identity_vocab()
    cfg = config(tmp_path, max_steps=2)
    with pytest.raises(CheckpointError, match="no checkpoint to continue"):
        train(cfg, tiny_target, sequences(4, 11), d2t, t2d, resume=True)
    assert not (tmp_path / "run").exists()
    final = train(cfg, tiny_target, sequences(4, 11), d2t, t2d, resume="if-any")
    assert (final / "model.safetensors").is_file()


def replace_in(path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def flip_a_byte(path, at: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (lambda c: (c / "model.safetensors").write_bytes((c / "model.safetensors").read_bytes()[:300]), "model"),
        (lambda c: flip_a_byte(c / "optimizer.safetensors"), "optimizer.safetensors: its contents changed"),
        (lambda c: (c / "trainer_state.json").write_text('{"step": 8, "epo'), "trainer_state.json: not a complete"),
        (lambda c: (c / "draft_config.json").unlink(), "draft_config.json: missing"),
        (
            lambda c: replace_in(c / "trainer_state.json", '"step": 12', '"step": 13'),
            "trainer_state.json: its contents",
        ),
        (
            lambda c: replace_in(c / "trainer_state.json", '"torch_rng_state": [', '"torch_rng_state": [300, '),
            "trainer_state.json",
        ),
    ],
)
def test_a_damaged_latest_checkpoint_is_named_and_the_previous_one_resumed(
    tiny_target,
    finished,
    tmp_path,
    capsys,
    damage,
    named,
):
    """The last checkpoint (12) damaged: resume says so by file and goes on from checkpoint 8, ending with the
    weights of the uninterrupted run (resume is exact from any checkpoint)."""
    full, _ = finished
    run = shutil.copytree(full.parent, tmp_path / "c" / "run")
    shutil.rmtree(run / "draft")
    damage(run / "checkpoints" / "step-12")
    same_weights(full, resume(tmp_path, tiny_target, run="c"))
    out = capsys.readouterr().out
    assert f"step-12/{named}" in out and "resuming from the previous complete checkpoint, step-8" in out


def test_no_complete_checkpoint_names_every_damaged_one(tiny_target, finished, tmp_path):
    _, run = finished
    flip_a_byte(run / "checkpoints" / "step-8" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"no complete checkpoint to resume: .*step-8/model.safetensors"):
        resume(tmp_path, tiny_target)


def test_checkpoint_files_are_recorded_with_size_and_hash(finished):
    _, run = finished
    (checkpoint,) = checkpoint_directories(run)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert set(state["files"]) == {"model.safetensors", "draft_config.json", "optimizer.safetensors"}
    assert state["run"]["config"]["lr"] == 3e-3 and len(state["run"]["inputs"]["vocab"]["sha256"]) == 64
    assert read_checkpoint(checkpoint).trainer_state["step"] == 8


def test_a_manifest_or_state_cannot_name_a_file_outside_its_directory(finished):
    _, run = finished
    state_file = run / "checkpoints" / "step-8" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["files"]["../../../config.json"] = {"bytes": 1, "sha256": "0"}
    state["sha256"] = state_sha256(state)  # a state that is whole, written so
    state_file.write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"names '../../../config.json', which is not a file inside"):
        read_checkpoint(run / "checkpoints" / "step-8")


# ------------------------------------------------------------------------------------------ finite training


class PoisonedFeatures(OnlineFeatures):
    """The target's features, NaN in the micro-batches numbered `poisoned` (counting from 1)."""

    def __init__(self, target, d2t, poisoned: set[int]) -> None:
        super().__init__(target, d2t)
        self.poisoned, self.calls = poisoned, 0

    def __call__(self, micro):
        batch = super().__call__(micro)
        self.calls += 1
        if self.calls in self.poisoned:
            batch = dataclasses.replace(batch, aux_hidden=torch.full_like(batch.aux_hidden, float("nan")))
        return batch


def test_a_non_finite_step_stops_the_run_and_names_it(tiny_target, tmp_path):
    d2t, t2d = identity_vocab()
    cfg = config(tmp_path, max_steps=12, save_every=4, log_every=4)
    features = PoisonedFeatures(tiny_target, d2t, poisoned={6})
    with pytest.raises(
        TrainingError, match=r"step 6: the loss or the gradient norm is not finite .*batch: record"
    ) as error:
        train(cfg, tiny_target, sequences(16, 11), d2t, t2d, features=features)
    assert "step 4's checkpoint is as it was" in str(error.value)
    assert [p.name for p in checkpoint_directories(tmp_path / "run")] == ["step-4"]
    assert not (tmp_path / "run" / "draft").exists()
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in metrics] == [4]


def strict_json(line: str) -> dict:
    """A JSON line that holds no NaN or Infinity (which Python's json would read as floats)."""

    def refuse(constant):
        raise AssertionError(f"{constant} in {line}")

    return json.loads(line, parse_constant=refuse)


def test_skip_mode_skips_counts_and_logs_non_finite_steps(tiny_target, tmp_path, capsys):
    """Steps 3 and 7 poisoned, and the whole window of steps 9-12 (log_every 4): the figures of a window that
    measured nothing are null, the others finite, and the draft is finite and saved."""
    d2t, t2d = identity_vocab()
    cfg = config(tmp_path, on_nonfinite="skip")
    features = PoisonedFeatures(tiny_target, d2t, poisoned={3, 7, 9, 10, 11, 12})
    final = train(cfg, tiny_target, sequences(16, 11), d2t, t2d, features=features)
    metrics = [strict_json(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped_steps"] for m in metrics] == [1, 1, 4]
    assert all(isinstance(v, (int, float)) for m in metrics[:2] for v in m.values())
    assert metrics[2]["loss_0"] is None and metrics[2]["grad_norm"] is None and metrics[2]["acc_2"] is None
    assert all(torch.isfinite(t).all() for t in load_file(str(final / "model.safetensors")).values())
    out = capsys.readouterr().out
    assert "step 3: non-finite gradient norm, skipped (1 so far); batch: record" in out
    assert "skipped (6 so far)" in out


def test_a_run_stopped_by_a_non_finite_step_resumes_with_skip(tiny_target, tmp_path, capsys):
    """The way out the stop message names: the same directory, on_nonfinite=skip, from the last checkpoint."""
    d2t, t2d = identity_vocab()
    with pytest.raises(TrainingError):
        train(
            config(tmp_path), tiny_target, sequences(16, 11), d2t, t2d, features=PoisonedFeatures(tiny_target, d2t, {6})
        )
    poisoned_again = PoisonedFeatures(tiny_target, d2t, {2})  # the resumed run's 2nd batch is step 6 again
    final = train(
        config(tmp_path, on_nonfinite="skip"),
        tiny_target,
        sequences(16, 11),
        d2t,
        t2d,
        resume=True,
        features=poisoned_again,
    )
    assert "on_nonfinite: 'stop' -> 'skip'" in capsys.readouterr().out
    assert [strict_json(x)["skipped_steps"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [
        0,
        1,
        0,
    ]
    assert (final / "model.safetensors").is_file()


def test_skip_mode_gives_up_after_ten_in_a_row(tiny_target, tmp_path):
    d2t, t2d = identity_vocab()
    cfg = config(tmp_path, on_nonfinite="skip", max_steps=20, save_every=100)
    features = PoisonedFeatures(tiny_target, d2t, poisoned=set(range(2, 30)))
    with pytest.raises(TrainingError, match="steps 2-11: 10 non-finite steps in a row"):
        train(cfg, tiny_target, sequences(16, 11), d2t, t2d, features=features)


def test_a_draft_with_non_finite_weights_is_never_written(tmp_path):
    from conftest import tiny_draft_config

    from wingspan.models.draft import Eagle3Draft, write_draft

    draft = Eagle3Draft(tiny_draft_config(vocab_size=50, draft_vocab_size=50))
    weights = draft.trainable_state_dict()
    weights["fc.weight"] = weights["fc.weight"].clone().fill_(float("inf"))
    with pytest.raises(TrainingError, match="fc.weight hold NaN or inf"):
        write_draft(tmp_path / "draft", weights, draft.config)
    assert not (tmp_path / "draft").exists()


# ------------------------------------------------------------------------------------------ settings


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("grad_clip", -1.0, "grad_clip: must be > 0, got -1.0"),
        ("min_lr_ratio", 1.5, "min_lr_ratio: must be >= 0 and <= 1, got 1.5"),
        ("max_steps", 0, "max_steps: must be >= 1, got 0"),
        ("log_every", 0, "log_every: must be >= 1, got 0"),
        ("save_every", 0, "save_every: must be >= 1, got 0"),
        ("lr", float("inf"), "lr: expected a finite number, got inf"),
        ("lr", 0.0, "lr: must be > 0, got 0.0"),
        ("warmup_ratio", 1.0, "warmup_ratio: must be >= 0 and < 1, got 1.0"),
        ("step_decay", 0.0, "step_decay: must be > 0 and <= 1"),
        ("weight_decay", -0.1, "weight_decay: must be >= 0"),
        ("epochs", 0.0, "epochs: must be > 0"),
        ("betas", [0.9, 1.0], "betas[1]: must be >= 0 and < 1, got 1.0"),
        ("seed", -1, "seed: must be >= 0 and < 9223372036854775808, got -1"),
        ("num_threads", 0, "num_threads: must be >= 1"),
        ("grad_accum", 0, "grad_accum: must be >= 1"),
        ("ttt_steps", 0, "ttt_steps: must be >= 1"),
        ("batch_tokens", 100, "batch_tokens (100) must be >= max_length (1024)"),
        ("aux_layer_ids", [-1, 3], "aux_layer_ids: expected target layer numbers >= 0"),
        ("on_nonfinite", "ignore", "on_nonfinite: 'ignore' is not one of ['stop', 'skip']"),
        ("device", "gpu", "device:"),
    ],
)
def test_every_training_setting_is_checked_with_its_range(field, value, message):
    from wingspan.config import from_dict

    with pytest.raises(ConfigError) as error:
        from_dict(TrainConfig, {field: value})
    assert message in str(error.value)


def test_a_draft_vocab_larger_than_the_target_is_refused(tiny_target, tmp_path):
    from wingspan.pipeline import build_vocab

    with pytest.raises(ConfigError, match=r"draft_vocab_size: must be <= the target's vocab \(128\), got 16384"):
        build_vocab(tiny_target, sequences(2, 11), 16384)


# ------------------------------------------------------------------------------------------ file modes


def test_outputs_get_the_users_file_mode(tmp_path):
    """safetensors writes 0600; what wingspan writes gets the umask's mode (here 027: 0640 and 0750)."""
    from conftest import tiny_draft_config

    from wingspan import files
    from wingspan.export import ExportSettings, export_draft
    from wingspan.models.draft import Eagle3Draft

    old = os.umask(0o027)
    try:
        assert files.current_umask() == 0o027
        draft = Eagle3Draft(tiny_draft_config(vocab_size=50, draft_vocab_size=50))
        export_draft(draft, tmp_path / "export", "vllm", ExportSettings(dtype="float32"))
    finally:
        os.umask(old)
    assert (tmp_path / "export").stat().st_mode & 0o777 == 0o750
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "export").iterdir()}
    assert modes and set(modes.values()) == {0o640}, modes


# ------------------------------------------------------------------------------------------ dump shards


def test_a_damaged_shard_is_found_on_read_and_on_resume_and_written_again(
    target,
    tiny_llama_dir,
    conversations,
    tmp_path,
    capsys,
):
    """Size on every read, sha256 on resume: a truncated shard fails the read naming it; a bit flip passes
    the cheap read but not `dump --resume`, which writes the shard again, byte-identical."""
    from wingspan.data.hidden_states import HiddenStateDump

    cfg = config_for(tmp_path, tiny_llama_dir, conversations)
    manifest = dump(cfg, target, tmp_path / "dump")
    assert all(s.bytes and len(s.sha256) == 64 for s in manifest.shards)
    first, second = (tmp_path / "dump" / s.file for s in manifest.shards[:2])
    pristine = {p.name: p.read_bytes() for p in (tmp_path / "dump").iterdir()}

    first.write_bytes(pristine[first.name][:-10])
    with pytest.raises(DataError, match=rf"{first.name}: \d+ bytes, \d+ when written; `wingspan dump ... --resume`"):
        HiddenStateDump(tmp_path / "dump")
    first.write_bytes(pristine[first.name])
    flip_a_byte(second)
    HiddenStateDump(tmp_path / "dump")  # sizes only: the flip passes
    with pytest.raises(DataError, match=rf"{second.name}: its contents changed"):
        HiddenStateDump(tmp_path / "dump", verify=True)
    first.write_bytes(pristine[first.name][:-10])

    dump(cfg, target, tmp_path / "dump", resume=True)
    out = capsys.readouterr().out
    assert f"{first.name}: " in out and f"{second.name}: its contents changed" in out and "writing it again" in out
    assert {p.name: p.read_bytes() for p in (tmp_path / "dump").iterdir()} == pristine


def test_a_shard_name_outside_the_dump_is_refused(dumped):
    from wingspan.data.hidden_states import MANIFEST, HiddenStateDump

    _, directory = dumped
    copy = shutil.copytree(directory, directory.parent / "escaping")
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["shards"][0]["file"] = "/etc/passwd"
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="names '/etc/passwd', which is not a file inside"):
        HiddenStateDump(copy)


# ------------------------------------------------------------------------------------------ server replies


class FakeServer:
    """A local OpenAI-compatible server whose chat replies are given per test: a dict (sent as JSON), bytes
    (sent as they are) or an int (that HTTP status)."""

    def __init__(self, reply) -> None:
        import http.server
        import threading

        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self.send(200, json.dumps({"data": [{"id": "fake"}]}).encode())

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                reply = outer.reply
                if isinstance(reply, int):
                    self.send(reply, b'{"error": "no"}')
                else:
                    self.send(200, reply if isinstance(reply, bytes) else json.dumps(reply).encode())

        self.reply = reply
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


def completion(content, finish_reason="stop") -> dict:
    return {"choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": finish_reason}]}


QUESTIONS = [{"id": f"q{i}", "conversations": [{"from": "human", "value": f"Question {i}?"}]} for i in range(3)]


def regenerate_through(reply, tmp_path, *extra: str):
    from test_cli import wingspan

    source = tmp_path / "questions.json"
    source.write_text(json.dumps(QUESTIONS))
    server = FakeServer(reply)
    try:
        return wingspan(
            "data", "regenerate", str(source), "--out", str(tmp_path / "out.jsonl"), "--server", server.url, *extra
        )
    finally:
        server.close()


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        ({"id": "x"}, "not a chat completion"),
        ({"choices": []}, "not a chat completion"),
        (completion(None), "a reply without text content (finish_reason 'stop')"),
        (completion(["a", "list"]), "a reply without text content"),
        (b"<html>Bad gateway</html>", "the reply is not JSON"),
        (404, "HTTP 404"),
    ],
)
def test_a_malformed_server_reply_is_one_line_naming_the_conversation(tmp_path, reply, message):
    result = regenerate_through(reply, tmp_path)
    assert result.returncode == 2, result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: conversation 'q0'") and message in error, result.stderr
    assert "Traceback" not in result.stderr


def test_a_reply_cut_before_any_content_is_dropped_and_counted(tmp_path):
    result = regenerate_through(completion(None, finish_reason="length"), tmp_path)
    assert result.returncode == 0, result.stderr
    assert "(0 conversations); dropped: 3 (3 because max_new_tokens cut the reply before any content" in result.stdout
    assert (tmp_path / "out.jsonl").read_text() == ""


def test_regeneration_refuses_an_existing_output_and_resumes_only_its_own(tmp_path):
    first = regenerate_through(completion("An answer."), tmp_path)
    assert first.returncode == 0 and "wrote" in first.stdout and "(3 conversations)" in first.stdout
    again = regenerate_through(completion("An answer."), tmp_path)
    assert again.returncode == 2 and "exists; pass --resume" in again.stderr
    other = regenerate_through(completion("An answer."), tmp_path, "--resume", "--max-new-tokens", "7")
    assert other.returncode == 2 and "max_new_tokens: 512 -> 7" in other.stderr
    resumed = regenerate_through(completion("Another answer."), tmp_path, "--resume")
    assert resumed.returncode == 0 and "(3 conversations)" in resumed.stdout
    assert "Another" not in (tmp_path / "out.jsonl").read_text()  # nothing was redone


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://localhost:8000", "http://"])
def test_a_server_url_without_a_scheme_is_refused(tmp_path, url):
    from test_cli import wingspan

    source = tmp_path / "questions.json"
    source.write_text(json.dumps(QUESTIONS))
    result = wingspan("data", "regenerate", str(source), "--out", str(tmp_path / "o.jsonl"), "--server", url)
    assert result.returncode == 2 and "expected an http:// or https:// URL" in result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------------------------------ partial exports


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 40),
            "model.safetensors: not a readable safetensors",
        ),
        (lambda d: (d / "model.safetensors").unlink(), "model.safetensors: missing; an export holds its weights"),
        (lambda d: (d / "config.json").write_text('{"architectures": ["Foo"]}'), r"no known layout \(architectures"),
        (lambda d: shutil.rmtree(d) or d.mkdir(), "it holds neither draft_config.json nor config.json"),
        (lambda d: shutil.rmtree(d), "no such directory"),
    ],
)
def test_a_missing_or_partial_export_is_named(tmp_path, damage, message):
    from conftest import tiny_draft_config
    from test_cli import wingspan

    from wingspan.errors import ExportError
    from wingspan.export import ExportSettings, export_draft, load_any_draft
    from wingspan.models.draft import Eagle3Draft

    draft = Eagle3Draft(tiny_draft_config(vocab_size=50, draft_vocab_size=50))
    export_draft(draft, tmp_path / "export", "vllm", ExportSettings(dtype="float32"))
    damage(tmp_path / "export")
    with pytest.raises(ExportError, match=message):
        load_any_draft(tmp_path / "export")
    if "readable" in message:  # and through the command, once
        result = wingspan("export", str(tmp_path / "export"), "--out", str(tmp_path / "again"))
        assert result.returncode == 2 and "not a readable safetensors" in result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(temperature=float("inf")), "temperature: must be >= 0, got inf"),
        (dict(temperature=-0.5), "temperature: must be >= 0, got -0.5"),
        (dict(limit=0), "limit: must be >= 1, got 0"),
        (dict(warmup_prompts=-1), "warmup_prompts: must be >= 0"),
        (dict(seed=-3), "seed: must be >= 0"),
    ],
)
def test_eval_settings_are_checked_with_their_range(fields, message):
    from wingspan.eval.runner import EvalSettings

    with pytest.raises(ConfigError, match=message):
        EvalSettings(**fields)
