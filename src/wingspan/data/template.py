"""Render conversations with the tokenizer's own chat template and mask the tokens the draft learns from.

The loss mask covers each assistant message's content plus the end-of-turn marker the template writes right
after it (`<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3), so the draft also learns to predict the end of
a turn. Role headers, system and user text, and the newline after the marker are not masked.

How the assistant text is found, for any template (no `{% generation %}` markers needed): the conversation is
rendered once with each message's content replaced by a unique sentinel. The text between sentinels is what
the template itself writes (headers, default system prompts, separators), and the sentinels' order is the
order the template renders the messages in. The real rendering is then read as that skeleton with the real
contents slotted in, which gives every content's character span exactly, even when the template trims
content (Llama 3), injects a default system prompt (Qwen2, SmolLM2), or moves the system prompt (Mistral),
and without rendering every prefix of the conversation. Character spans become token masks through the fast
tokenizer's offset mapping: a token is masked when any of its characters is, so one that joins template text
and reply (" Bonjour" after Mistral's "[/INST]") is learned. The ids are exactly those of
`apply_chat_template(conversation, tokenize=True)`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from jinja2 import TemplateError, TemplateSyntaxError
from transformers import PreTrainedTokenizerBase

from wingspan.data.conversations import Conversation, SkipReport
from wingspan.errors import ConfigError, DataError, ModelError

# A stand-in for message contents, to see what the template writes around them. Private-use characters: no
# template rewrites them and no tokenizer merges them with their neighbours.
_SENTINEL = "\ue000wingspan{}\ue000"
_BATCH = 256  # conversations tokenized per call: the Rust tokenizer parallelises within a batch
_REASONING = re.compile(r"<think>.*?</think>\s*", re.DOTALL)  # Qwen3, DeepSeek-R1 and gpt-oss-style distills


@dataclass
class TokenizedConversation:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is assistant content or its end-of-turn marker
    source: str = field(
        default="", compare=False
    )  # where it was read ("path:line", a dump's shard and record), for messages


class TemplateAlignmentError(DataError):
    """The rendered conversation could not be matched to its messages (the template rewrites contents)."""


def set_chat_template(
    tokenizer: PreTrainedTokenizerBase, template_file: str | None = None, variables: dict[str, Any] | None = None
) -> None:
    """Give `tokenizer` the chat template in `template_file` (for a target that ships none, a base model, or to
    replace its own), and fix template `variables` (Qwen3's enable_thinking) in it: every rendering (training,
    dumps, data generation, evaluation) then sees them, and a dump's template fingerprint covers them."""
    if template_file is not None:
        try:
            tokenizer.chat_template = Path(template_file).read_text()
        except OSError as error:
            raise ConfigError(f"chat_template: cannot read {template_file} ({error.strerror})") from None
    if variables:
        require_chat_template(tokenizer)
        bad = [name for name in variables if not name.isidentifier()]
        if bad:
            raise ConfigError(f"chat_template_kwargs: {bad} are not template variable names")
        # A `set` at the top of a Jinja template shadows the variable passed to render(), in the whole template.
        header = "".join(f"{{% set {name} = {_jinja_literal(value)} %}}" for name, value in variables.items())
        tokenizer.chat_template = header + tokenizer.chat_template


def _jinja_literal(value: Any) -> str:
    return "none" if value is None else json.dumps(value)


def require_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """A ModelError for a tokenizer without a chat template, saying how to give one."""
    if not tokenizer.chat_template:
        raise ModelError(
            f"{tokenizer.name_or_path}: the tokenizer has no chat template (a base model?); give one as a Jinja "
            "file: chat_template=PATH in the run config, --chat-template PATH on the command line"
        )


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` rendered with the chat template, ready for the assistant to answer."""
    require_chat_template(tokenizer)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The template writes any BOS itself; the tokenizer must not add another.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def user_turn_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Everything the chat template writes before a first user message's content (default system prompt,
    role header)."""
    require_chat_template(tokenizer)
    sentinel = _SENTINEL.format(0)
    text = tokenizer.apply_chat_template([{"role": "user", "content": sentinel}], tokenize=False)
    if sentinel not in text:
        raise ModelError(f"{tokenizer.name_or_path}: the chat template does not render the user message's content")
    return tokenizer(text[: text.index(sentinel)], add_special_tokens=False)["input_ids"]


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase, role: str) -> int | None:
    """The special token the chat template writes right after a `role` message's content, if any
    (<|im_end|> for ChatML, <|eot_id|> for Llama 3, [/INST] after a Mistral user turn)."""
    sentinel = _SENTINEL.format(0)
    messages = [{"role": "user", "content": sentinel}]
    if role == "assistant":
        messages.append({"role": "assistant", "content": sentinel})
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except TemplateError:  # a template that rejects this minimal conversation says nothing about its turns
        return None
    if sentinel not in text:
        return None
    after = text[text.rindex(sentinel) + len(sentinel) :].lstrip()  # Mistral: "... [/INST]"
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    return ids[0] if ids and ids[0] in special_ids(tokenizer) else None


def special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Named special tokens (bos, eos, ...) and added tokens marked special (<|im_start|>, ...)."""
    added = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return set(tokenizer.all_special_ids) | added


def render_with_spans(
    tokenizer: PreTrainedTokenizerBase, conversation: Conversation, end_of_turn_markers: list[str] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """Render `conversation` with the tokenizer's chat template; return the text and the character spans to learn.

    Each span runs from the start of an assistant message's (rendered) content to the end of the end-of-turn
    marker that follows it: the first of `end_of_turn_markers` (default: the tokenizer's added tokens) that
    starts the template text after the content, after any whitespace. A message the template leaves out (Mistral
    drops the system prompt unless the last turn is the user's) simply has no span.
    """
    markers = _added_tokens(tokenizer) if end_of_turn_markers is None else end_of_turn_markers
    messages = conversation.as_dicts()
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    sentinels = [_SENTINEL.format(i) for i in range(len(messages))]
    skeleton = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": s} for m, s in zip(messages, sentinels)], tokenize=False
    )
    order, segments = _template_segments(skeleton, sentinels, conversation.source)
    contents = _content_spans(text, segments, [messages[i]["content"] for i in order], conversation.source)
    spans = []
    for k, (start, end) in enumerate(contents):
        if messages[order[k]]["role"] == "assistant":
            spans.append((start, end + _end_of_turn_length(segments[k + 1], markers)))
    return text, spans


def _template_segments(skeleton: str, sentinels: list[str], source: str) -> tuple[list[int], list[str]]:
    """The messages in the order the template renders them (it may move or drop some: the system prompt in
    Mistral's template goes into the last user turn), and the pieces of template text around them."""
    found = []
    for i, sentinel in enumerate(sentinels):
        at = skeleton.find(sentinel)
        if at >= 0 and skeleton.find(sentinel, at + len(sentinel)) >= 0:
            raise TemplateAlignmentError(f"{source}: the chat template renders message {i} more than once")
        if at >= 0:
            found.append((at, i))
    found.sort()
    segments, cursor = [], 0
    for at, i in found:
        segments.append(skeleton[cursor:at])
        cursor = at + len(sentinels[i])
    segments.append(skeleton[cursor:])
    return [i for _, i in found], segments


def _content_spans(text: str, segments: list[str], contents: list[str], source: str) -> list[tuple[int, int]]:
    """Read `text` as segments[0] c0 segments[1] c1 ... segments[n]; return each content's (start, end)."""
    if not text.startswith(segments[0]):
        raise TemplateAlignmentError(f"{source}: the chat template's opening depends on the message contents")
    spans, cursor = [], len(segments[0])
    for i, content in enumerate(contents):
        after, is_last = segments[i + 1], i == len(contents) - 1
        # The template may write the content as is or trimmed (Llama 3); otherwise it rewrote it (e.g. removed
        # reasoning), and the rendered content is whatever lies before the next piece of template text.
        for candidate in (content, content.strip()):
            end = cursor + len(candidate)
            if text.startswith(candidate + after, cursor) and (not is_last or end + len(after) == len(text)):
                break
        else:
            if is_last:
                end = len(text) - len(after) if text.endswith(after) else -1
            else:
                end = text.find(after, cursor) if after else -1
            if end < cursor:
                raise TemplateAlignmentError(f"{source}: cannot find message {i} in the rendered chat template")
        spans.append((cursor, end))
        cursor = end + len(after)
    return spans


def _added_tokens(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Added tokens (special or not), longest first so that a marker's prefix never wins."""
    return sorted({t.content for t in tokenizer.added_tokens_decoder.values()}, key=len, reverse=True)


def _end_of_turn_length(after: str, markers: list[str]) -> int:
    """Characters of `after` (template text after a reply) up to the end of its end-of-turn marker; 0 if none."""
    stripped = after.lstrip()
    for marker in markers:
        if stripped.startswith(marker):
            return len(after) - len(stripped) + len(marker)
    return 0


def _token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]], text_length: int) -> list[int]:
    """1 for every token whose characters overlap a span (a token may straddle the template/content border)."""
    chars = np.zeros(text_length, dtype=np.int64)
    for start, end in spans:
        chars[start:end] = 1
    covered = np.concatenate([[0], np.cumsum(chars)])
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    return ((covered[bounds[:, 1]] - covered[bounds[:, 0]]) > 0).astype(np.int64).tolist()


def without_reasoning(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`spans` less the reasoning blocks inside them (`<think>...</think>` and the whitespace after it)."""
    kept = []
    for start, end in spans:
        cursor = start
        for block in _REASONING.finditer(text, start, end):
            if block.start() > cursor:
                kept.append((cursor, block.start()))
            cursor = block.end()
        if cursor < end:
            kept.append((cursor, end))
    return kept


def tokenize_conversations(
    tokenizer: PreTrainedTokenizerBase,
    conversations: list[Conversation],
    max_length: int,
    learn_reasoning: bool = True,
    learn_prompts: bool = False,
) -> tuple[list[TokenizedConversation], SkipReport]:
    """Tokenize many conversations (batched through the Rust tokenizer); drop those with nothing to learn.
    The loss mask covers the replies; with `learn_prompts` the whole rendered text (every turn and the
    template's own tokens). With `learn_reasoning` False reasoning blocks are left out of it (`without_reasoning`).

    Skipped and counted: a conversation the template rejects (e.g. roles that do not alternate), one the
    template rewrites beyond recognition, and one with no masked token within max_length. Nothing left is a
    DataError; a template that does not parse raises at once.
    """
    require_chat_template(tokenizer)
    if not tokenizer.is_fast:
        raise ModelError("the loss mask needs a fast tokenizer (character offsets); load it with use_fast=True")
    markers = _added_tokens(tokenizer)  # once: some tokenizers have thousands of added tokens
    report = SkipReport(total=len(conversations))
    records: list[TokenizedConversation] = []
    for first in range(0, len(conversations), _BATCH):
        rendered = []
        for conversation in conversations[first : first + _BATCH]:
            try:
                rendered.append((conversation, *render_with_spans(tokenizer, conversation, markers)))
            except TemplateAlignmentError as error:
                report.add("template rewrites contents", str(error))
            except TemplateSyntaxError as error:  # a broken template, not a bad conversation
                raise ModelError(f"{tokenizer.name_or_path}: the chat template does not parse: {error}") from None
            except TemplateError as error:  # the template's own raise_exception(), e.g. roles must alternate
                report.add("chat template error", f"{conversation.source}: {error}")
        if not rendered:
            continue
        encodings = tokenizer([text for _, text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
        batch = zip(rendered, encodings["input_ids"], encodings["offset_mapping"])
        for (conversation, text, spans), ids, offsets in batch:
            if learn_prompts:
                spans = [(0, len(text))]
            if not learn_reasoning:
                spans = without_reasoning(text, spans)
            mask = _token_mask(offsets, spans, len(text))[:max_length]
            if not any(mask):
                report.add("no assistant token", f"{conversation.source}: no assistant token in the first {max_length}")
                continue
            records.append(TokenizedConversation(ids[:max_length], mask, conversation.source))
    if not records:
        raise DataError(f"no conversation has an assistant token to train on; {report.summary()}")
    return records, report
