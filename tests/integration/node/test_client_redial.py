"""A client whose connection to its node dropped dials it again.

libp2p keeps a dialled peer's addresses for 120 s only; once they lapse, a client
whose connection closed later (the node restarted it, a network blip, a reset
under load) could never open another stream: "No known addresses to peer", for
the rest of the client's life. The SDK keeps the node's addresses itself. Here
the lapse is had at once (the peerstore's addresses cleared) and the connection
closed from the client's side; the next request must still be served, and equal
the one-process reference. Two in-process daemons serve the tiny test model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hetmesh.client.mesh import MeshClient, TokenEvent, open_mesh_client
from hetmesh.node.config import ServingConfig
from tests.integration.node.inprocess_mesh import PROMPT_IDS, SECRET, open_mesh
from tests.integration.node.mesh_nodes import reference_ids

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.timeout(300)]

TOKENS = 6


async def _tokens(client: MeshClient, ids: list[int]) -> list[int]:
    got = []
    async for event in client.stream(prompt_ids=ids, max_new_tokens=TOKENS):
        if isinstance(event, TokenEvent) and event.token_id >= 0:
            got.append(event.token_id)
    return got


async def test_a_client_redials_its_node_after_the_connection_and_addresses_are_gone(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    expected = reference_ids(tiny_model_dir, PROMPT_IDS, TOKENS)
    serving = ServingConfig(max_sessions=2, max_context_tokens=512, block_step_s=0.002)
    async with (
        open_mesh(tmp_path, serving, 2, model=tiny_model_dir) as mesh,
        open_mesh_client(mesh.addr, mesh_secret=SECRET) as client,
    ):
        assert await _tokens(client, list(PROMPT_IDS)) == expected
        host = client._host
        node = client._peer_id
        # what 120 s of libp2p's address TTL and a dropped connection leave behind
        host.get_peerstore().clear_addrs(node)
        await host.get_network().close_peer(node)
        assert not host.get_network().get_connections(node)
        assert await _tokens(client, list(PROMPT_IDS)) == expected
        assert host.get_network().get_connections(node)  # dialled again
