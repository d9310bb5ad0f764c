"""What a layer-scaling study is (StudyConfig), the points of its grid (Setting) and what each measured
(SettingResult): the types that running the study (`layers`) and reporting it (`report`) share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wingspan.config import TrainConfig, from_dict
from wingspan.errors import ConfigError
from wingspan.eval.runner import EvalSettings

INJECTIONS = ("first", "all")
# How a setting's draft drafts (`draft_mode`), and the decoders that measure it: a chain draft with the chain
# and the tree decoder, a parallel draft with its own (the chain's K drafts from one forward).
DECODERS_OF_MODE = {"chain": ("chain", "tree"), "parallel": ("parallel",)}
# Fields the study sets per setting; a shared training config must leave them to it.
PER_SETTING_FIELDS = (
    "data",
    "from_dump",
    "vocab",
    "output_dir",
    "num_hidden_layers",
    "embed_injection",
    "draft_mode",
    "num_parallel_tokens",
    "epochs",
    "max_steps",
    "target",
)
# A re-run may extend these; everything else must equal the saved study.json.
EXTENSIBLE_FIELDS = ("layers", "injection", "modes", "sets")


@dataclass
class StudyConfig:
    """Everything that defines a study; saved as study.json in its directory."""

    data: list[str]  # training conversations (target-regenerated)
    budget_tokens: int  # training tokens per setting (all tokens of the conversations seen, prompts too)
    target: str = "smollm2-135m-instruct"
    layers: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6])
    injection: list[str] = field(default_factory=lambda: ["first", "all"])
    # chain drafts, and/or parallel ones drafting num_draft_tokens per forward (their settings are named P-...)
    modes: list[str] = field(default_factory=lambda: ["chain"])
    sets: list[str] = field(default_factory=lambda: ["mt_bench", "gsm8k", "humaneval"])  # `wingspan eval --sets`
    limit: int | None = 10  # prompts per set
    first_turn_only: bool = True  # the reference figures are first turns
    num_draft_tokens: int = 3  # the chain decoder
    tree: list[int] = field(default_factory=lambda: [4, 4, 16])  # the tree decoder: depth, top-k, total tokens
    max_new_tokens: int = 256
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields shared by every setting
    # a `wingspan replay references` file: every setting is scored on its replies (chain and parallel drafts,
    # exactly; no tree, no speed) in place of decoding `sets`, and its sets are the study's
    references: str | None = None

    def __post_init__(self) -> None:
        if not self.data:
            raise ConfigError("data: at least one conversation file is needed")
        if self.budget_tokens < 1:
            raise ConfigError(f"budget_tokens: must be >= 1, got {self.budget_tokens}")
        if not self.layers or min(self.layers) < 1 or len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"layers: distinct depths >= 1 expected, got {self.layers}")
        if (
            not self.injection
            or not set(self.injection) <= set(INJECTIONS)
            or len(set(self.injection)) != len(self.injection)
        ):
            raise ConfigError(f"injection: distinct values among {list(INJECTIONS)} expected, got {self.injection}")
        if not self.modes or not set(self.modes) <= set(DECODERS_OF_MODE) or len(set(self.modes)) != len(self.modes):
            raise ConfigError(f"modes: distinct values among {list(DECODERS_OF_MODE)} expected, got {self.modes}")
        if "parallel" in self.modes and self.num_draft_tokens < 2:
            raise ConfigError("num_draft_tokens: a parallel draft drafts at least 2 tokens per forward, got 1")
        if not self.sets:
            raise ConfigError("sets: at least one prompt set is needed")
        if len(self.tree) != 3:
            raise ConfigError(f"tree: expected [depth, top_k, total_tokens], got {self.tree}")
        taken = sorted(set(self.train) & set(PER_SETTING_FIELDS))
        if taken:
            raise ConfigError(f"train: {taken} are set by the study itself for each setting; remove them")
        self.base_train_config()  # invalid training fields fail here, before any run
        for decoder in self.decoders():
            self.eval_settings(decoder)

    def base_train_config(self) -> TrainConfig:
        return from_dict(TrainConfig, {"target": self.target, "data": self.data, **self.train}, where="train")

    def decoders(self) -> list[str]:
        """The decoders that measure the study's settings (replayed references measure no tree)."""
        return [
            decoder
            for mode in self.modes
            for decoder in DECODERS_OF_MODE[mode]
            if not (self.references and decoder == "tree")
        ]

    def eval_settings(self, decoder: str) -> EvalSettings:
        tree = dict(zip(("tree_depth", "tree_top_k", "tree_total_tokens"), self.tree)) if decoder == "tree" else {}
        try:
            return EvalSettings(
                num_draft_tokens=self.num_draft_tokens,
                max_new_tokens=self.max_new_tokens,
                limit=self.limit,
                first_turns=self.first_turn_only,
                **tree,
            )
        except ConfigError as error:
            raise ConfigError(f"{decoder} decoder: {error}") from None

    def settings(self) -> list[Setting]:
        grid = []
        for mode in self.modes:
            prefix = "P-" if mode == "parallel" else ""
            for depth in sorted(self.layers):
                if depth == 1:
                    grid.append(Setting(f"{prefix}D1", 1, "first", mode))
                    continue
                grid += [Setting(f"{prefix}D{depth}-{inject}", depth, inject, mode) for inject in self.injection]
        return grid


@dataclass(frozen=True)
class Setting:
    name: str
    layers: int
    injection: str
    mode: str = "chain"

    def in_series(self, injection: str) -> bool:
        return self.injection == injection or self.layers == 1

    @property
    def decoders(self) -> tuple[str, ...]:
        return DECODERS_OF_MODE[self.mode]


@dataclass
class SettingResult:
    """One setting's row of the study: its training outcome and every decoder's result per prompt set."""

    name: str
    layers: int
    injection: str
    parameters: int  # trained parameters (the frozen target embeddings not counted)
    train_tokens_per_s: float  # mean over the logged windows (non-pad tokens)
    train_final: dict[str, float]  # the last logged metrics: loss_j, acc_j, sim_accept_len
    # decoder -> set -> SetResult fields without the per-prompt rows
    eval: dict[str, dict[str, dict[str, Any]]]
    # decoder -> draft seconds per drafted token / target seconds per plain-decoded token, over all sets
    draft_cost: dict[str, float | None]
    # decoder -> set -> (prompt id, rounds, accepted drafts) per prompt: what the bootstrap intervals resample
    prompts: dict[str, dict[str, list[tuple[str, int, int]]]]
    mode: str = "chain"

    @property
    def setting(self) -> Setting:
        return Setting(self.name, self.layers, self.injection, self.mode)
