"""Training throughput (non-pad tokens/s) online and offline, with the parts of an online step measured apart.

For each setting (draft layers D x max length), on the real target and real conversations, in one process
(a fresh subprocess per setting, so that peak memory figures do not mix), on the same micro-batches:
  (a) target   the online feature source alone (`OnlineFeatures`: target forward + draft-vocab logits);
  (b) draft    `ttt_forward` + backward alone, on features precomputed once by (a);
  (c) online   the trainer's step: collate, features, TTT under bf16 autocast, backward, clip, AdamW;
  (d) offline  the same step fed by `DumpFeatures` from a dump written first to a temp dir (`write_dump`,
               its own time reported as `dump`).
Each setting runs in one or more layouts of the micro-batches (`--layouts`, `wingspan.data.batching`):
  packed   the trainer's default: whole conversations back to back in rows of max length, batch_tokens //
           max length rows (`plan_packed`, seed 0, epoch 0, shuffled);
  padded   one conversation per row, right-padded to the longest, bucketed by length (`plan_padded`);
and with `--batch-size-1` also one conversation per micro-batch (SpecForge's batch 1, the anchor's setting).
Packed and padded run the same conversations, a seeded random sample (so its lengths are the data's):
`--warmup` micro-batch budgets' worth (`--batch-tokens` each) untimed, then `--steps` budgets' worth timed,
each set planned on its own in the layout; their ratio is packing's gain. The padding fraction of each plan
is printed for the timed micro-batches and for a whole epoch of the data.

Steps (c) and (d) call the trainer's own step (`wingspan.train.trainer`: `prepare_draft`, then `train_step`
at `learning_rate`) on these micro-batches, one per optimizer step (grad_accum 1), in one process; not
`train()` itself, which plans its own batches and writes checkpoints.

Peak memory is the process's peak RSS (VmHWM, reset through /proc/self/clear_refs before each phase, so
each phase's figure is its own peak, model and data included; ru_maxrss where that is unavailable).

Goals: online time <= 1.3 x (target time + draft time); offline >= 3 x online; online (batch 1,
D = 1, length 1024) >= 1.5 x SpecForge's 223 tok/s (2 cores); peak memory at length 2048 (D = 3) < 2 x
that at 1024.

    python bench/train_throughput.py --layers 1,3 --seq 1024,2048 --batch-size-1 --json /tmp/tt.json
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

SHARED = Path(__file__).resolve().parents[2] / "shared"
SPECFORGE_ANCHOR = 223.0  # non-pad tokens/s: SpecForge, 1-layer draft, TTT 7, max length 1024, batch 1, 2 cores
SPECFORGE_RSS_GB = 5.1
ONLINE_OVERHEAD_GOAL = 1.3
OFFLINE_GOAL = 3.0
ANCHOR_GOAL = 1.5
MEMORY_GOAL = 2.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument(
        "--data",
        default=str(SHARED / "data/train/sharegpt500_smollm2_regen.jsonl"),
        help="a conversation file (ShareGPT / OpenAI messages / EAGLE questions)",
    )
    parser.add_argument("--layers", default="1,3", help="draft decoder layers D, comma-separated")
    parser.add_argument("--seq", default="1024,2048", help="max lengths, comma-separated")
    parser.add_argument("--ttt", type=int, default=7, help="TTT steps")
    parser.add_argument("--batch-tokens", type=int, default=2048, help="micro-batch token budget (>= seq)")
    parser.add_argument(
        "--layouts", default="padded,packed", help="micro-batch layouts, comma-separated: padded, packed"
    )
    parser.add_argument(
        "--batch-size-1",
        action="store_true",
        help="also run every setting with one conversation per micro-batch (SpecForge's batch 1)",
    )
    parser.add_argument("--draft-vocab", type=int, default=16384)
    parser.add_argument(
        "--steps",
        type=int,
        default=4,
        help="timed conversations per phase: this many micro-batch budgets' worth (batch 1: micro-batches)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed ones before them, likewise")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-autocast", action="store_true", help="run the draft in fp32 (default: bf16 autocast)")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run the settings in this process (peak memory then covers the earlier settings too)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # JSON spec of one setting; internal
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------------------- memory


def _hwm_kb() -> int | None:
    try:
        return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))
    except (OSError, AttributeError):
        return None


def reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_gb() -> float:
    kb = _hwm_kb() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # both in KiB on Linux
    return kb * 1024 / 1e9


# ----------------------------------------------------------------------------------------- worker


def take_tokens(order: list[int], lengths: list[int], *budgets: int) -> list[list[int]]:
    """Consecutive runs of `order`, each the first to reach its token budget."""
    runs, at = [], 0
    for budget in budgets:
        run: list[int] = []
        while sum(lengths[i] for i in run) < budget:
            if at == len(order):
                raise SystemExit(f"the data holds {sum(lengths)} tokens, fewer than the {sum(budgets)} asked for")
            run.append(order[at])
            at += 1
        runs.append(run)
    return runs


def lay_out(ids: list[int], lengths: list[int], seq: int, config, layout: str) -> list:
    """The micro-batches of conversations `ids` in `layout` (`plan_packed` or `plan_padded`, the config's
    seed, epoch 0), as indices into the data."""
    from wingspan.data.batching import plan_packed, plan_padded

    sub = [lengths[i] for i in ids]
    if layout == "packed":
        plan = plan_packed(sub, seq, config.batch_tokens, config.seed, 0, config.shuffle)
    else:
        plan = plan_padded(sub, config.batch_tokens, config.seed, 0, config.shuffle)
    return [[[ids[i] for i in row] for row in batch] for batch in plan]


def run_setting(spec: dict) -> dict:
    """All four phases for one setting; returns its figures."""
    from wingspan.config import TrainConfig
    from wingspan.data.batching import collate, padding_fraction, plan_packed, plan_padded
    from wingspan.data.hidden_states import HiddenStateDump, dump_identity, write_dump
    from wingspan.data.vocab import build_draft_vocab
    from wingspan.models.target import TargetModel
    from wingspan.pipeline import tokenized_dataset
    from wingspan.train.distributed import World
    from wingspan.train.features import DumpFeatures, OnlineFeatures
    from wingspan.train.trainer import (
        learning_rate,
        prepare_draft,
        step_normaliser,
        to_device,
        train_step,
        with_defaults,
    )

    torch.set_num_threads(spec["threads"])
    resettable = reset_peak()
    target = TargetModel.load(spec["target"], dtype="bfloat16")
    seq = spec["seq"]
    config = TrainConfig(
        target=spec["target"],
        data=[spec["data"]],
        num_hidden_layers=spec["layers"],
        draft_vocab_size=spec["draft_vocab"],
        max_length=seq,
        batch_tokens=max(spec["batch_tokens"], seq),
        ttt_steps=spec["ttt"],
        autocast_bf16=spec["autocast"],
        num_threads=spec["threads"],
    )
    device = target.device
    records = tokenized_dataset(config.data, target.tokenizer, seq)
    vocab = build_draft_vocab(
        records, target.vocab_size, min(config.draft_vocab_size, target.vocab_size), always_include=target.eos_token_ids
    )
    lengths = [len(r.input_ids) for r in records]
    config = with_defaults(config, target.hidden_size, sum(lengths))
    order = list(range(len(records)))  # conversations in a seeded random order: a fair sample of the lengths
    random.Random(config.seed).shuffle(order)
    if spec["layout"] == "bs1":
        count = spec["warmup"] + spec["steps"]
        plan, warmup = [[[i]] for i in order[:count]], spec["warmup"]
    else:
        # The warm-up and the timed conversations: `--warmup` and `--steps` micro-batch budgets' worth of the
        # random order, each set planned on its own in the layout, so that both layouts time the same ones.
        budget = config.batch_tokens
        warm_ids, timed_ids = take_tokens(order, lengths, spec["warmup"] * budget, spec["steps"] * budget)
        warm, timed = (lay_out(ids, lengths, seq, config, spec["layout"]) for ids in (warm_ids, timed_ids))
        plan, warmup = warm + timed, len(warm)
    # The records of these micro-batches, renumbered 0..n-1: the dump of phase (d) holds exactly them.
    subset = [records[i] for batch in plan for row in batch for i in row]
    numbering = iter(range(len(subset)))
    batches = [[[next(numbering) for _ in row] for row in batch] for batch in plan]
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    micros = [collate(subset, b, pad_id) for b in batches]
    tokens = [int(m.attention_mask.sum()) for m in micros]
    timed_tokens = sum(tokens[warmup:])
    timed_slots = sum(m.attention_mask.numel() for m in micros[warmup:])
    autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=config.autocast_bf16)
    epoch_plans = {
        "padded": plan_padded(lengths, config.batch_tokens, config.seed, 0, config.shuffle),
        "packed": plan_packed(lengths, seq, config.batch_tokens, config.seed, 0, config.shuffle),
    }
    result: dict = {
        "timed_micro_batches": len(micros) - warmup,
        "rows": [len(b) for b in batches],
        "timed_tokens": timed_tokens,
        "timed_padding": 1 - timed_tokens / timed_slots,
        "peak_reset": resettable,
        "phases": {},
        "epoch": {
            name: {"micro_batches": len(p), "padding": padding_fraction(p, lengths)} for name, p in epoch_plans.items()
        },
    }

    def phase(name: str, body, reset: bool = True) -> list:
        """Run body(k) on every micro-batch; time the ones after the warm-up; record tokens/s and peak RSS.
        Tokens per CPU second too: it leaves out the time the process waited for a core on a shared machine."""
        if reset:
            reset_peak()
        outputs, seconds, cpu_seconds = [], 0.0, 0.0
        for k in tqdm(
            range(len(micros)), desc=f"{spec['label']} {name}", unit="batch", leave=False, dynamic_ncols=True
        ):
            started, cpu_started = time.perf_counter(), time.process_time()
            outputs.append(body(k))
            if k >= warmup:
                seconds += time.perf_counter() - started
                cpu_seconds += time.process_time() - cpu_started
        result["phases"][name] = {
            "seconds": seconds,
            "tokens_per_s": timed_tokens / seconds,
            "peak_rss_gb": peak_gb(),
            "tokens_per_cpu_s": timed_tokens / cpu_seconds,
        }
        return outputs

    # (a) the target's side alone
    online = OnlineFeatures(target, vocab.d2t)
    features = phase("target", lambda k: online(micros[k]))

    # (b) the draft's forward + backward alone, on those features
    def draft_pass(trainee, k: int) -> None:
        batch = to_device(features[k], device)
        with torch.autocast(**autocast):
            out = trainee.model(batch, step_normaliser([micros[k]], config.ttt_steps, config.repeat_weight).to(device))
        out.loss.backward()
        trainee.draft.zero_grad(set_to_none=True)

    torch.manual_seed(config.seed)
    phase("draft", functools.partial(draft_pass, prepare_draft(target, config, vocab.d2t, vocab.t2d, World())))
    features.clear()  # the draft phase was their last reader

    # (c), (d): the trainer's step, one micro-batch per optimizer step
    def trainer_step(source):
        torch.manual_seed(config.seed)
        trainee = prepare_draft(target, config, vocab.d2t, vocab.t2d, World())

        def step(k: int) -> float:
            micro = collate(subset, batches[k], pad_id)
            lr = learning_rate(k, len(micros), config)
            return float(train_step(trainee, [micro], source, lr, config, World()).loss)

        return step

    losses_online = phase("online", trainer_step(online))

    with tempfile.TemporaryDirectory(prefix="wingspan-bench-dump-") as tmp:
        reset_peak()
        identity = dump_identity(config, target)
        started = time.perf_counter()
        write_dump(target, subset, identity, Path(tmp) / "dump", batch_tokens=config.batch_tokens)
        seconds = time.perf_counter() - started
        total_tokens = sum(tokens)
        result["phases"]["dump"] = {
            "seconds": seconds,
            "tokens_per_s": total_tokens / seconds,
            "peak_rss_gb": peak_gb(),
            "tokens": total_tokens,
        }
        dump = HiddenStateDump(Path(tmp) / "dump")
        assert all(a.input_ids == b.input_ids for a, b in zip(dump.records, subset)), "dump records out of order"
        offline = DumpFeatures(dump, target, vocab.d2t)
        losses_offline = phase("offline", trainer_step(offline))
    result["loss_online"] = losses_online
    result["loss_offline"] = losses_offline
    return result


# ----------------------------------------------------------------------------------------- driver


def settings(args: argparse.Namespace) -> list[dict]:
    common = {
        k: getattr(args, k)
        for k in ("target", "data", "ttt", "batch_tokens", "draft_vocab", "steps", "warmup", "threads")
    }
    common["autocast"] = not args.no_autocast
    layouts = args.layouts.split(",")
    unknown = set(layouts) - {"padded", "packed"}
    if unknown:
        raise SystemExit(f"--layouts: unknown {sorted(unknown)}; expected padded, packed")
    layouts += ["bs1"] if args.batch_size_1 else []
    out = []
    for layers in (int(x) for x in args.layers.split(",")):
        for seq in (int(x) for x in args.seq.split(",")):
            for layout in layouts:
                label = f"D={layers} seq={seq} {layout}"
                out.append({**common, "layers": layers, "seq": seq, "layout": layout, "label": label})
    return out


def run_in_subprocess(spec: dict) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, __file__, "--worker", json.dumps({**spec, "out": f.name})], check=True)
        return json.loads(Path(f.name).read_text())


def summarise(spec: dict, r: dict) -> dict:
    p = r["phases"]
    a, b, c, d = (p[n]["tokens_per_s"] for n in ("target", "draft", "online", "offline"))
    parts = p["target"]["seconds"] + p["draft"]["seconds"]
    return {
        "label": spec["label"],
        "layers": spec["layers"],
        "seq": spec["seq"],
        "layout": spec["layout"],
        "timed_padding": r["timed_padding"],
        "timed_micro_batches": r["timed_micro_batches"],
        "epoch": r["epoch"],
        "target_tps": a,
        "draft_tps": b,
        "parts_tps": 1 / (1 / a + 1 / b),
        "online_tps": c,
        "offline_tps": d,
        "dump_tps": p["dump"]["tokens_per_s"],
        "online_over_parts": p["online"]["seconds"] / parts,
        "offline_over_online": d / c,
        "online_over_anchor": c / SPECFORGE_ANCHOR,
        "online_over_target": c / a,
        "peak_online_gb": p["online"]["peak_rss_gb"],
        "peak_offline_gb": p["offline"]["peak_rss_gb"],
        "peak_dump_gb": p["dump"]["peak_rss_gb"],
        "cpu_tps": {n: p[n]["tokens_per_cpu_s"] for n in ("target", "draft", "online", "offline")},
    }


def verdict(ok: bool) -> str:
    return "meets" if ok else "MISSES"


def print_packing(rows: list[dict], batch_tokens: int) -> None:
    """Packed vs padded on the same conversations, per (D, seq), and each plan's padding over a whole epoch."""
    by_key = {(r["layers"], r["seq"], r["layout"]): r for r in rows}
    pairs = [
        (by_key[k[:2] + ("padded",)], r)
        for k, r in by_key.items()
        if k[2] == "packed" and k[:2] + ("padded",) in by_key
    ]
    if not pairs:
        return
    print(
        "\npacking: packed / padded on the same conversations, non-pad tokens per wall second (per CPU second);"
        "\npadding = share of micro-batch slots (rows x longest row) that are padding"
    )
    for padded, packed in pairs:
        ratios = ", ".join(
            f"{phase} {packed[f'{phase}_tps'] / padded[f'{phase}_tps']:.2f}x "
            f"({packed['cpu_tps'][phase] / padded['cpu_tps'][phase]:.2f}x)"
            for phase in ("online", "offline", "target", "draft")
        )
        epoch = packed["epoch"]
        print(
            f"  D={packed['layers']} seq={packed['seq']}: {ratios}\n"
            f"    padding: timed {packed['timed_padding']:.1%} packed vs {padded['timed_padding']:.1%} padded "
            f"({packed['timed_micro_batches']} vs {padded['timed_micro_batches']} micro-batches); a whole epoch "
            f"{epoch['packed']['padding']:.1%} vs {epoch['padded']['padding']:.1%} ({epoch['packed']['micro_batches']} "
            f"vs {epoch['padded']['micro_batches']} micro-batches of <= {max(batch_tokens, packed['seq'])} tokens)"
        )


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        Path(spec["out"]).write_text(json.dumps(run_setting(spec)))
        return
    specs = settings(args)
    raw, rows = [], []
    for spec in tqdm(specs, desc="settings", unit="setting", dynamic_ncols=True):
        r = run_setting(spec) if args.in_process else run_in_subprocess(spec)
        raw.append({"spec": spec, "result": r})
        rows.append(summarise(spec, r))

    print(
        f"\n{args.target} (bf16) -> EAGLE-3 draft, TTT {args.ttt}, draft vocab {args.draft_vocab}, "
        f"{'fp32' if args.no_autocast else 'bf16 autocast'}, {args.threads} thread(s), timed: {args.steps} x "
        f"{args.batch_tokens} tokens of conversations after {args.warmup} x {args.batch_tokens} warm-up (batch 1: "
        f"{args.steps} after {args.warmup}), data {Path(args.data).name}"
    )
    print(
        "tokens/s are non-pad tokens; parts = 1/(1/target + 1/draft), the online rate if it cost exactly the "
        "target forward plus the draft's forward/backward; peak = phase's peak RSS "
        f"({'one subprocess per setting' if not args.in_process else 'one process for all settings'})\n"
    )
    print(
        f"{'setting':<24}{'pad':>6}{'target':>8}{'draft':>8}{'parts':>8}{'online':>8}{'offline':>9}{'dump':>8}"
        f"{'on/parts':>10}{'off/on':>8}{'on/223':>8}{'on/tgt':>8}{'peak on':>9}{'peak off':>9}"
    )
    for r in rows:
        print(
            f"{r['label']:<24}{r['timed_padding']:>6.1%}{r['target_tps']:>8.0f}{r['draft_tps']:>8.0f}{r['parts_tps']:>8.0f}"
            f"{r['online_tps']:>8.0f}{r['offline_tps']:>9.0f}{r['dump_tps']:>8.0f}{r['online_over_parts']:>9.2f}x"
            f"{r['offline_over_online']:>7.2f}x{r['online_over_anchor']:>7.2f}x{r['online_over_target']:>7.2f}x"
            f"{r['peak_online_gb']:>7.2f}GB{r['peak_offline_gb']:>7.2f}GB"
        )
    print_packing(rows, args.batch_tokens)

    print()
    verdicts = {}
    worst = max(rows, key=lambda r: r["online_over_parts"])
    verdicts["online_overhead"] = worst["online_over_parts"] <= ONLINE_OVERHEAD_GOAL
    print(
        f"online vs target + draft: at most {worst['online_over_parts']:.2f}x the time ({worst['label']}): "
        f"{verdict(verdicts['online_overhead'])} the <= {ONLINE_OVERHEAD_GOAL}x goal"
    )
    worst = min(rows, key=lambda r: r["offline_over_online"])
    verdicts["offline_speedup"] = worst["offline_over_online"] >= OFFLINE_GOAL
    print(
        f"offline vs online: at least {worst['offline_over_online']:.2f}x ({worst['label']}): "
        f"{verdict(verdicts['offline_speedup'])} the >= {OFFLINE_GOAL}x goal"
    )
    anchor_rows = [r for r in rows if r["layers"] == 1 and r["seq"] == 1024]
    anchor = next((r for r in anchor_rows if r["layout"] == "bs1"), anchor_rows[0] if anchor_rows else None)
    if anchor:
        verdicts["specforge_anchor"] = anchor["online_over_anchor"] >= ANCHOR_GOAL
        note = (
            ""
            if anchor["layout"] == "bs1"
            else " (batch of tokens, not batch 1: pass --batch-size-1 for the anchor's setting)"
        )
        print(
            f"online vs SpecForge ({SPECFORGE_ANCHOR:.0f} tok/s, {SPECFORGE_RSS_GB} GB, D=1, TTT 7, len 1024, batch 1, "
            f"2 cores): {anchor['online_tps']:.0f} tok/s = {anchor['online_over_anchor']:.2f}x, peak "
            f"{anchor['peak_online_gb']:.2f} GB, {anchor['label']}{note}: {verdict(verdicts['specforge_anchor'])} the "
            f">= {ANCHOR_GOAL}x goal; the same run is {anchor['online_over_target']:.2f}x this machine's "
            f"target-forward-only rate ({anchor['target_tps']:.0f} tok/s)"
        )
    else:
        print("online vs SpecForge: no D=1, seq=1024 setting was run")
    for layout in sorted({r["layout"] for r in rows}):
        by_seq = {r["seq"]: r for r in rows if r["layers"] == 3 and r["layout"] == layout}
        if 1024 in by_seq and 2048 in by_seq:
            ratio = by_seq[2048]["peak_online_gb"] / by_seq[1024]["peak_online_gb"]
            key = f"memory_2048_vs_1024_{layout}"
            verdicts[key] = ratio < MEMORY_GOAL
            print(
                f"peak memory D=3 ({layout}), seq 2048 / seq 1024 (online): "
                f"{by_seq[2048]['peak_online_gb']:.2f} / {by_seq[1024]['peak_online_gb']:.2f} GB = {ratio:.2f}x: "
                f"{verdict(verdicts[key])} the < {MEMORY_GOAL}x goal"
            )
    if not any(k.startswith("memory") for k in verdicts):
        print("peak memory seq 2048 / 1024: needs D=3 at both lengths (--layers 3 --seq 1024,2048)")
    print("\n(wall-clock rates on a shared machine: compare the ratios, measured side by side, more than the rates)")
    if args.json:
        out = {
            "args": {k: str(v) for k, v in vars(args).items() if k != "worker"},
            "rows": rows,
            "verdicts": verdicts,
            "raw": raw,
        }
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
