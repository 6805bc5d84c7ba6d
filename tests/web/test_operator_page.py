"""Run a node's command, as an owner copies it into a shell (issue 40): the API key in the environment,
never on the command line where `ps` shows it; the model alias a llama.cpp server needs; and where
the node will stand on the map."""

from __future__ import annotations

import subprocess

from playwright.sync_api import expect

from neuralgrid.protocol.regions import REGIONS
from tests.web.test_web import Opener


def as_run(command: str) -> tuple[list[str], str]:
    """What bash gives `neuralgrid` when the page's command is pasted into it: its arguments, and
    NEURALGRID_NODE_TOKEN in its environment."""
    probe = 'neuralgrid() { printf "%s\\n" "$@"; printf "token=%s" "$NEURALGRID_NODE_TOKEN"; }\n'
    ran = subprocess.run(["bash", "-c", probe + command], capture_output=True, text=True, check=True)
    *args, token = ran.stdout.split("\n")
    return args, token.removeprefix("token=")


def test_the_command_keeps_the_key_out_of_ps_and_carries_the_model_alias(
    gateway: str, open_page: Opener
) -> None:
    page, watch = open_page(f"{gateway}/operator")
    command = page.locator("#command")
    page.fill("#node-token", "ng-abc123")
    page.fill("#node-name", "lab box")
    expect(command).to_contain_text("export NEURALGRID_NODE_TOKEN=ng-abc123")
    args, token = as_run(command.inner_text())
    assert token == "ng-abc123" and not any("ng-abc123" in arg or arg == "--token" for arg in args)
    assert (
        args[:4] == ["node", "run", "--gateway", gateway] and "--model-alias" not in args
    )  # vLLM needs none
    assert args[args.index("--name") + 1] == "lab box"

    # A llama.cpp server names the model by its file, as its own command line gave it.
    page.fill("#node-alias", "~/models/smollm2.gguf=HuggingFaceTB/SmolLM2-135M-Instruct")
    expect(command).to_contain_text("--model-alias ~/models/smollm2.gguf=HuggingFaceTB/SmolLM2-135M-Instruct")
    args, _ = as_run(command.inner_text())
    home = subprocess.run(["bash", "-c", "echo ~"], capture_output=True, text=True).stdout.strip()
    alias = args[args.index("--model-alias") + 1]
    assert alias == f"{home}/models/smollm2.gguf=HuggingFaceTB/SmolLM2-135M-Instruct"
    page.fill("#node-alias", "smollm2.gguf")
    expect(page.locator("#node-alias-error")).to_contain_text("the catalog id")
    expect(command).to_contain_text("--model-alias <file>=<catalog id>")
    watch.assert_clean()


def test_the_page_says_where_the_node_will_stand_on_the_map(gateway: str, open_page: Opener) -> None:
    page, watch = open_page(f"{gateway}/operator")
    regions = page.locator("#regions option")
    expect(regions).to_have_count(len(REGIONS))
    assert [o.get_attribute("value") for o in regions.all()] == list(REGIONS)  # the agent's regions
    place = page.locator("#node-region-place")
    expect(place).to_have_text("On the map at London.")  # eu-west, the form's own
    page.fill("#node-region", "moon-base")
    expect(place).to_contain_text("add --latitude and --longitude")
    expect(page.locator("main")).to_contain_text("add --latitude and --longitude to place it exactly")
    watch.assert_clean()
