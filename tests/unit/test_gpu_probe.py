"""The GPU probe's arithmetic and the agent's side of it, run on NumPy as the agent runs it on CuPy:
an honest fill's digests check out, and a changed digest, another fill or a wrong shape do not; the
time is judged against the claimed GPU's datasheet; an agent with no GPU says so and fills nothing."""

from __future__ import annotations

import base64
import json
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from neuralgrid.agent.gpu_probe import GpuProbeHost, gpu_arrays
from neuralgrid.cli import app
from neuralgrid.gateway.gpu_prober import fill_size
from neuralgrid.verify import gpu_probe as probe

BLOCK = 64 << 10
PLAN = probe.Plan("n" * 32, 24 * BLOCK, BLOCK)
NONCE2 = "m" * 32


def answered(plan: probe.Plan = PLAN, nonce2: str = NONCE2) -> list[int]:
    data = probe.fill(np, plan)
    return [int(d) for d in probe.digests(np, data, probe.seed(nonce2, b"digest"))]


def test_an_honest_fills_digests_check_out_block_by_block() -> None:
    digests = answered()
    assert len(digests) == PLAN.blocks and len(set(digests)) == PLAN.blocks
    assert probe.wrong_digests(PLAN, NONCE2, digests, range(PLAN.blocks)) == []


def test_a_changed_digest_is_found_and_so_is_every_digest_of_another_fill() -> None:
    digests = answered()
    digests[5] ^= 1
    assert probe.wrong_digests(PLAN, NONCE2, digests, [4, 5, 6]) == [5]
    other = answered(probe.Plan("o" * 32, PLAN.size, BLOCK))  # data from another nonce
    assert probe.wrong_digests(PLAN, NONCE2, other, range(PLAN.blocks)) == list(range(PLAN.blocks))
    stale = answered(nonce2="s" * 32)  # digests made before the second nonce was known
    assert probe.wrong_digests(PLAN, NONCE2, stale, range(PLAN.blocks)) == list(range(PLAN.blocks))


def test_a_pass_reads_every_block_again_each_digest_depends_on_the_pass_before() -> None:
    """A block left out of the first pass (made up instead of read) changes a digest of the last."""
    data = probe.fill(np, PLAN)
    honest = probe.digests(np, data, probe.seed(NONCE2, b"digest"))
    data[3] ^= np.uint64(1)  # one word of one block not what the fill made
    touched = probe.digests(np, data, probe.seed(NONCE2, b"digest"))
    assert int((honest != touched).sum()) >= 1
    assert int((honest != touched).sum()) < PLAN.blocks  # each block's chain is its own


def test_the_time_is_judged_against_the_claimed_gpus_datasheet() -> None:
    size = 10 << 30
    fast = probe.judge(size, seconds=0.25, rtt_s=0.05, datasheet_gbps=1008.0)  # 4 passes of 10 GiB in 0.2 s
    assert fast.passed and fast.gbps == pytest.approx(4 * size / 0.2 / 1e9, rel=1e-3)
    cpu = probe.judge(size, seconds=4.05, rtt_s=0.05, datasheet_gbps=1008.0)  # a CPU's 10 GB/s
    assert not cpu.passed and cpu.gbps < probe.MIN_SHARE * 1008
    assert (
        probe.bandwidth_for("NVIDIA H100 PCIe") == 2000
        and probe.bandwidth_for("NVIDIA H100 80GB HBM3") == 3350
    )
    assert (
        probe.bandwidth_for("NVIDIA GeForce RTX 4090") == 1008
        and probe.bandwidth_for("Acme Tensor 1") is None
    )


def test_a_plan_the_agent_cannot_take_is_refused_with_why() -> None:
    assert probe.plan_error(PLAN.size, BLOCK) is None
    assert "power of two" in str(probe.plan_error(3 * 100_000, 100_000))
    assert "whole number of blocks" in str(probe.plan_error(BLOCK + 1, BLOCK))
    assert "whole number of blocks" in str(probe.plan_error(probe.MAX_BYTES * 2, BLOCK))
    assert "block_bytes" in str(probe.plan_error(BLOCK, 1 << 30))
    assert "block_bytes" in str(probe.plan_error(BLOCK, True))


def test_a_probe_fills_a_share_of_one_claimed_gpu_in_whole_blocks() -> None:
    assert fill_size(80, 1, 0.5) == 40 << 30
    assert fill_size(160, 2, 0.5) == 40 << 30  # one GPU of two
    assert fill_size(0.001, 1, 0.5) == probe.BLOCK_BYTES  # never nothing
    assert fill_size(24, 1, 0.01) % probe.BLOCK_BYTES == 0


async def ask(host: GpuProbeHost, **body: Any) -> tuple[int, dict[str, Any]]:
    return await host.answer(json.dumps(body).encode())


async def test_the_agent_fills_then_answers_the_digests_once_and_gives_the_memory_back() -> None:
    host = GpuProbeHost(np, "a CPU standing in for a GPU")
    status, refused = await ask(host, op="digest", nonce=NONCE2)
    assert status == 409 and "nothing is filled" in refused["error"]["message"]
    status, filled = await ask(host, op="fill", nonce=PLAN.nonce, bytes=PLAN.size, block_bytes=BLOCK)
    assert status == 200 and filled["gpu"] is True and filled["device"] == "a CPU standing in for a GPU"
    status, answer = await ask(host, op="digest", nonce=NONCE2)
    assert status == 200
    raw = base64.b64decode(answer["digests"])
    digests = [int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)]
    assert digests == answered()
    assert (await ask(host, op="digest", nonce=NONCE2))[0] == 409  # given back: once only


async def test_an_agent_without_a_gpu_says_so_and_fills_nothing() -> None:
    host = GpuProbeHost(None, "no NVIDIA GPU found (CUDA sees no device)")
    status, answer = await ask(host, op="fill", nonce=PLAN.nonce, bytes=PLAN.size)
    assert (status, answer) == (200, {"gpu": False, "reason": "no NVIDIA GPU found (CUDA sees no device)"})
    assert await ask(host, op="ping") == (200, {"gpu": False})
    xp, why = gpu_arrays()  # this machine: no CuPy, or no GPU; either way said, never a crash
    assert (xp is None and why) or isinstance(xp, ModuleType)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"not json", '"op"'),
        (b'{"op": "format"}', "unknown probe op"),
        (b'{"op": "fill", "nonce": "short", "bytes": 65536, "block_bytes": 65536}', "nonce"),
        (b'{"op": "fill", "nonce": "nnnnnnnnnnnnnnnnnnnn", "bytes": -1}', "bytes"),
        (
            b'{"op": "fill", "nonce": "nnnnnnnnnnnnnnnnnnnn", "bytes": 65536, "block_bytes": 1000}',
            "block_bytes",
        ),
        (b'{"op": "digest", "nonce": 7}', "nonce"),
    ],
)
async def test_a_bad_probe_request_is_a_400_that_says_why(body: bytes, fragment: str) -> None:
    status, answer = await GpuProbeHost(np, "cpu").answer(body)
    assert status == 400 and fragment in answer["error"]["message"]


def test_the_whole_probe_runs_here_and_checks_its_own_blocks() -> None:
    figures = probe.run_here(np, PLAN, lambda: None)
    assert figures["bytes"] == PLAN.size and figures["checked"] == probe.CHECKS and figures["wrong"] == 0
    assert figures["gbps"] > 0 and figures["fill_s"] > 0 and figures["digest_s"] > 0


def test_probe_gpu_on_a_machine_without_one_says_why_in_one_line() -> None:
    xp, why = gpu_arrays()
    if xp is not None:
        pytest.skip("this machine has a GPU: `neuralgrid node probe-gpu` probes it")
    result = CliRunner().invoke(app, ["node", "probe-gpu"], env={"COLUMNS": "200"})
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: {why}"  # brackets and all: pip install 'neuralgrid[gpu]'


async def test_an_agent_without_the_memory_to_fill_refuses_with_a_409() -> None:
    host = GpuProbeHost(np, "a small GPU")
    status, answer = await ask(host, op="fill", nonce=PLAN.nonce, bytes=1 << 40, block_bytes=BLOCK)  # 1 TiB
    assert status == 409 and "not enough free GPU memory" in answer["error"]["message"]
