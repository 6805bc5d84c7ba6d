"""The benchmarks' CPU meter: a process tree's CPU never goes backwards when a child ends.

Found in CI: `bench heartbeats` once measured negative Postgres CPU per beat. A live backend counts
its nanoseconds on a CPU; once it has ended and been reaped, its time is in its parent's reaped-
children total, which /proc gives in 10 ms clock ticks (rounded down). A backend at 15 ms seen live,
then reaped, dropped the tree's total by 5 ms: more than a short window of cheap beats used."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from neuralgrid.bench import CpuMeter

# Burns CPU until its own total is 5 to 8 ms past a whole clock tick (what reaping rounds away),
# says so, and ends (without Python's tear-down) when told to.
CHILD = textwrap.dedent(
    """
    import os, sys, time
    while not 0.005 <= time.process_time() % 0.01 < 0.008:
        pass
    print("ready", flush=True)
    sys.stdin.readline()
    os._exit(0)
    """
)
# Runs the child, reaps it, says so, and stays until its input closes.
PARENT = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {CHILD!r}]); print('reaped', flush=True); sys.stdin.read()"


def test_a_tree_s_cpu_does_not_drop_when_a_child_it_counted_is_reaped() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as parent:
        assert parent.stdin is not None and parent.stdout is not None
        meter = CpuMeter({"tree": [parent.pid]})
        assert parent.stdout.readline() == "ready\n"
        with_child = meter.read()["tree"]
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.stdout.readline() == "reaped\n"
        after = meter.read()["tree"]
        parent.stdin.close()
    assert after >= with_child, (with_child, after)
