"""The benchmarks' CPU meter: a process tree's CPU never goes backwards when a child ends, and a
load's window holds the work its target does just after answering.

Found in CI: `bench heartbeats` once measured negative Postgres CPU per beat. A live backend counts
its nanoseconds on a CPU; once it has ended and been reaped, its time is in its parent's reaped-
children total, which /proc gives in 10 ms clock ticks (rounded down). A backend at 15 ms seen live,
then reaped, dropped the tree's total by 5 ms: more than a short window of cheap beats used."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

from neuralgrid.bench import CpuMeter, send_load

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


# Answers each POST, then works 40 ms more on the CPU (as a gateway writes its records behind).
WRITES_BEHIND = textwrap.dedent(
    """
    import http.server, sys, time

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")
            self.wfile.flush()
            until = time.process_time() + 0.04
            while time.process_time() < until:
                pass

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()
    """
)


def test_a_load_s_cpu_counts_what_its_target_does_just_after_the_last_answer() -> None:
    """Found in CI: a short `bench gateway` run read 0 ms of Postgres CPU on a leased path, whose
    records are written up to 50 ms after the answers; the meter read at the last answer."""
    with subprocess.Popen([sys.executable, "-c", WRITES_BEHIND], stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout is not None
            url = f"http://127.0.0.1:{server.stdout.readline().strip()}/"
            meter = CpuMeter({"target": [server.pid]})
            load = asyncio.run(send_load([url], b"{}", callers=1, total=1, meter=meter))
        finally:
            server.kill()
    assert load.latencies_ms and load.cpu_s["target"] >= 0.035, load.cpu_s
