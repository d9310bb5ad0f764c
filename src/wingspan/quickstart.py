"""The main job: from nothing but the embedded target to a trained, exported 2-layer draft.

Each stage skips work it finds done (synthesis resumes, training resumes from its last checkpoint), so
re-running after an interruption continues where it stopped. The recipe is explained in docs/quickstart.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from wingspan.config import TrainConfig, save_json

QUICKSTART_RECIPE = dict(
    target="smollm2-135m-instruct",
    target_dtype="bfloat16",
    num_hidden_layers=2,
    draft_vocab_size=8192,
    max_length=1024,
    batch_tokens=2048,
    # The recipe's figures (docs/quickstart.md) were measured with padded micro-batches; on its short
    # conversations packing saves little padding, and it would change the measured trajectory.
    pack=False,
    ttt_steps=3,
    lr=2e-3,
    warmup_ratio=0.03,
    min_lr_ratio=0.05,
    epochs=3.0,
    autocast_bf16=True,
    save_every=50,
    log_every=10,
)
SYNTH = dict(num_conversations=360, batch_size=32, max_new_tokens=256)


def run_quickstart(out: Path, device: str = "auto") -> Path:
    from wingspan.data.synth import synthesize
    from wingspan.data.vocab import DraftVocab
    from wingspan.export import export_draft
    from wingspan.models.draft import Eagle3Draft
    from wingspan.models.registry import resolve_target
    from wingspan.pipeline import load_target, run_training

    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    data_path = out / "synth.jsonl"
    config = TrainConfig(data=[str(data_path)], output_dir=str(out / "run"), device=device, **QUICKSTART_RECIPE)
    save_json(config, out / "train_config.json")

    print(f"[1/4] target {config.target} ({config.target_dtype})")
    target = load_target(config)

    print(f"[2/4] synthesizing {SYNTH['num_conversations']} conversations with the target -> {data_path}")
    synthesize(
        target,
        SYNTH["num_conversations"],
        data_path,
        batch_size=SYNTH["batch_size"],
        max_new_tokens=SYNTH["max_new_tokens"],
        seed=config.seed,
        resume=True,
    )

    print("[3/4] draft vocab and training")
    draft_dir = run_training(config, resume="if-any", target=target)

    print("[4/4] export for vLLM")
    export_dir = out / "vllm-draft"
    export_draft(Eagle3Draft.load(draft_dir, embed_weight=target.embed_weight()), export_dir, "vllm")

    vocab_path = Path(config.output_dir) / "vocab.safetensors"
    vocab = DraftVocab.load(vocab_path)
    metrics = [json.loads(line) for line in (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()]
    last = metrics[-1]
    accuracies = "  ".join(f"acc_{j}={last[f'acc_{j}']:.3f}" for j in range(config.ttt_steps))
    minutes = (time.perf_counter() - started) / 60
    serving = json.dumps({"method": "eagle3", "model": str(export_dir), "num_speculative_tokens": 3})
    print(f"""
done in {minutes:.1f} min
  conversations : {data_path}
  draft vocab   : {vocab_path} ({vocab.draft_vocab_size} tokens, {vocab.coverage:.1%} coverage)
  training run  : {config.output_dir} (metrics.jsonl, checkpoints/)
  draft         : {draft_dir}
  vLLM export   : {export_dir}
  last per-step accuracies (TTT, teacher tokens): {accuracies}
  simulated acceptance length: {last["sim_accept_len"]:.2f}
serve it:  vllm serve {resolve_target(config.target)} --speculative-config '{serving}'""")
    return export_dir
