"""The target model: a transformers causal LM that yields EAGLE-3 aux hidden states and generates text.

Aux id k is the *input* of decoder layer k (= `hidden_states[k]` with output_hidden_states=True, index 0
being the embedding output), the vLLM convention. They are captured with forward pre-hooks on the decoder
layers rather than output_hidden_states, which would keep all N+1 states alive at once.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from wingspan.data.batching import block_causal_mask, is_packed
from wingspan.data.template import end_of_turn_id, set_chat_template
from wingspan.devices import announce, resolve_device, start_vector_math
from wingspan.dtypes import slow_dtype_warning, torch_dtype
from wingspan.errors import ConfigError, ModelError
from wingspan.models.families import family_of, sliding_window
from wingspan.models.registry import resolve_target


@dataclass
class Generation:
    tokens: list[int]  # the new tokens, without the stop token
    stopped: bool  # ended on a stop token (False: hit max_new_tokens)


@dataclass
class TargetOutput:
    aux_hidden: torch.Tensor  # [B, T, len(aux_layer_ids) * H], in aux_layer_ids order
    logits: torch.Tensor | None = None  # [B, T, V]; None when last_hidden was asked for instead
    last_hidden: torch.Tensor | None = None  # [B, T, H], after the final norm (the lm_head's input)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, generation_config: GenerationConfig) -> list[int]:
    """Every id that ends an assistant turn: tokenizer eos, generation_config eos(es), end-of-turn token."""
    ids = [tokenizer.eos_token_id]
    eos = generation_config.eos_token_id
    ids += eos if isinstance(eos, list) else [eos]
    if tokenizer.chat_template:
        ids.append(end_of_turn_id(tokenizer, "assistant"))
    return sorted({i for i in ids if i is not None})


@dataclass
class TargetVocabulary:
    """What a target's text side needs without its weights (`wingspan vocab`): the tokenizer, the width of
    the logits and the stop tokens, equal to a loaded `TargetModel`'s."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    vocab_size: int
    eos_token_ids: list[int]

    @classmethod
    def load(
        cls,
        name_or_path: str,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        trust_remote_code: bool = False,
    ) -> TargetVocabulary:
        path = resolve_target(name_or_path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except OSError as error:
            raise OSError(f"cannot load the tokenizer of target {name_or_path!r} from {path}: {error}") from None
        set_chat_template(tokenizer, chat_template, chat_template_kwargs)
        try:  # from_pretrained of the model reads generation_config.json, else derives it from the config
            generation = GenerationConfig.from_pretrained(path)
        except OSError:
            generation = GenerationConfig.from_model_config(config)
        vocab_size = config.get_text_config().vocab_size
        return cls(name_or_path, tokenizer, vocab_size, stop_token_ids(tokenizer, generation))


def default_aux_layer_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The decoder layer list: `.layers` of the base model for llama/qwen2/mistral/gemma-style models,
    else the one ModuleList with num_hidden_layers entries."""
    layers = getattr(model.get_decoder(), "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
        return layers
    candidates = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers]
    if len(candidates) != 1:
        raise ModelError(f"cannot find the {num_layers} decoder layers of {type(model).__name__}")
    return candidates[0]


class TargetModel:
    """A frozen causal LM with its tokenizer: aux hidden states and logits for training, text for data.

    Build it with `TargetModel.load`; the constructor wraps an already loaded model (tests, tools).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        name: str,
        aux_layer_ids: list[int] | None = None,
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.family = family_of(model.config, name)
        self.config = model.config.get_text_config()
        self.sliding_window = sliding_window(self.config)
        self.layers = decoder_layers(model, self.num_layers)
        ids = default_aux_layer_ids(self.num_layers) if aux_layer_ids is None else list(aux_layer_ids)
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < self.num_layers]
        if not ids or bad:
            raise ConfigError(
                f"aux_layer_ids {ids}: each id must be a decoder layer index in 0..{self.num_layers - 1} "
                f"({name} has {self.num_layers} layers; id k is the input of layer k)"
            )
        self.aux_layer_ids = ids
        self.eos_token_ids = stop_token_ids(tokenizer, model.generation_config)

    @classmethod
    def load(
        cls,
        name_or_path: str,
        dtype: str | torch.dtype = "bfloat16",
        aux_layer_ids: list[int] | None = None,
        trust_remote_code: bool = False,
        device: str | torch.device = "auto",
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> TargetModel:
        """Load an embedded name (see `wingspan models list`), a checkpoint directory or a hub id, onto `device`
        (a setting as `wingspan.devices` reads it, or a torch device), and say where and in which dtype. A chat
        template file and template variables replace or amend the tokenizer's (`set_chat_template`)."""
        if isinstance(dtype, str):
            dtype = torch_dtype(dtype)
        if isinstance(device, str):
            device = resolve_device(device)
        start_vector_math()
        path = resolve_target(name_or_path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
        except OSError as error:
            where = path if Path(path).is_dir() else "the Hugging Face hub (this needs network access)"
            raise OSError(f"cannot load target {name_or_path!r} from {where}: {error}") from None
        set_chat_template(tokenizer, chat_template, chat_template_kwargs)
        announce(f"target {name_or_path}", device, dtype)
        warning = slow_dtype_warning(dtype, device)
        if warning:
            print(warning, file=sys.stderr)
        return cls(model.to(device), tokenizer, name_or_path, aux_layer_ids)

    # ---------------------------------------------------------------------------------------- shape

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        """The width of the logits (can exceed len(tokenizer): embedding tables are often padded)."""
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ------------------------------------------------------------------------------------ weights

    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    def norm_weight(self) -> torch.Tensor:
        """The final norm's scale as a Llama RMSNorm weight (`x * w`): the draft's norm starts from it, matching
        the lm_head rows' input scale. Gemma stores w - 1 (its norm computes `x * (1 + w)`)."""
        return self.model.get_decoder().norm.weight + self.family.norm_offset

    # ------------------------------------------------------------------------------------ forward

    @contextmanager
    def capture_aux(self) -> Iterator[dict[int, torch.Tensor]]:
        """Record the input of each aux layer during any forward run inside the block (cached ones too)."""
        captured: dict[int, torch.Tensor] = {}

        def hook(layer_id: int):
            def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
                captured[layer_id] = args[0] if args else kwargs["hidden_states"]

            return record

        handles = [self.layers[i].register_forward_pre_hook(hook(i), with_kwargs=True) for i in set(self.aux_layer_ids)]
        try:
            yield captured
        finally:
            for handle in handles:
                handle.remove()

    def aux_features(self, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        """What `capture_aux` recorded, as the draft reads it: the aux layers' inputs concatenated in
        aux_layer_ids order, [B, T, num_aux * H]."""
        return torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)

    def model_mask(
        self, mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """A bool [B, 1, Q, K] mask (True = may attend) as this model's attention takes it, given the positions
        of the queries [B, Q] and keys [B, K]. A ready-made mask replaces the model's own, so the sliding window
        of the layers that have one is applied here (a key at most window - 1 positions back): families with
        per-layer types take one mask per type, the others one mask, windowed when all their layers slide."""
        windowed = mask
        if self.sliding_window is not None:
            back = query_positions.to(mask.device)[:, None, :, None] - key_positions.to(mask.device)[:, None, None, :]
            windowed = mask & (back < self.sliding_window)
        if getattr(self.config, "layer_types", None) is not None:
            return {"full_attention": self._attention_form(mask), "sliding_attention": self._attention_form(windowed)}
        return self._attention_form(windowed)

    def _attention_form(self, mask: torch.Tensor) -> torch.Tensor:
        """SDPA takes the bool mask itself, eager attention an additive one (0 / -inf: it adds it to the scores)."""
        if getattr(self.model.config, "_attn_implementation", "sdpa") == "sdpa":
            return mask
        additive = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device)
        return additive.masked_fill(~mask, torch.finfo(self.dtype).min)

    def packed_attention(self, positions: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """The attention mask of rows holding several conversations (positions restarting at 0): block-causal,
        with the sliding windows inside each block (`model_mask`)."""
        positions = positions.to(self.device)
        return self.model_mask(block_causal_mask(positions), positions, positions)

    @torch.no_grad()  # not inference_mode: the outputs feed the draft's autograd graph
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        return_last_hidden: bool = False,
        position_ids: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Aux hidden states plus logits, or plus the final hidden state (skipping the lm_head).

        attention_mask: [B, T] (1 on real tokens, the model adds causality). Rows of several conversations
        (packed) pass None and `position_ids` [B, T] that restart at 0 at each conversation: the mask is then
        `packed_attention`, not left to the model (not every family reads conversations off the positions).
        """
        input_ids = input_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        elif position_ids is not None and is_packed(position_ids):
            attention_mask = self.packed_attention(position_ids)
        position_ids = None if position_ids is None else position_ids.to(self.device)
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        with self.capture_aux() as captured:
            out = (self.model.get_decoder() if return_last_hidden else self.model)(**inputs)
        aux = self.aux_features(captured)
        if return_last_hidden:
            return TargetOutput(aux_hidden=aux, last_hidden=out.last_hidden_state)
        return TargetOutput(aux_hidden=aux, logits=out.logits)

    # --------------------------------------------------------------------------------- generation

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        stop_ids: list[int] | None = None,
        seed: int | None = None,
    ) -> list[Generation]:
        """Continue each prompt (token ids) in one batch; greedy when temperature == 0. Rows that are done
        leave the batch (`plain_generate_batch`), so a batch costs what its live rows cost.

        With a `seed`, sampling draws from a generator of its own seeded with it (the global RNG is left as it
        was), so a batch is reproducible on its own, which is what resumable data generation needs.
        """
        from wingspan.decode.batched import plain_generate_batch

        generator = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
        results = plain_generate_batch(
            self, prompts, max_new_tokens, stop_ids, temperature=temperature, generator=generator
        )
        return [Generation(result.tokens, result.stopped) for result in results]
