"""The typer application every command module registers into."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="hetmesh",
    help="A peer-to-peer mesh that serves large language models across mixed machines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
