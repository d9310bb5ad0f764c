"""Exports for serving engines, and reading them back: one registry of formats (`FORMATS`), one way to write
(`export_draft`: checked, written atomically, read back strictly and compared with the draft) and one way to
read any of them (`read_export`), which `wingspan eval` and `wingspan import` use."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import torch
from safetensors import SafetensorError, safe_open

from wingspan.config import DraftConfig
from wingspan.errors import ExportError
from wingspan.export import sglang, speculators, vllm
from wingspan.export.card import Provenance, provenance_of  # noqa: F401 (the package's API)
from wingspan.export.core import CONFIG, ExportSettings, Format, read_config_json, read_with, tensor_names, write_export
from wingspan.models.draft import CONFIG as DRAFT_CONFIG
from wingspan.models.draft import WEIGHTS, Eagle3Draft

FORMATS: dict[str, Format] = {f.name: f for f in (vllm.FORMAT, speculators.FORMAT, sglang.FORMAT)}
# Tried in this order: the speculators config is told by its own field, SGLang's from vLLM's by layer 0's name.
DETECTION_ORDER = (speculators.FORMAT, sglang.FORMAT, vllm.FORMAT)


def format_named(name: str) -> Format:
    if name not in FORMATS:
        raise ExportError(f"format {name!r}: supported: {', '.join(FORMATS)}")
    return FORMATS[name]


def detect_format(directory: str | Path) -> Format | None:
    """The format of an export directory, None when it holds none (no config.json of a known layout)."""
    directory = Path(directory)
    if not (directory / CONFIG).is_file():
        return None
    data, names = read_config_json(directory), tensor_names(directory)
    return next((f for f in DETECTION_ORDER if f.recognises(data, names)), None)


def export_draft(
    draft: Eagle3Draft,
    out_dir: str | Path,
    fmt: str = "vllm",
    settings: ExportSettings | None = None,
    provenance: Provenance | None = None,
) -> Path:
    """Write `draft` to `out_dir` in format `fmt`, with a model card (README.md) saying what `provenance` knows;
    an existing `out_dir` is replaced only if it holds an earlier export (of any format) or nothing."""
    out_dir = Path(out_dir)
    replaceable = not out_dir.exists() or detect_format(out_dir) is not None
    return write_export(format_named(fmt), draft, out_dir, settings or ExportSettings(), replaceable, provenance)


def serve_command(out_dir: str | Path, settings: ExportSettings | None = None) -> str:
    """The engine's command that serves the export in `out_dir`."""
    out_dir = Path(out_dir)
    fmt = detect_format(out_dir) or no_export(out_dir)
    return fmt.serve(export_config(out_dir), out_dir.resolve(), settings or ExportSettings())


def export_config(directory: str | Path) -> DraftConfig:
    """The DraftConfig of an export, without reading its weights."""
    fmt = detect_format(directory) or no_export(Path(directory))
    return fmt.read_config(read_config_json(Path(directory)), str(Path(directory) / CONFIG))


def read_export(directory: str | Path, embed_weight: torch.Tensor) -> Eagle3Draft:
    """Read an export of any format into an fp32 Eagle3Draft, strictly; `embed_weight` is the target's input
    embedding matrix, which no export carries."""
    directory = Path(directory)
    return read_with(detect_format(directory) or no_export(directory), directory, embed_weight)


def load_any_draft(directory: str | Path) -> Eagle3Draft:
    """A wingspan draft directory or an export, for exporting again: exports carry no embeddings and none are
    written, so an export gets placeholder ones (the logits check compares like with like)."""
    directory = Path(directory)
    if detect_format(directory) is None:
        if not (directory / DRAFT_CONFIG).is_file():
            no_export(directory)
        return Eagle3Draft.load(directory)
    config = export_config(directory)
    placeholder = torch.randn(config.vocab_size, config.hidden_size, generator=torch.Generator().manual_seed(0))
    return read_export(directory, placeholder)


def no_export(directory: Path) -> NoReturn:
    """ExportError saying why `directory` is neither a wingspan draft nor an export of a known layout."""
    what = f"neither a wingspan draft ({DRAFT_CONFIG}) nor a draft export ({', '.join(FORMATS)})"
    if not directory.is_dir():
        raise ExportError(f"{directory}: no such directory")
    if not (directory / CONFIG).is_file():
        raise ExportError(f"{directory}: {what}: it holds neither {DRAFT_CONFIG} nor {CONFIG}")
    weights = directory / WEIGHTS
    if not weights.is_file():
        raise ExportError(f"{weights}: missing; an export holds its weights there (sharded exports are not read)")
    try:
        with safe_open(str(weights), "pt"):
            pass
    except (OSError, SafetensorError) as error:
        raise ExportError(f"{weights}: not a readable safetensors file ({error})") from None
    architectures = read_config_json(directory).get("architectures")
    raise ExportError(f"{directory / CONFIG}: {what}: a config of no known layout (architectures {architectures})")
