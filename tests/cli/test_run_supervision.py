"""`jobledger run`: a wrapper that dies abruptly (SIGKILL, the OOM killer) takes its command with it.

CMD, and what CMD started (a shell script's children), get SIGTERM, then
SIGKILL after --grace, from a small reaper that lives in CMD's process group
and sees the wrapper's death as the end of a pipe only the wrapper writes. A
normal end stands the reaper down: what CMD left running keeps running, as
before.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from clihelp import JOBLEDGER, environment, runs_of, start
from waiting import wait_for

# CMD: notes its pid and its background child's pid, then runs until killed (its output away from the
# test's pipes, which a survivor would hold open). STUBBORN ignores SIGTERM (and so does its child):
# only the SIGKILL after the grace stops them.
PLAIN = 'exec >/dev/null 2>&1; sleep 1000 & echo $! > "$DIR/child.pid"; echo $$ > "$DIR/cmd.pid"; exec sleep 1000'
STUBBORN = 'trap "" TERM; ' + PLAIN.replace("exec sleep 1000", "while :; do sleep 0.1; done")


def _gone(pid: int) -> bool:
    """Whether ``pid`` is dead: no such process, or a zombie nobody reaped yet (a container's pid 1
    need not reap the orphans it inherits)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # not Linux: a zombie looks alive; the reaper's SIGKILL leaves none for long
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _pids(directory: Path) -> tuple[int, int]:
    def read(name: str) -> str:
        path = directory / name
        return path.read_text().strip() if path.exists() else ""
    wait_for(lambda: read("cmd.pid") and read("child.pid"), timeout=30, what="CMD and its child to start")
    return int(read("cmd.pid")), int(read("child.pid"))


def _kill(pids: tuple[int, ...]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sigkill_to_the_wrapper_stops_cmd_and_its_children(dsn, db, tmp_path):
    for script in (PLAIN, STUBBORN):
        directory = tmp_path / ("stubborn" if script is STUBBORN else "plain")
        directory.mkdir()
        wrapper = start("run", f"killed-{directory.name}", "--ttl", "30s", "--grace", "0.5s", "--",
                        "sh", "-c", script, env=environment(dsn, DIR=str(directory)))
        pids: tuple[int, ...] = ()
        try:
            pids = _pids(directory)
            wrapper.kill()  # SIGKILL: no handler, no forwarding, nothing recorded
            wrapper.wait(timeout=60)
            wait_for(lambda: all(_gone(pid) for pid in pids), timeout=20,
                     what=f"CMD and its child ({directory.name}) to die with their wrapper")
        finally:
            if wrapper.poll() is None:
                wrapper.kill()
                wrapper.wait()
            _kill(pids)


def test_sigkill_to_the_wrapper_s_whole_process_group_stops_cmd(dsn, db, tmp_path):
    """A supervisor that kills the wrapper's process group (not CMD's, which is its own) kills the
    reaper with it only if the reaper were in the wrapper's group: it is in CMD's."""
    wrapper = subprocess.Popen([*JOBLEDGER, "run", "grouped", "--ttl", "30s", "--grace", "0.5s", "--",
                                "sh", "-c", PLAIN], env=environment(dsn, DIR=str(tmp_path)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0)
    pids: tuple[int, ...] = ()
    try:
        pids = _pids(tmp_path)
        os.killpg(wrapper.pid, signal.SIGKILL)
        wrapper.wait(timeout=60)
        wait_for(lambda: all(_gone(pid) for pid in pids), timeout=20,
                 what="CMD and its child to die with their wrapper's process group")
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait()
        _kill(pids)


def test_a_normal_end_leaves_what_cmd_started_in_the_background_alone(dsn, db, tmp_path):
    """The reaper is told the run ended: a background child CMD left behind is not killed (as
    before), and the run is recorded as CMD ended."""
    script = 'sleep 1000 >/dev/null 2>&1 & echo $! > "$DIR/child.pid"; echo $$ > "$DIR/cmd.pid"'
    wrapper = start("run", "detached", "--ttl", "30s", "--grace", "0.2s", "--", "sh", "-c", script,
                    env=environment(dsn, DIR=str(tmp_path)))
    pids: tuple[int, ...] = ()
    try:
        pids = _pids(tmp_path)
        _, stderr = wrapper.communicate(timeout=60)
        assert wrapper.returncode == 0, stderr
        [run] = runs_of(db, "detached")
        assert run["status"] == "success"
        # A reaper not stood down would have sent SIGTERM by now (the wrapper is gone, its pipe closed)
        # and SIGKILL 0.2s later; ask once more after that, through a process that must start first.
        subprocess.run(["sh", "-c", "sleep 1"], check=True)
        assert not _gone(pids[1])
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait()
        _kill(pids)
