"""The generate RPC between a client and the node it enters the mesh at (its gateway).

One libp2p stream per request, on :data:`GENERATE_PROTOCOL`: the client writes
one length-prefixed msgpack map (``prompt``, ``prompt_ids`` or ``messages`` — a
conversation of ``{"role", "content"}`` maps put through the chat template —, ``chat``,
``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``);
the node answers with a sequence of maps: ``{"token": id, "text": delta}`` per
generated token (``token`` -1 for a final text-only flush), then either
``{"done": true, "finish_reason", "prompt_tokens", "completion_tokens"}`` or
``{"error": name, "message": text}``.
"""

from __future__ import annotations

GENERATE_PROTOCOL = "/hetmesh/generate/1.0.0"
MAX_REQUEST_BYTES = 4 << 20
