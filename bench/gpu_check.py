"""The GPU check: wingspan on a CUDA device against the CPU, and training throughput at an 8B target's shapes.

    PYTHONPATH=src python bench/gpu_check.py                # on a GPU machine: all three parts, < 8 min on an H200
    PYTHONPATH=src python bench/gpu_check.py --smoke --device cpu   # the same code on tiny shapes (tests run this)

Needs torch, transformers, safetensors, typer and tqdm only: no network, no downloads. Every model is built
here with random weights (a word-level tokenizer, a tiny Llama, an 8B-shaped Llama: hidden 4096, 32 layers,
vocab 128256), so the figures measure wingspan's code on the device, not a checkpoint.

(a) agreement: the same short training run (fp32, no autocast) on the CPU and on the device, loss per step
    within 1e-3 relative; greedy speculative decoding on the device equal to greedy decoding there, and to
    the CPU's tokens.
(b) throughput: online training steps (target forward + TTT unroll, backward, AdamW) in non-pad tokens/s and
    peak device memory, for D = 1 and D = 3 at TTT 7 and rows of 2048 tokens, the target in bf16 and the
    draft under bf16 autocast (the GPU defaults).
(c) the same with the TTT loss module under torch.compile, and whether it helps.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from wingspan.config import TrainConfig
from wingspan.data.batching import collate, plan_epoch
from wingspan.data.template import TokenizedConversation
from wingspan.data.vocab import build_draft_vocab
from wingspan.decode.speculative import speculative_generate
from wingspan.devices import describe, resolve_device
from wingspan.models.draft import Eagle3Draft
from wingspan.models.target import TargetModel
from wingspan.train.distributed import World
from wingspan.train.features import OnlineFeatures
from wingspan.train.trainer import learning_rate, prepare_draft, train, train_step, with_defaults

EIGHT_B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=2048,
)


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer with `vocab_size` ids (0 = pad/eos): what TargetModel needs of a tokenizer here."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<eos>")), eos_token="<eos>", pad_token="<eos>"
    )


def random_llama(
    shape: dict, device: torch.device, dtype: torch.dtype, build_on: torch.device | None = None
) -> TargetModel:
    """A Llama of `shape` with random weights in `dtype` on `device`, drawn on `build_on` (default: `device`
    itself; the CPU where two devices must get the same weights, their generators differing)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(build_on or device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.to(device)
    with torch.no_grad():  # sharper than init scale: attention and argmax that depend on their inputs
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(4)
        model.lm_head.weight.mul_(8)
    layers = shape["num_hidden_layers"]
    return TargetModel(model, word_tokenizer(shape["vocab_size"]), "random-llama", [1, layers // 2, layers - 2])


def random_records(count: int, length: int, vocab: int, seed: int) -> list[TokenizedConversation]:
    """Conversations of `length` random tokens; the last two thirds are the assistant's (loss-masked)."""
    generator = torch.Generator().manual_seed(seed)
    prompt = length // 3
    return [
        TokenizedConversation(
            torch.randint(1, vocab, (length,), generator=generator).tolist(), [0] * prompt + [1] * (length - prompt)
        )
        for _ in range(count)
    ]


def curve(run: Path) -> list[float]:
    return [json.loads(line)["loss_0"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def agreement(device: torch.device, steps: int) -> bool:
    """(a): the same training run and the same decoding on the CPU and on `device`."""
    records = random_records(48, 96, TINY["vocab_size"], seed=1)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for run, where in enumerate((torch.device("cpu"), device)):
            target = random_llama(TINY, where, torch.float32, build_on=torch.device("cpu"))
            vocab = build_draft_vocab(records, target.vocab_size, 256, always_include=target.eos_token_ids)
            config = TrainConfig(
                output_dir=f"{tmp}/run{run}",
                num_hidden_layers=2,
                draft_vocab_size=256,
                max_length=96,
                batch_tokens=384,
                ttt_steps=3,
                lr=1e-3,
                max_steps=steps,
                log_every=1,
                save_every=10_000,
                autocast_bf16=False,
                target_dtype="float32",
            )
            draft_dir = train(config, target, records, vocab.d2t, vocab.t2d)
            draft = Eagle3Draft.load(draft_dir, embed_weight=target.embed_weight()).to(where).eval()
            prompts = [r.input_ids[:20] for r in records[:4]]
            greedy = [target.generate([p], 32, stop_ids=[])[0].tokens for p in prompts]
            spec = [speculative_generate(target, draft, p, 32, num_draft_tokens=3, stop_ids=[]).tokens for p in prompts]
            results.append((curve(Path(config.output_dir)), greedy, spec))
    (cpu_loss, cpu_greedy, _), (dev_loss, dev_greedy, dev_spec) = results
    worst = max(abs(a - b) / abs(a) for a, b in zip(cpu_loss, dev_loss))
    spec_equal = dev_spec == dev_greedy
    greedy_equal = dev_greedy == cpu_greedy
    print(f"(a) loss_0 over {steps} steps: max relative difference {device.type} vs cpu {worst:.2e} (goal < 1e-3)")
    print(
        f"    first/last loss_0: cpu {cpu_loss[0]:.5f}/{cpu_loss[-1]:.5f}, "
        f"{device.type} {dev_loss[0]:.5f}/{dev_loss[-1]:.5f}"
    )
    print(
        f"    speculative == greedy on {device.type}: {spec_equal}; {device.type} greedy == cpu greedy: {greedy_equal}"
    )
    return worst < 1e-3 and spec_equal and greedy_equal


def throughput(target: TargetModel, layers: int, shape: dict, steps: int, compiled: bool, row_tokens: int) -> str:
    """(b)/(c): timed online training steps of a D-layer draft on `target`."""
    device = target.device
    gc.collect()  # the previous setting's draft and optimizer state, before its peak memory is reset
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rows = 4
    records = random_records(rows * (steps + 2), row_tokens, shape["vocab_size"], seed=layers)
    draft_vocab = min(32000, shape["vocab_size"])
    vocab = build_draft_vocab(records, target.vocab_size, draft_vocab, always_include=target.eos_token_ids)
    config = TrainConfig(
        num_hidden_layers=layers, draft_vocab_size=draft_vocab, max_length=row_tokens, batch_tokens=rows * row_tokens
    )
    config = with_defaults(config, target.hidden_size, sum(len(r.input_ids) for r in records))
    torch.manual_seed(0)
    trainee = prepare_draft(target, config, vocab.d2t, vocab.t2d, World())
    if compiled:
        trainee.model = torch.compile(trainee.model)
    features = OnlineFeatures(target, vocab.d2t)
    plan = plan_epoch([len(r.input_ids) for r in records], config, 0, shuffle=False)
    micros = [collate(records, batch, 0) for batch in plan]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    warmup = 2
    started = 0.0
    tokens = 0
    for k, micro in enumerate(micros[: warmup + steps]):
        if k == warmup:
            synchronize(device)
            started = time.perf_counter()
        metrics = train_step(trainee, [micro], features, learning_rate(k, 100, config), config, World())
        if k >= warmup:
            tokens += int(micro.attention_mask.sum())
    synchronize(device)
    elapsed = time.perf_counter() - started
    assert torch.isfinite(metrics.loss), "the loss is not finite"
    peak = f"{torch.cuda.max_memory_allocated(device) / 2**30:6.1f} GiB" if device.type == "cuda" else "n/a (CPU)"
    label = "compiled" if compiled else "eager"
    return (
        f"D={layers} {label:8s} {tokens / elapsed:10,.0f} tokens/s   peak {peak}   "
        f"({steps} steps of {rows}x{row_tokens})"
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="the device checked against the CPU (default: cuda)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes everywhere: checks the script itself")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per setting")
    parser.add_argument("--no-compile", action="store_true", help="skip (c)")
    parser.add_argument(
        "--budget-s", type=float, default=420, help="(c) starts only with 150 s of this budget left (default 420)"
    )
    args = parser.parse_args()
    device = resolve_device(args.device)
    print(f"device {describe(device)}, torch {torch.__version__}", flush=True)
    started = time.perf_counter()
    ok = agreement(device, steps=8 if args.smoke else 20)
    print(f"    ({time.perf_counter() - started:.0f} s)", flush=True)

    shape, row_tokens = (TINY, 128) if args.smoke else (EIGHT_B, 2048)
    target = random_llama(shape, device, torch.bfloat16)
    print(
        f"(b) online training on a random {shape['num_hidden_layers']}-layer, hidden {shape['hidden_size']} "
        "target (bf16):"
    )
    for layers in (1, 3):
        print("    " + throughput(target, layers, shape, args.steps, compiled=False, row_tokens=row_tokens), flush=True)
    if not args.no_compile:
        print("(c) the TTT loss under torch.compile:")
        for layers in (1, 3):
            if time.perf_counter() - started > args.budget_s - 150:
                print(
                    f"    D={layers} compiled: skipped, {time.perf_counter() - started:.0f} s of the "
                    f"{args.budget_s:.0f} s budget used"
                )
                continue
            try:
                print(
                    "    " + throughput(target, layers, shape, args.steps, compiled=True, row_tokens=row_tokens),
                    flush=True,
                )
            except Exception as error:  # a compile failure is a finding to print, not a crash of the check
                print(f"    D={layers} compiled: failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    print(f"total {time.perf_counter() - started:.0f} s; agreement {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
