"""A hostile mesh member for the adversarial tests: it holds the mesh secret and lies.

It is a real libp2p host running our discovery service (started in the test's
own trio loop, not a node process), so what it announces reaches the nodes
exactly as a member's announcement does. It claims to serve the mesh's model
(so the nodes read its serving state, plan included) but offers no device
unless a phase says otherwise, and its peer id is above the coordinator's, so
it never coordinates.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import trio

from hetmesh.resources import DeviceProfile
from tests.integration.discovery.discovery_nodes import SECRET

# what a phase announces: (extra entries, devices)
Phase = tuple[dict[str, Any], tuple[DeviceProfile, ...]]


@dataclass
class Hostile:
    discovery: Any
    key_pair: Any

    @property
    def peer_id(self) -> str:
        return str(self.discovery.peer_id)

    def sign(self, plan_wire: dict[str, Any]) -> dict[str, Any]:
        """A signature of ``plan_wire`` with this member's own identity key."""
        from hetmesh.scheduler.plan_trust import plan_message
        from hetmesh.scheduler.records import Plan

        message = plan_message(Plan.from_wire(copy.deepcopy(plan_wire)))
        return {"signer": self.peer_id, "signature": self.key_pair.private_key.sign(message).hex()}

    async def view_of(self, peer: str) -> dict[str, Any]:
        """``peer``'s status view, asked over this member's own connection (cheap)."""
        from libp2p.custom_types import TProtocol
        from libp2p.peer.id import ID

        from hetmesh.discovery import wire

        host = self.discovery.host
        stream = await host.new_stream(ID.from_base58(peer), [TProtocol(wire.STATUS_PROTOCOL)])
        try:
            payload = await wire.read_frame(stream, max_bytes=wire.MAX_STATUS_BYTES, timeout_s=10)
        finally:
            with contextlib.suppress(Exception):
                await stream.close()
        return wire.decode_map(payload, max_bytes=wire.MAX_STATUS_BYTES)

    def announce(self, phase: Phase, marker: int) -> None:
        extra, devices = phase
        self.discovery.set_devices(devices)
        for key in ("plan", "plan_signature"):
            self.discovery.set_extra(key, None)
        for key, value in extra.items():
            self.discovery.set_extra(key, value)
        self.discovery.set_extra("hostile_phase", marker)  # tells the test it arrived


def forged_device(peer_id: str, **absurd: float) -> DeviceProfile:
    """A device record with values no honest constructor accepts (set behind its back)."""
    gib = 1024**3
    device = DeviceProfile(
        peer_id=peer_id,
        device="cpu",
        backend="cpu",
        name="hostile",
        memory_total_bytes=1024 * gib,
        memory_free_bytes=1024 * gib,
        matmul_flops=1e15,
        memory_bandwidth_bps=1e12,
    )
    for name, value in absurd.items():
        object.__setattr__(device, name, value)  # frozen: what a liar's code would send
    return device


def plan_forgeries(
    hostile: Hostile, real_plan: dict[str, Any], real_signature: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    """(what, extra entries) for each forged plan, built from the plan the mesh follows."""

    def variant(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        plan = copy.deepcopy(real_plan)
        change(plan)
        return plan

    epoch = int(real_plan["epoch"])
    high = variant(lambda p: p.update(epoch=epoch + 1000))
    next_epoch = variant(lambda p: p.update(epoch=epoch + 1))
    top = variant(lambda p: p.update(epoch=2**64 - 1))

    def overlap(p: dict[str, Any]) -> None:
        p["epoch"] = epoch + 1
        first = p["pipelines"][0]["stages"][0]
        first["end"] = int(first["end"]) + 1

    overlapping = variant(overlap)

    def all_on_me(p: dict[str, Any]) -> None:
        p["epoch"] = epoch + 1
        for pipeline in p["pipelines"]:
            for stage in pipeline["stages"]:
                stage["peer_id"] = hostile.peer_id

    mine = variant(all_on_me)
    return [
        ("a high epoch signed by itself", {"plan": high, "plan_signature": hostile.sign(high)}),
        (
            "the next epoch signed by itself",
            {"plan": next_epoch, "plan_signature": hostile.sign(next_epoch)},
        ),
        ("epoch 2**64-1 unsigned", {"plan": top}),
        (
            "epoch 2**64-1 under the coordinator's signature",
            {"plan": top, "plan_signature": real_signature},
        ),
        (
            "the next epoch under the coordinator's signature",
            {"plan": next_epoch, "plan_signature": real_signature},
        ),
        (
            "overlapping ranges signed by itself",
            {"plan": overlapping, "plan_signature": hostile.sign(real_plan)},
        ),
        (
            "every stage on itself signed by itself",
            {"plan": mine, "plan_signature": hostile.sign(mine)},
        ),
    ]


@contextlib.asynccontextmanager
async def open_hostile_member(
    bootstrap: str, above: str, model: str, *, below: bool = False, secret: str = SECRET
) -> AsyncIterator[Hostile]:
    """A member joined through ``bootstrap`` whose peer id sorts above ``above`` (with
    ``below``: below it, a ground low id)."""
    from libp2p import generate_new_ed25519_identity
    from libp2p.peer.id import ID

    from hetmesh.discovery.host import derive_psk, open_host
    from hetmesh.discovery.service import Discovery, DiscoveryConfig

    key_pair = generate_new_ed25519_identity()

    def fits(peer_id: str) -> bool:
        return peer_id < above if below else peer_id > above

    while not fits(ID.from_pubkey(key_pair.public_key).to_base58()):
        key_pair = generate_new_ed25519_identity()
    psk = derive_psk(secret)
    async with open_host(key_pair, psk=psk, listen=["/ip4/127.0.0.1/tcp/0"]) as host:
        discovery = Discovery(
            host,
            DiscoveryConfig(bootstrap=(bootstrap,), mdns=False, mesh_secret=secret),
            psk=psk,
        )
        discovery.set_extra("serving_version", 1)
        discovery.set_extra("model", model)
        async with trio.open_nursery() as nursery:
            await nursery.start(discovery.serve)
            yield Hostile(discovery, key_pair)
            nursery.cancel_scope.cancel()


async def attack(nodes: list[Any], extras: dict[str, dict[str, Any]]) -> tuple[int, str]:
    """Join ``nodes``' mesh as a hostile member and run every phase; the phases reached
    and the member's peer id.

    ``extras``: each node's announced ``extra`` (its plan, signature, model). A phase
    counts as reached once the first node's view shows it (a record it accepted) or
    its rejected-announcement count grows (a record it refused as malformed).
    """
    import math

    from tests.integration.node.mesh_nodes import view_of as view_of_node

    boss = min(extras)
    plan, signature, model = (extras[boss][k] for k in ("plan", "plan_signature", "model"))
    victim = max(extras)
    first = (await view_of_node(nodes[0]))["self"]
    reached = 0
    async with open_hostile_member(nodes[0].addr, boss, model) as hostile:
        phases: list[tuple[str, Phase, bool]] = [
            (what, (extra, ()), True) for what, extra in plan_forgeries(hostile, plan, signature)
        ]
        phases += [
            # refused whole: a record naming another peer's device is not its origin's
            ("another peer's device", ({}, (forged_device(victim),)), False),
            ("1e30 FLOP/s", ({}, (forged_device(hostile.peer_id, matmul_flops=1e30),)), False),
            (
                "NaN bandwidth",
                ({}, (forged_device(hostile.peer_id, memory_bandwidth_bps=math.nan),)),
                False,
            ),
        ]
        for marker, (what, phase, accepted) in enumerate(phases):
            rejected = (await hostile.view_of(first))["statistics"]["rejected"]
            hostile.announce(phase, marker)
            with trio.fail_after(60):
                while True:
                    view = await hostile.view_of(first)
                    mine = [p for p in view["peers"] if p["peer_id"] == hostile.peer_id]
                    extra = mine[0]["record"]["extra"] if mine else {}
                    if accepted and extra.get("hostile_phase") == marker:
                        # the forgery is what the node holds for this member
                        assert extra.get("plan") == phase[0].get("plan"), what
                        assert mine[0]["record"]["devices"] == [], what  # bound to its sender
                        break
                    if not accepted and view["statistics"]["rejected"] > rejected:
                        break
                    await trio.sleep(0.3)
            reached += 1
            if accepted:  # a plan-loop turn (1 s) with the forgery in view
                await trio.sleep(1.2)
    return reached, hostile.peer_id
