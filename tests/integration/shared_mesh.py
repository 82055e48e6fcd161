"""One three-node mesh serving the default model, shared by the test files that need just that.

``test_mesh_serving.py`` (the daemon: reference output, bad input, leaks, hostile
members) and ``test_api_mesh.py`` (HTTP API, SDK, CLI) both ask for three nodes of
:data:`tests.integration.api.api_mesh.NODE_MEMORY` each, the first one serving the
HTTP API; starting them once saves three model-loading processes and a plan.

The mesh starts when the first test asks for it (``shared_mesh3``) and stops right
after the last test in a row that uses it (``tests/integration/conftest.py``), so it
never idles while its worker runs other files. ``tests/scheduling.py`` puts the files
in :data:`tests.scheduling.SHARED_MESH_FILES` on one xdist worker, one after the other.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from tests.integration.api.api_mesh import Mesh, running_mesh


class SharedMesh:
    """The running mesh, if any: started on demand, closed on request, restartable."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self._mesh: Mesh | None = None
        self._failure: str | None = None

    def get(self, tmp_path: Path) -> Mesh:
        if self._failure is not None:  # not once per test: a failed start costs minutes
            raise RuntimeError(f"the shared mesh failed to start earlier: {self._failure}")
        if self._mesh is None:
            stack = contextlib.ExitStack()
            try:
                self._mesh = stack.enter_context(running_mesh(tmp_path))
            except BaseException as exc:
                stack.close()
                self._failure = f"{type(exc).__name__}: {str(exc)[:2000]}"
                raise
            self._stack = stack
        return self._mesh

    def close(self) -> None:
        """Stop the nodes (reaped); the next :meth:`get` starts a fresh mesh."""
        stack, self._stack, self._mesh, self._failure = self._stack, None, None, None
        if stack is not None:
            stack.close()

    @property
    def running(self) -> bool:
        return self._mesh is not None or self._failure is not None


SHARED = SharedMesh()

__all__ = ["SHARED", "SharedMesh"]
