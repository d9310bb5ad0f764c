"""The steps a run is made of, shared by the CLI commands and the quickstart: data -> vocab -> draft."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from wingspan.config import DraftConfig, TrainConfig
from wingspan.data.conversations import read_conversations
from wingspan.data.template import TokenizedConversation, tokenize_conversations
from wingspan.data.vocab import DraftVocab, build_draft_vocab
from wingspan.devices import resolve_device, use_cpu_threads
from wingspan.errors import ConfigError, DataError
from wingspan.models.target import TargetModel, TargetVocabulary
from wingspan.train.distributed import current_world, print0

if TYPE_CHECKING:
    from wingspan.data.hidden_states import DumpManifest


def load_target(config: TrainConfig) -> TargetModel:
    """The run's target on the config's device (under torchrun, each rank's own GPU); the draft trains next to it."""
    device = resolve_device(config.device)
    use_cpu_threads(device, config.num_threads)
    aux_layer_ids = config.aux_layer_ids
    if aux_layer_ids is None and config.init_from:  # the layers the starting draft was trained on
        aux_layer_ids = starting_draft(config.init_from, names=())[0].aux_layer_ids
    return TargetModel.load(
        config.target,
        dtype=config.target_dtype,
        aux_layer_ids=aux_layer_ids,
        device=device,
        chat_template=config.chat_template,
        chat_template_kwargs=config.chat_template_kwargs,
    )


def tokenized_dataset(
    paths: list[str], tokenizer, max_length: int, learn_reasoning: bool = True, learn_prompts: bool = False
) -> list[TokenizedConversation]:
    """Read and tokenize training conversations; skips are counted and printed, never silent."""
    if not paths:
        raise DataError("no training data: set `data` to one or more conversation files")
    records: list[TokenizedConversation] = []
    for path in paths:
        conversations, read_report = read_conversations(path, require_assistant=True)
        tokenized, template_report = tokenize_conversations(
            tokenizer, conversations, max_length, learn_reasoning, learn_prompts
        )
        records += tokenized
        skips = "; ".join(r.summary() for r in (read_report, template_report) if r.skipped)
        print0(
            f"{path}: {len(tokenized)} conversations, {sum(len(r.input_ids) for r in tokenized)} tokens"
            + (f"; {skips}" if skips else "")
        )
    return records


def draft_vocab(
    config: TrainConfig, target: TargetModel, records: list[TokenizedConversation]
) -> tuple[DraftVocab, bool]:
    """The vocab file named in the config, the vocab of the draft training starts from (`init_from`), or one
    built from the loss-masked tokens of the training data; and whether it was built (the run saves it)."""
    if config.init_from:
        state = starting_draft(config.init_from, names=("d2t", "t2d"))[1]
        return DraftVocab(state["d2t"], state["t2d"], coverage=float("nan")), False
    if config.vocab:
        vocab = DraftVocab.load(config.vocab)
        if vocab.target_vocab_size != target.vocab_size:
            raise DataError(
                f"{config.vocab}: built for a target vocab of {vocab.target_vocab_size}, "
                f"but {config.target} has {target.vocab_size}"
            )
        return vocab, False
    return build_vocab(target, records, config.draft_vocab_size), True


def starting_draft(directory: str, names: tuple[str, ...] | None = None) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """The config and weights (only `names`, when given: () reads none) of an `init_from` draft directory."""
    from safetensors import safe_open

    from wingspan.config import load
    from wingspan.models.draft import CONFIG, WEIGHTS

    path = Path(directory)
    if not (path / CONFIG).is_file():
        raise ConfigError(f"init_from: {path} is not a wingspan draft directory (no {CONFIG}; `wingspan import` one)")
    config = load(DraftConfig, path / CONFIG)
    with safe_open(str(path / WEIGHTS), "pt") as weights:
        return config, {name: weights.get_tensor(name) for name in (weights.keys() if names is None else names)}


def build_vocab(
    target: TargetModel | TargetVocabulary, records: list[TokenizedConversation], size: int, path: Path | None = None
) -> DraftVocab:
    """The `size` most frequent loss-masked tokens (end-of-turn ids always in), saved to `path` when given; the
    target's weights are not needed (a `TargetVocabulary` will do)."""
    if size > target.vocab_size:
        raise ConfigError(
            f"draft_vocab_size: must be <= the target's vocab ({target.vocab_size}), got {size}; "
            f"{target.vocab_size} is the whole vocab"
        )
    vocab = build_draft_vocab(records, target.vocab_size, size, always_include=target.eos_token_ids)
    if path is not None and current_world().is_main:  # under torchrun every rank builds the same vocab; one writes it
        vocab.save(path)
    where = f" -> {path}" if path is not None else ""
    print0(f"draft vocab: {vocab.draft_vocab_size} tokens cover {vocab.coverage:.1%} of the tokens in the loss{where}")
    return vocab


def run_training(
    config: TrainConfig,
    resume: bool | Literal["if-any"] = False,
    target: TargetModel | None = None,
    pace: Callable[[int, int], int | None] | None = None,
) -> Path:
    """Load the target (unless given) and the data, build the vocab, train (`pace`: see `train`); returns the
    final draft's directory.

    With `config.from_dump` the records and the target's features come from that dump; the target is still
    loaded (draft shape, frozen embeddings, lm_head rows) but never run.
    """
    from wingspan.data.hidden_states import HiddenStateDump, dump_identity, require_match
    from wingspan.train.checkpoint import checkpoint_directories
    from wingspan.train.features import DumpFeatures
    from wingspan.train.trainer import train

    target = target or load_target(config)
    if config.from_dump:
        # A resumed run checks every shard's sha256, a fresh one their sizes (hashing a large dump takes minutes).
        resuming = bool(resume) and bool(checkpoint_directories(Path(config.output_dir)))
        dump = HiddenStateDump(config.from_dump, verify=resuming)
        require_match(
            dump.path,
            dump.manifest.identity,
            dump_identity(config, target),
            compare_data=bool(config.data),
            remedy="dump these settings with `wingspan dump`, or train online with from_dump=null",
        )
        vocab, built = draft_vocab(config, target, dump.records)
        print0(f"{dump.path}: {len(dump.records)} conversations, {dump.manifest.num_tokens} tokens (dumped features)")
        features = DumpFeatures(dump, target, vocab.d2t)
        return train(
            config,
            target,
            dump.records,
            vocab.d2t,
            vocab.t2d,
            resume=resume,
            features=features,
            built_vocab=vocab if built else None,
            pace=pace,
        )
    records = tokenized_dataset(
        config.data, target.tokenizer, config.max_length, config.learn_reasoning, config.learn_prompts
    )
    vocab, built = draft_vocab(config, target, records)
    # online: the target runs each batch
    built_vocab = vocab if built else None
    return train(config, target, records, vocab.d2t, vocab.t2d, resume=resume, built_vocab=built_vocab, pace=pace)


def run_dump(
    config: TrainConfig,
    out: Path,
    resume: bool = False,
    shard_bytes: int = 512 << 20,
    max_shards: int | None = None,
    target: TargetModel | None = None,
) -> DumpManifest:
    """Tokenize the config's data and store the target's features for it in `out` (see data/hidden_states.py);
    the target is loaded from the config unless given."""
    from wingspan.data.hidden_states import dump_identity, write_dump

    target = target or load_target(config)
    records = tokenized_dataset(
        config.data, target.tokenizer, config.max_length, config.learn_reasoning, config.learn_prompts
    )
    return write_dump(
        target,
        records,
        dump_identity(config, target),
        out,
        batch_tokens=config.batch_tokens,
        shard_bytes=shard_bytes,
        resume=resume,
        max_shards=max_shards,
    )
