"""The ``hetmesh`` command line.

Each command lives in a module of this package that registers itself on
:data:`hetmesh.cli._app.app`; heavy imports (torch, libp2p) happen inside the
commands so ``hetmesh --help`` stays fast. :func:`main` turns any
:class:`~hetmesh.errors.MeshError` into one line on stderr and exit code 1.
"""

from __future__ import annotations

import logging
import sys

from hetmesh.cli import demo as _demo  # noqa: F401  (registers commands)
from hetmesh.cli import model as _model  # noqa: F401  (registers commands)
from hetmesh.cli import node as _node  # noqa: F401  (registers commands)
from hetmesh.cli import plan as _plan  # noqa: F401  (registers commands)
from hetmesh.cli import status as _status  # noqa: F401  (registers commands)
from hetmesh.cli import version as _version  # noqa: F401  (registers commands)
from hetmesh.cli._app import app
from hetmesh.errors import MeshError


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except MeshError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        logging.getLogger(__name__).debug("interrupted")
        sys.exit(130)


__all__ = ["app", "main"]
