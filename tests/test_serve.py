"""`wingspan serve`'s process handling, with stand-in servers (small Python programs): a stop signal reaches the
server's whole process group, a server that ignores it is killed after the grace period, and nothing of the
group outlives the call. The real server (vLLM) is started in tests/test_vllm.py."""

import os
import signal
import sys
import threading
import time

import pytest

from wingspan.serve import run_server

# A "server" that starts a child in its own process group (as vLLM starts its engine), writes the child's pid,
# and then waits; with IGNORE it ignores SIGINT, as a server stuck in shutdown would.
SERVER = """
import signal, subprocess, sys, time
if sys.argv[2] == "ignore":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
stubborn = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", stubborn])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead
        return stat.read().split()[2] != "Z"


def serve_and_stop(tmp_path, mode: str, grace_s: float) -> tuple[int, int, float]:
    pid_file = tmp_path / "child.pid"

    def stop() -> None:
        while not pid_file.exists() or not pid_file.read_text():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C

    threading.Thread(target=stop, daemon=True).start()
    started = time.monotonic()
    code = run_server([sys.executable, "-c", SERVER, str(pid_file), mode], grace_s=grace_s)
    return code, int(pid_file.read_text()), time.monotonic() - started


def test_ctrl_c_stops_the_server_and_its_children(tmp_path):
    code, child, seconds = serve_and_stop(tmp_path, "obey", grace_s=30)
    assert code == 0 and seconds < 10
    time.sleep(0.2)
    assert not alive(child)  # the server's child (vLLM's engine) went with it


def test_a_server_started_where_ctrl_c_is_ignored_still_stops_on_it(tmp_path):
    """A background job (`&`, nohup) inherits SIGINT ignored; the server must not, or the stop passed on to it
    would be ignored until the grace ran out."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code, child, seconds = serve_and_stop(tmp_path, "obey", grace_s=30)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 0 and seconds < 10
    time.sleep(0.2)
    assert not alive(child)


def test_a_server_that_ignores_the_stop_is_killed_after_the_grace(tmp_path):
    code, child, seconds = serve_and_stop(tmp_path, "ignore", grace_s=1)
    assert code == 128 + signal.SIGKILL and 1 <= seconds < 10
    time.sleep(0.2)
    assert not alive(child)


def test_a_server_that_exits_by_itself_gives_its_status():
    assert run_server([sys.executable, "-c", "raise SystemExit(3)"]) == 3


def test_a_missing_python_is_one_clear_error(tmp_path):
    from wingspan.errors import ConfigError
    from wingspan.serve import serve

    with pytest.raises(ConfigError, match="--python /no/such/python: cannot run it"):
        serve(tmp_path, "/no/such/python", None, 3, "127.0.0.1", 8000, [])
