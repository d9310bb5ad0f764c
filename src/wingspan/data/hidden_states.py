"""Offline features: the target runs once over the tokenized data (`wingspan dump`), and training reads what
it said from disk for as many epochs as it likes (`wingspan train --from-dump`).

A dump directory holds `manifest.json` (a `DumpManifest`: what the features depend on, and the shard plan)
and `shard-NNNNN.safetensors` files. Records are assigned to shards in data order by a token budget, so the
plan is a function of the data alone; a shard is written to a temp name and renamed, then marked done in the
manifest (also renamed into place). Resuming skips the done shards and ends byte-identical to a dump that
was never interrupted.

Each shard holds its records concatenated along the token axis (no padding): `input_ids` int32 [N],
`loss_mask` uint8 [N], `record_offsets` int64 [R + 1], `aux_hidden` bf16 [N, num_aux * H], `last_hidden`
bf16 [N, H] (the final norm's output, which the target's lm_head reads) and `target_argmax` int32 [N] (the
target's top token over its whole vocab, for the accuracy metrics). The loss's target logits over the draft
vocab are recomputed from `last_hidden` with the target's lm_head rows of that vocab: exact (the target
computes its logits the same way) and independent of the draft vocab. Storing top-k probabilities instead
would save some disk and time but bias the loss (docs/formats.md has the measurement).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from wingspan.config import TrainConfig, from_dict, read_mapping, save_json
from wingspan.data.batching import collate, plan_packed
from wingspan.data.conversations import source_sha256
from wingspan.data.template import TokenizedConversation
from wingspan.errors import ConfigError, DataError
from wingspan.files import atomic_file, inside, sha256_of

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FEATURE_DTYPE = torch.bfloat16
# Per token besides the bf16 features: input_ids (int32), loss_mask (uint8), target_argmax (int32).
TOKEN_BYTES = 4 + 1 + 4


class DumpMismatchError(ConfigError):
    """A dump made for other settings than the ones asked for (target, template, aux ids, ...)."""


@dataclass
class DataFile:
    path: str
    sha256: str


@dataclass
class DumpIdentity:
    """What the stored features depend on: a dump serves a run only when all of it agrees."""

    target: str  # the name it was loaded by; the fingerprint decides whether two targets are the same
    target_fingerprint: str
    template_fingerprint: str
    aux_layer_ids: list[int]
    target_dtype: str
    max_length: int
    data: list[DataFile]
    learn_reasoning: bool = True  # the loss masks stored; dumps from before the option learned reasoning
    learn_prompts: bool = False  # and dumps from before this one learned the replies only


@dataclass
class ShardInfo:
    file: str
    first_record: int
    num_records: int
    num_tokens: int
    done: bool = False
    # of the written file: the size is checked whenever the dump is read, the sha256 on resume
    bytes: int | None = None
    sha256: str | None = None


@dataclass
class DumpManifest:
    format_version: int
    identity: DumpIdentity
    hidden_size: int
    loss_input: Literal["last_hidden"]  # what the loss's target distribution is recomputed from
    bytes_per_token: int
    shards: list[ShardInfo] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)


# ----------------------------------------------------------------------------------------- identity


def target_fingerprint(target) -> str:
    """sha256 of the target's config and a strided sample of a few of its weights (embeddings, lm_head,
    final norm, first and last decoder layers): a fraction of a second at any size, and different for
    another checkpoint or a fine-tune. The sample is rounded to bf16 first, so that the fingerprint does not
    depend on the dtype the target was loaded in (target_dtype is compared on its own)."""
    digest = hashlib.sha256()
    config = {
        k: v
        for k, v in target.config.to_dict().items()
        if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")
    }
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    tensors = {"embed": target.embed_weight(), "lm_head": target.lm_head_weight(), "norm": target.norm_weight()}
    for which, layer in (("first", target.layers[0]), ("last", target.layers[-1])):
        tensors.update({f"{which}.{name}": p for name, p in layer.named_parameters()})
    for name, tensor in tensors.items():
        flat = tensor.detach().flatten()
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(flat[:: max(1, flat.numel() // 65536)].to(torch.bfloat16).float().cpu().numpy().tobytes())
    return digest.hexdigest()


def template_fingerprint(tokenizer) -> str:
    """sha256 of the chat template and the vocabulary: what turns conversations into the stored ids."""
    digest = hashlib.sha256()
    digest.update(json.dumps(tokenizer.chat_template, sort_keys=True).encode())
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    return digest.hexdigest()


def dump_identity(config: TrainConfig, target) -> DumpIdentity:
    """The identity a dump must have to serve `config` (with `target` loaded from it)."""
    return DumpIdentity(
        target=config.target,
        target_fingerprint=target_fingerprint(target),
        template_fingerprint=template_fingerprint(target.tokenizer),
        aux_layer_ids=list(target.aux_layer_ids),
        target_dtype=config.target_dtype,
        max_length=config.max_length,
        data=[DataFile(path, source_sha256(path)) for path in config.data],
        learn_reasoning=config.learn_reasoning,
        learn_prompts=config.learn_prompts,
    )


def require_match(where: Path, dump: DumpIdentity, wanted: DumpIdentity, compare_data: bool, remedy: str) -> None:
    """Raise DumpMismatchError naming every field where the dump differs from what the config asks for, and
    `remedy`: what the caller's user can do instead."""
    differences = []
    if dump.target_fingerprint != wanted.target_fingerprint:
        differences.append(
            f"target: dump has {dump.target!r} (fingerprint {dump.target_fingerprint[:12]}), "
            f"config has {wanted.target!r} (fingerprint {wanted.target_fingerprint[:12]})"
        )
    if dump.template_fingerprint != wanted.template_fingerprint:
        differences.append(
            f"chat template / tokenizer: dump has fingerprint {dump.template_fingerprint[:12]}, "
            f"config's target has {wanted.template_fingerprint[:12]}"
        )
    for name in ("aux_layer_ids", "target_dtype", "max_length", "learn_reasoning", "learn_prompts"):
        if getattr(dump, name) != getattr(wanted, name):
            differences.append(f"{name}: dump has {getattr(dump, name)!r}, config has {getattr(wanted, name)!r}")
    if compare_data and [d.sha256 for d in dump.data] != [d.sha256 for d in wanted.data]:
        differences.append(
            f"data: dump has {[d.path for d in dump.data]}, config has {[d.path for d in wanted.data]} "
            "(compared by sha256)"
        )
    if differences:
        raise DumpMismatchError(
            f"{where}: the dump does not match the config: " + "; ".join(differences) + f" ({remedy})"
        )


# ------------------------------------------------------------------------------------------- writer


def bytes_per_token(hidden_size: int, num_aux: int) -> int:
    """Disk bytes per stored token: aux features and last hidden state in bf16, plus ids, mask, argmax."""
    return (num_aux + 1) * hidden_size * FEATURE_DTYPE.itemsize + TOKEN_BYTES


def plan_shards(lengths: list[int], tokens_per_shard: int) -> list[ShardInfo]:
    """Consecutive records, a new shard whenever the next record would pass the budget (one at least)."""
    starts = [0]
    tokens = 0
    for index, length in enumerate(lengths):
        if index > starts[-1] and tokens + length > tokens_per_shard:
            starts.append(index)
            tokens = 0
        tokens += length
    bounds = list(zip(starts, starts[1:] + [len(lengths)]))
    return [ShardInfo(f"shard-{k:05d}.safetensors", a, b - a, sum(lengths[a:b])) for k, (a, b) in enumerate(bounds)]


def read_manifest(directory: str | Path) -> DumpManifest:
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise DataError(f"{directory}: not a hidden-state dump (no {MANIFEST}); make one with `wingspan dump`")
    data = read_mapping(path)
    if data.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: dump format {data.get('format_version')!r}, this wingspan reads {FORMAT_VERSION}")
    try:
        return from_dict(DumpManifest, data)
    except ConfigError as error:
        raise DataError(f"{path}: {error}") from None


def write_dump(
    target,
    records: list[TokenizedConversation],
    identity: DumpIdentity,
    out: str | Path,
    batch_tokens: int,
    shard_bytes: int = 512 << 20,
    resume: bool = False,
    max_shards: int | None = None,
) -> DumpManifest:
    """Run `target` over `records` and store its features in `out`; returns the manifest.

    With `resume`, an existing dump in `out` is continued (it must have the same identity: its shard plan is
    kept). `max_shards` stops after writing that many shards; a later `resume` finishes the rest.
    """
    out = Path(out)
    manifest_path = out / MANIFEST
    lengths = [len(r.input_ids) for r in records]
    if manifest_path.exists() and not resume:
        raise FileExistsError(f"{out} already holds a dump: pass --resume to continue it, or choose another --out")
    if manifest_path.exists():
        manifest = read_manifest(out)
        require_match(
            out, manifest.identity, identity, compare_data=True, remedy="dump these settings into another --out"
        )
        for shard in manifest.shards:
            problem = shard.done and shard_problem(out, shard, hashes=True)
            if problem:
                print(f"warning: {problem}: writing it again")
                shard.done = False
        # Same identity, so the same records, unless tokenization itself changed (a tokenizers upgrade).
        planned = [(s.first_record, s.num_records, s.num_tokens) for s in manifest.shards]
        same = sum(n for _, n, _ in planned) == len(records) and all(
            sum(lengths[a : a + n]) == t for a, n, t in planned
        )
        if not same:
            raise DataError(f"{out}: the data tokenizes differently from when this dump started; start a new dump")
    else:
        per_token = bytes_per_token(target.hidden_size, len(identity.aux_layer_ids))
        manifest = DumpManifest(
            FORMAT_VERSION,
            identity,
            target.hidden_size,
            "last_hidden",
            per_token,
            plan_shards(lengths, max(1, shard_bytes // per_token)),
        )
        save_json(manifest, manifest_path)
    todo = [shard for shard in manifest.shards if not shard.done][:max_shards]
    print(describe(manifest, len(records), todo))
    if not todo:
        return manifest

    _check_logits_are_lm_head(target, records[todo[0].first_record])
    done_tokens = sum(s.num_tokens for s in manifest.shards if s.done)
    progress = tqdm(
        total=manifest.num_tokens, initial=done_tokens, desc="dump", unit="tok", unit_scale=True, dynamic_ncols=True
    )
    for shard in todo:
        shard_records = records[shard.first_record : shard.first_record + shard.num_records]
        tensors = shard_tensors(target, shard_records, identity.max_length, batch_tokens, progress)
        with atomic_file(out / shard.file) as tmp:
            save_file(tensors, str(tmp))
            shard.bytes, shard.sha256 = tmp.stat().st_size, sha256_of(tmp)
        shard.done = True
        save_json(manifest, manifest_path)
    progress.close()
    return manifest


def shard_problem(directory: Path, shard: ShardInfo, hashes: bool) -> str | None:
    """What is wrong with a finished shard's file (missing, another size, with `hashes` another sha256), or None."""
    path = inside(directory, shard.file, str(directory / MANIFEST))
    if not path.is_file():
        return f"{path}: missing"
    if shard.bytes is not None and path.stat().st_size != shard.bytes:
        return f"{path}: {path.stat().st_size} bytes, {shard.bytes} when written"
    if hashes and shard.sha256 is not None and sha256_of(path) != shard.sha256:
        return f"{path}: its contents changed since it was written (sha256 differs)"
    return None


def describe(manifest: DumpManifest, num_records: int, todo: list[ShardInfo]) -> str:
    identity = manifest.identity
    tokens_todo = sum(s.num_tokens for s in todo)
    return (
        f"dump: {len(identity.aux_layer_ids)} aux layers x {manifest.hidden_size} and the last hidden state in "
        f"bf16, plus ids, mask, argmax: {manifest.bytes_per_token:,} bytes/token; {num_records:,} records, "
        f"{manifest.num_tokens:,} tokens -> {manifest.num_tokens * manifest.bytes_per_token / 1e9:.2f} GB in "
        f"{len(manifest.shards)} shards; to write now: {len(todo)} shards, {tokens_todo:,} tokens, "
        f"{tokens_todo * manifest.bytes_per_token / 1e9:.2f} GB"
    )


def _check_logits_are_lm_head(target, record: TokenizedConversation) -> None:
    """The trainer recomputes logits as lm_head(last hidden); refuse targets that post-process them
    (logit soft-capping, scaling), for which the stored hidden state would not reproduce the target."""
    ids = torch.tensor([record.input_ids])
    full = target.forward(ids).logits
    recomputed = target.model.get_output_embeddings()(target.forward(ids, return_last_hidden=True).last_hidden)
    if not torch.allclose(full.float(), recomputed.float(), rtol=1e-3, atol=1e-3):
        raise ConfigError(
            f"{target.name}: its logits are not lm_head(final hidden state) (soft-capping or "
            "scaling?), so a dump cannot reproduce them; train online instead"
        )


def shard_tensors(
    target, records: list[TokenizedConversation], row_tokens: int, batch_tokens: int, progress: tqdm
) -> dict[str, torch.Tensor]:
    """The target's features for `records`, run in packed rows of `row_tokens` (the trainer's packing,
    unshuffled: no compute on padding), stored per record."""
    lengths = [len(r.input_ids) for r in records]
    pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    aux: list[torch.Tensor | None] = [None] * len(records)
    last: list[torch.Tensor | None] = [None] * len(records)
    top: list[torch.Tensor | None] = [None] * len(records)
    for batch in plan_packed(lengths, row_tokens, batch_tokens, seed=0, epoch=0, shuffle=False):
        micro = collate(records, batch, pad_id)
        out = target.forward(
            micro.input_ids, micro.target_attention_mask(), return_last_hidden=True, position_ids=micro.positions
        )
        # The target's own lm_head, as its forward applies it; max().indices, not argmax(): the latter has no
        # fast bf16 kernel on CPU.
        argmax = target.model.get_output_embeddings()(out.last_hidden).max(dim=-1).indices
        for r, row in enumerate(batch):
            at = 0
            for index in row:
                end = at + lengths[index]
                aux[index] = out.aux_hidden[r, at:end].to(FEATURE_DTYPE).cpu()
                last[index] = out.last_hidden[r, at:end].to(FEATURE_DTYPE).cpu()
                top[index] = argmax[r, at:end].to(torch.int32).cpu()
                at = end
        progress.update(sum(lengths[i] for row in batch for i in row))
    offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    return {
        "input_ids": torch.tensor([t for r in records for t in r.input_ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for r in records for m in r.loss_mask], dtype=torch.uint8),
        "record_offsets": offsets,
        "aux_hidden": torch.cat(aux),
        "last_hidden": torch.cat(last),
        "target_argmax": torch.cat(top),
    }


# ------------------------------------------------------------------------------------------- reader


class HiddenStateDump:
    """A finished dump: its records (ids, loss mask) in memory, features read per micro-batch from the
    memory-mapped shards, so a dump larger than RAM trains as well."""

    def __init__(self, directory: str | Path, verify: bool = False) -> None:
        """`verify`: check every shard's sha256 too (its size is always checked)."""
        self.path = Path(directory)
        self.manifest = read_manifest(self.path)
        unfinished = [s.file for s in self.manifest.shards if not s.done]
        if unfinished:
            raise DataError(
                f"{self.path}: unfinished dump ({len(unfinished)} of {len(self.manifest.shards)} "
                "shards missing); continue it with `wingspan dump ... --resume`"
            )
        if verify:
            size = sum(s.bytes or 0 for s in self.manifest.shards)
            print(f"{self.path}: checking the sha256 of {len(self.manifest.shards)} shards ({size / 1e9:.2f} GB)")
        for shard in self.manifest.shards:
            problem = shard_problem(self.path, shard, hashes=verify)
            if problem:
                raise DataError(f"{problem}; `wingspan dump ... --resume` writes it again")
        self._shards = []
        for shard in self.manifest.shards:
            try:
                self._shards.append(safe_open(str(self.path / shard.file), framework="pt"))
            except SafetensorError as error:
                raise DataError(f"{self.path / shard.file}: not a readable shard ({error})") from None
        self.records: list[TokenizedConversation] = []
        self._where: list[tuple[int, int, int]] = []  # record -> (shard, first token, end token)
        for number, (info, shard) in enumerate(zip(self.manifest.shards, self._shards)):
            offsets = shard.get_tensor("record_offsets").tolist()
            ids, mask = shard.get_tensor("input_ids").tolist(), shard.get_tensor("loss_mask").tolist()
            if len(offsets) != info.num_records + 1 or len(ids) != info.num_tokens:
                raise DataError(
                    f"{self.path / info.file}: holds {len(offsets) - 1} records / {len(ids)} tokens, "
                    f"the manifest says {info.num_records} / {info.num_tokens}"
                )
            for record, (start, end) in enumerate(zip(offsets, offsets[1:])):
                source = f"{info.file} record {record}"  # the dump's path is in the config
                self.records.append(TokenizedConversation(ids[start:end], mask[start:end], source))
                self._where.append((number, start, end))

    def features(self, rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(aux_hidden [R, width, num_aux * H], last_hidden [R, width, H], target_argmax [R, width]) of `rows`
        of records laid back to back (`wingspan.data.batching.collate`'s layout), zero after them (padding is
        never counted by the loss)."""
        manifest = self.manifest
        num_aux = len(manifest.identity.aux_layer_ids)
        aux = torch.zeros(len(rows), width, num_aux * manifest.hidden_size, dtype=FEATURE_DTYPE)
        last = torch.zeros(len(rows), width, manifest.hidden_size, dtype=FEATURE_DTYPE)
        argmax = torch.zeros(len(rows), width, dtype=torch.long)
        for r, row in enumerate(rows):
            at = 0
            for index in row:
                number, start, end = self._where[index]
                shard = self._shards[number]
                span = slice(at, at + end - start)
                aux[r, span] = shard.get_slice("aux_hidden")[start:end]
                last[r, span] = shard.get_slice("last_hidden")[start:end]
                argmax[r, span] = shard.get_slice("target_argmax")[start:end]
                at = span.stop
        return aux, last, argmax
