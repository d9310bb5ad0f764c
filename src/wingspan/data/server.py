"""Regeneration at scale: the target's replies from an OpenAI-compatible server (vLLM, SGLang) instead of
in-process transformers, for targets and datasets too big for `wingspan.data.synth.regenerate`.

The job is the same: every user turn is kept, every assistant turn is replaced by the target's reply to
the conversation so far (its own earlier replies included), a conversation whose next prompt no longer fits
the server's context ends with its previous reply. The server applies the target's chat template. Up to
`concurrency` conversations are in flight; each finished one is appended to the output in input order, so
the file is the same whatever the timing, and a run resumes from it by conversation id.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from wingspan.config import require_range
from wingspan.data.conversations import (
    Conversation,
    Regeneration,
    RegenerationReport,
    append_conversations_jsonl,
    start_output,
)
from wingspan.errors import ConfigError, ServerError

RETRIES = 4  # connection errors and 5xx: the server may be restarting or overloaded
# What vLLM and SGLang say when the prompt plus max_tokens exceeds the context (HTTP 400).
CONTEXT_ERRORS = ("maximum context length", "context length", "too long", "max_model_len")


class ChatServer:
    """A minimal OpenAI-compatible chat client (standard library only)."""

    def __init__(self, url: str, model: str | None = None, timeout: float = 600.0) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ConfigError(f"--server {url!r}: expected an http:// or https:// URL, e.g. http://localhost:8000")
        self.url = url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        self.timeout = timeout
        self.model = model or self._only_model()

    def _request(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        for attempt in range(RETRIES + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    body = response.read()
                try:
                    return json.loads(body)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise ServerError(f"{self.url}{path}: the reply is not JSON: {body[:200]!r}") from None
            except urllib.error.HTTPError as error:
                detail = error.read().decode(errors="replace")
                if error.code < 500 or attempt == RETRIES:
                    raise ServerError(f"{self.url}{path}: HTTP {error.code}: {detail[:2000]}") from None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
                if attempt == RETRIES:
                    raise ServerError(f"{self.url}{path}: {error}") from None
            time.sleep(2**attempt)
        raise AssertionError("unreachable")

    def _only_model(self) -> str:
        reply = self._request("/models")
        try:
            models = [m["id"] for m in reply["data"]]
        except (KeyError, TypeError):
            raise ServerError(f"{self.url}/models: not a model list: {json.dumps(reply)[:300]}") from None
        if len(models) != 1:
            raise ServerError(f"{self.url} serves {models}: pass --model to choose one")
        return models[0]

    def reply(self, messages: list[dict[str, str]], max_tokens: int, temperature: float, seed: int) -> str | None:
        """The assistant's reply to `messages`; None when they no longer fit the server's context.
        `ReplyCut` when the reply was cut by max_tokens before it had any content (a reasoning model still
        thinking); ServerError for anything else that is not a reply."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
        }
        try:
            reply = self._request("/chat/completions", body)
        except ServerError as error:
            if "HTTP 400" in str(error) and any(phrase in str(error).lower() for phrase in CONTEXT_ERRORS):
                return None
            raise
        try:
            choice = reply["choices"][0]
            content = choice["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise ServerError(
                f"{self.url}/chat/completions: not a chat completion: {json.dumps(reply)[:300]}"
            ) from None
        if content is None and choice.get("finish_reason") == "length":
            raise ReplyCut()
        if not isinstance(content, str):
            raise ServerError(
                f"{self.url}/chat/completions: a reply without text content (finish_reason "
                f"{choice.get('finish_reason')!r}): {json.dumps(choice)[:300]}"
            )
        return content


class ReplyCut(Exception):
    """A reply that max_tokens cut before it had any content."""

    reason = "max_new_tokens cut the reply before any content (reasoning?)"


def regenerate_one(
    server: ChatServer, conversation: Conversation, max_new_tokens: int, temperature: float, seed: int
) -> Regeneration:
    """Regenerate one conversation; it stops where the context is full, or where a reply is cut before it has
    any content. Sampling is seeded per conversation (seed, id), so a reply does not depend on what ran before
    it. A ServerError names the conversation."""
    seed = random.Random(f"regenerate/{seed}/{conversation.id}").getrandbits(31)
    regeneration = Regeneration(conversation)
    while not regeneration.done:
        try:
            regeneration.answer(server.reply(regeneration.next_prompt(), max_new_tokens, temperature, seed))
        except ReplyCut:
            regeneration.answer(None, ReplyCut.reason)
        except ServerError as error:
            raise ServerError(f"conversation {conversation.id!r} ({conversation.source}): {error}") from None
    return regeneration


def regenerate_via_server(
    server: ChatServer,
    conversations: list[Conversation],
    out_path: str | Path,
    *,
    temperature: float = 0.0,
    max_new_tokens: int = 512,
    concurrency: int = 8,
    seed: int = 0,
    resume: bool = False,
) -> RegenerationReport:
    """`synth.regenerate` through a server."""
    require_range("concurrency", concurrency, at_least=1)
    require_range("temperature", temperature, at_least=0)
    out_path = Path(out_path)
    settings = dict(model=server.model, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    done = start_output(conversations, out_path, resume, settings)
    finished = {c.id for c in done}
    todo = [c for c in conversations if c.id not in finished]
    report = RegenerationReport(out_path, written=len(done))
    pool = ThreadPoolExecutor(concurrency)  # at most `concurrency` requests in flight
    try:
        futures = [pool.submit(regenerate_one, server, c, max_new_tokens, temperature, seed) for c in todo]
        with tqdm(
            total=len(conversations), initial=len(conversations) - len(todo), desc="regenerate", unit="conv"
        ) as bar:
            for future in futures:  # in input order: the file does not depend on which reply came first
                kept = report.add(future.result())
                if kept is not None:
                    append_conversations_jsonl([kept], out_path)
                elif report.dropped:
                    bar.set_postfix(dropped=sum(report.dropped.values()))
                bar.update(1)
    finally:
        pool.shutdown(cancel_futures=True)  # after an error, the queued conversations are not sent
    return report
