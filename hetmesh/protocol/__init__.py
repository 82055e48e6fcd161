"""Wire records both sides of a request share: the SDK (:mod:`hetmesh.client`) and the
node (:mod:`hetmesh.node`) import them; they import nothing of ours but errors and resources.

Pure: no trio, no libp2p, no torch.
"""
