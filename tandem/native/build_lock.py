"""One native-kernel build at a time per build folder, and no wait on a build that is dead.

torch's extension builder marks a build under way with a `lock` file in the build folder and waits, with no time
limit, for another's to go. A builder killed midway (a run stopped with ^C, a server SIGKILLed, a rank ended with
its engine) leaves the file, and every later engine then waits for ever; a time limit on the file's age cannot tell
a dead build from a slow one on a busy machine. So tandem's builders also hold an advisory lock (flock) on
`builder.flock` beside it while they build, which the kernel releases however the process ends: whoever takes the
flock knows no tandem builder is alive, waits for any compiler the dead one left running in the folder (ninja runs
there, and outlives a SIGKILLed parent), and removes a `lock` file it finds.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("tandem")


@contextmanager
def building(build_dir: Path, say_wait: bool = True, poll_s: float = 0.5) -> Iterator[None]:
    """Hold `build_dir`'s builder lock for the body (a build, or the check that none is needed, and the load),
    waiting while another live process holds it, with one line said where `say_wait` (a build is due: the wait may
    take minutes; a peer's load of a built library takes a moment); torch's `lock` file left by a dead build is
    removed first."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "builder.flock", "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if say_wait:  # one line, so a wait of minutes is never silent
                print(f"tandem: waiting for another process's build of the native CPU kernels ({build_dir})",
                      file=sys.stderr, flush=True)
            fcntl.flock(held, fcntl.LOCK_EX)
        clear_dead_build_lock(build_dir, poll_s)
        yield  # the flock goes with the file's close


def clear_dead_build_lock(build_dir: Path, poll_s: float = 0.5) -> bool:
    """With the builder lock held (no live tandem builder): wait while processes left by a dead build still run in
    `build_dir`, then remove torch's `lock` file there; True when one was removed."""
    lock = build_dir / "lock"
    if not lock.exists():
        return False
    said = False
    while working := processes_in(build_dir):
        if not said:
            print(f"tandem: waiting for {len(working)} compiler process(es) a stopped build left in {build_dir}",
                  file=sys.stderr, flush=True)
            said = True
        time.sleep(poll_s)
    log.warning("tandem: removing %s, left by a native-kernel build that did not finish", lock)
    lock.unlink(missing_ok=True)
    return True


def processes_in(folder: Path) -> list[int]:
    """Pids of the processes whose working directory is `folder` (Linux /proc; elsewhere, or for processes we may
    not inspect, none)."""
    target = os.path.realpath(folder)
    pids = []
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if os.readlink(cwd) == target:
                pids.append(int(cwd.parent.name))
        except OSError:
            continue
    return pids
