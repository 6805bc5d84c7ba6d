"""`neuralgrid models pin`: the operator pins a catalog model to the GGUF file whose bytes its nodes
must serve (issue 39). Challenges are scored against a reference of exactly that file, so a node
serving a smaller, pruned or requantized model under the catalog's name is caught."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from neuralgrid.cli.common import database, fail, friendly_errors, out, progress
from neuralgrid.verify.artifacts import file_sha256

app = typer.Typer(no_args_is_help=True, help="The catalog's models: pin each to the file nodes must serve.")

GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file
CHUNK = 1 << 20  # read a file of gigabytes a MiB at a time
SHA256 = re.compile(r"[0-9a-f]{64}")


def check_gguf(path: Path) -> None:
    """One line for a path that is not a readable GGUF file, before the long read."""
    try:
        with path.open("rb") as file:
            magic = file.read(len(GGUF_MAGIC))
    except IsADirectoryError as err:
        raise fail(f"--gguf: {path} is a directory, not a GGUF file") from err
    except OSError as err:
        raise fail(f"--gguf: cannot read {path}: {err.strerror or err}") from err
    if magic != GGUF_MAGIC:
        raise fail(f"--gguf: {path} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")


def sha256_text(text: str) -> str:
    digest = text.strip().lower()
    if not SHA256.fullmatch(digest):
        raise fail(f"--sha256 takes the file's sha256 as 64 hex digits, not {text!r}")
    return digest


@app.command("pin")
@friendly_errors
def pin(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="The catalog model's id.")],
    gguf: Annotated[
        Path | None, typer.Option("--gguf", help="The GGUF file: its sha256 is computed here.")
    ] = None,
    sha256: Annotated[
        str | None, typer.Option("--sha256", help="The GGUF file's sha256, when the file is elsewhere.")
    ] = None,
) -> None:
    """Pin MODEL to a GGUF file, by its sha256: every node holding MODEL is put under verification,
    and challenged by the gateways whose referee holds that file. Pinning again replaces the file."""
    from neuralgrid.db import queries as q
    from neuralgrid.db.store import SyncStore

    if (gguf is None) == (sha256 is None):
        raise fail("give the file as --gguf PATH, or its sha256 as --sha256 HEX (one of the two)")
    # The file to hash, or the sha256 given, each checked before the database is asked anything.
    source: Path | str = gguf if gguf is not None else sha256_text(sha256 or "")
    if isinstance(source, Path):
        check_gguf(source)
    with database(ctx) as conn:
        store = SyncStore(conn)
        # Every refusal before the long read, so that a mistake costs no minutes of hashing.
        catalog = sorted(m.id for m in store.all(q.MODEL_KINDS))
        if model not in catalog:
            raise fail(f"{model!r} is not a catalog model; the catalog's are: {', '.join(catalog)}")
        if isinstance(source, Path):
            progress(f"computing the sha256 of {source}")
            digest = file_sha256(source)
        else:
            digest = source
        store.get(q.PIN_ARTIFACT, (model, digest))
        checked = store.get(q.MODEL_UNDER_VERIFICATION, (model,))
    # Whole, however narrow the terminal: a sha256 cut in two is not one to copy.
    out.print(f"pinned {model} to the GGUF file with sha256 {digest}", highlight=False, soft_wrap=True)
    holds = "node holds" if checked == 1 else "nodes hold"
    out.print(f"{checked} {holds} it: each is under verification", highlight=False)
