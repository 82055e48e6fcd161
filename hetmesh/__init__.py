"""hetmesh: a peer-to-peer mesh that serves large language models across mixed machines."""

from hetmesh import errors
from hetmesh.errors import MeshError

__version__ = "0.1.0"

__all__ = ["MeshError", "__version__", "errors"]
