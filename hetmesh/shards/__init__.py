"""Weights that travel over the mesh: the model manifest and fetching a stage's tensors.

- :mod:`hetmesh.shards.manifest`: a converted model folder described by a
  content-addressed manifest (its sha256 is the model's identity on the mesh);
  which units a folder holds; which tensors a unit range needs.
- :mod:`hetmesh.shards.cache`: a partial model folder that holds only some
  units, filled tensor by tensor (verified, written atomically, resumable).
"""
