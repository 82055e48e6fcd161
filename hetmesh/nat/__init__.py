"""Joining across NAT: learning whether members are publicly reachable.

- :mod:`hetmesh.nat.reachability` (pure): the dial-back wire format, which
  announced addresses a member may dial back, the verdict from members'
  answers, and how a peer's reachability reads in its record and in
  ``hetmesh status``.
- :mod:`hetmesh.nat.dialback` (trio + libp2p): the dial-back service every
  node runs over the authenticated control plane — it answers members'
  requests and asks a few members to dial it back, publishes its verdict in
  its record and says in one log line what to do when no member can reach it.

Why our own and not py-libp2p 0.8's AutoNAT: its server dials back with
``host.connect``, which returns at once when a connection to that peer
already exists — and the request itself arrived on one — so every node
would be told it is public.
"""
