"""``hetmesh version``."""

from __future__ import annotations

import typer

from hetmesh import __version__
from hetmesh.cli._app import app


@app.command()
def version() -> None:
    """Print the hetmesh version."""
    typer.echo(__version__)
