"""`neuralgrid node probe-gpu`: the GPU probe the gateways run (neuralgrid/verify/gpu_probe.py), run
here on this machine's GPU with no network between: what a gateway would measure, and, on a GPU the
datasheet table knows, whether it would pass. Its JSON is the calibration of a GPU model."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Annotated

import typer

from neuralgrid.cli.common import fail, out
from neuralgrid.verify import gpu_probe as probe


def probe_gpu(
    share: Annotated[
        float, typer.Option(min=0.01, max=0.9, help="The share of the GPU's free memory to fill.")
    ] = 0.5,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the figures to this file.")
    ] = None,
) -> None:
    """Run the GPU probe here, as a gateway would, and print what it shows."""
    from neuralgrid.agent.gpu_probe import gpu_arrays

    xp, device = gpu_arrays()
    if xp is None:
        raise fail(device)
    free, total = xp.cuda.runtime.memGetInfo()
    size = int(free * share) // probe.BLOCK_BYTES * probe.BLOCK_BYTES
    if size < probe.BLOCK_BYTES:
        raise fail(f"{free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB free on {device}: too little to probe")
    plan = probe.Plan(secrets.token_hex(16), size)
    figures = probe.run_here(xp, plan, xp.cuda.Stream.null.synchronize)
    datasheet = probe.bandwidth_for(device)
    figures |= {"device": device, "total_bytes": total, "datasheet_gbps": datasheet}
    if datasheet is not None:
        figures["share_of_datasheet"] = round(figures["gbps"] / datasheet, 4)
        figures["passes"] = figures["wrong"] == 0 and figures["gbps"] >= probe.MIN_SHARE * datasheet
    out.print(
        f"{device}: filled {size / 2**30:.1f} GiB in {figures['fill_s']:.2f} s; {probe.PASSES} passes of"
        f" digests in {figures['digest_s']:.3f} s = {figures['gbps']:.0f} GB/s"
        + (f", {figures['share_of_datasheet']:.0%} of its datasheet's {datasheet:.0f}" if datasheet else "")
        + f"; {figures['checked'] - figures['wrong']} of {figures['checked']} blocks checked out",
        highlight=False,
    )
    if json_out is not None:
        json_out.write_text(json.dumps(figures, indent=2) + "\n")
    if figures["wrong"] or figures.get("passes") is False:
        raise typer.Exit(1)
