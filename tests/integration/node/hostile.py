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
import dataclasses
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
    pool: Any = None  # its data plane's links (``open_hostile_member(plane=True)``)
    gateway: Any = None  # where its links' token and error frames go (a Gateway)

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
    bootstrap: str,
    above: str,
    model: str,
    *,
    below: bool = False,
    secret: str = SECRET,
    plane: bool = False,
) -> AsyncIterator[Hostile]:
    """A member joined through ``bootstrap`` whose peer id sorts above ``above`` (with
    ``below``: below it, a ground low id). With ``plane``: it also runs a data plane
    (tcp links only, so a test can write raw bytes on one) and takes links from stages."""
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
        hostile = Hostile(discovery, key_pair)
        async with contextlib.AsyncExitStack() as stack:
            nursery = await stack.enter_async_context(trio.open_nursery())
            if plane:
                hostile.pool = await _open_links(stack, hostile, nursery)
            await nursery.start(discovery.serve)
            yield hostile
            nursery.cancel_scope.cancel()


async def _open_links(stack: contextlib.AsyncExitStack, hostile: Hostile, nursery: Any) -> Any:
    """A data plane and link pool on the member's host; frames go to its gateway."""
    from hetmesh.node.link_pool import DATAPLANE_PROTOCOL, LinkPool
    from hetmesh.transport import DataPlaneConfig, open_data_plane

    host = hostile.discovery.host
    config = DataPlaneConfig(peer_id=hostile.peer_id, backends=("tcp",))
    data_plane = await stack.enter_async_context(open_data_plane(config))

    def dispatch(peer: str, link: Any, frame: Any) -> None:
        if hostile.gateway is not None:
            hostile.gateway.on_frame(frame, peer)
        if link is not None:
            link.release(frame)

    pool = LinkPool(host=host, plane=data_plane, dispatch=dispatch, nursery=nursery)
    hostile.discovery.add_handler(DATAPLANE_PROTOCOL, pool.handle_incoming)
    return pool


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


# -- the gains of issue 45: rumors, a poisoned prefix, stalled shards, a huge frame --------


async def connect(hostile: Hostile, peer: str) -> None:
    """Make sure the member holds a connection to ``peer`` (a node may have hung up an
    idle one, and libp2p's peer store may not hold the address its table does); a
    handshake a starved node answers late is tried again."""
    from libp2p.peer.id import ID

    from hetmesh.discovery.host import dial
    from hetmesh.errors import AuthenticationFailed, ConnectTimeout

    host = hostile.discovery.host
    with trio.fail_after(120):
        while ID.from_base58(peer) not in host.get_network().connections:
            info = hostile.discovery._info_of(peer)
            assert info is not None, f"the member knows no address of {peer}"
            assert info.addrs, f"the member knows no address of {peer}"
            with contextlib.suppress(AuthenticationFailed, ConnectTimeout):
                await dial(host, info, timeout_s=10)


async def gossip(hostile: Hostile, target: str, *updates: Any) -> None:
    """One GOSSIP message of ``updates`` from the member to ``target``, as altered code
    could write it on the membership protocol."""
    from libp2p.custom_types import TProtocol
    from libp2p.peer.id import ID

    from hetmesh.discovery import wire
    from hetmesh.discovery.membership_types import Kind, Message
    from hetmesh.discovery.membership_wire import MEMBERSHIP_PROTOCOL, encode_message

    me = hostile.discovery.table
    message = Message(
        Kind.GOSSIP, hostile.peer_id, target, me.boot_id, me.incarnation, me.record_seq
    )
    payload = encode_message(dataclasses.replace(message, updates=updates))
    await connect(hostile, target)
    stream = await hostile.discovery.host.new_stream(
        ID.from_base58(target), [TProtocol(MEMBERSHIP_PROTOCOL)]
    )
    try:
        await wire.write_frame(stream, payload)
    finally:
        with contextlib.suppress(Exception):
            await stream.close()


def made_up_peer_ids(count: int) -> list[str]:
    """``count`` peer ids of real form that nobody holds the keys of."""
    from libp2p import generate_new_ed25519_identity
    from libp2p.peer.id import ID

    return [
        ID.from_pubkey(generate_new_ed25519_identity().public_key).to_base58() for _ in range(count)
    ]


def hops_of(plan: dict[str, Any]) -> list[Any]:
    """The first pipeline of a plan's wire map, as a gateway's hops."""
    from hetmesh.node.hop import Hop

    stages = plan["pipelines"][0]["stages"]
    return [Hop(str(s["peer_id"]), int(s["start"]), int(s["end"])) for s in stages]


async def poison_prefix(
    hostile: Hostile, hops: list[Any], victim: list[int], text: list[int], tokens: int
) -> list[int]:
    """Run ``text`` through ``hops`` as a gateway (our own Gateway) that names its
    blocks, on open and on close, by ``victim``'s chained hashes: every stage then
    caches the member's KV under names a victim's prompt has. Its tokens."""
    from contextlib import aclosing

    from hetmesh.discovery.rpc import call
    from hetmesh.node import gateway as gateway_module
    from hetmesh.node.control import SESSION_PROTOCOL, Reply
    from hetmesh.partition.sampling import SamplingParams

    assert hostile.pool is not None, "open the member with plane=True"
    real = gateway_module.block_hashes

    def forged(history: Any, block_tokens: int = 16) -> list[int]:
        if list(history[: len(text)]) == text:
            history = [*victim, *history[len(text) :]]
        return real(history, block_tokens)

    async def control(peer: str, request: Any) -> Any:
        raw = await call(
            hostile.discovery.host, peer, SESSION_PROTOCOL, request.to_wire(), timeout_s=30
        )
        return Reply.from_wire(raw)

    async def choose(*_: Any) -> list[Any]:
        for hop in hops:
            await connect(hostile, hop.peer_id)
        return hops

    async def ping(_peer: str) -> bool:
        return True

    hostile.gateway = gateway_module.Gateway(
        peer_id=hostile.peer_id,
        control=control,
        send=hostile.pool.send,
        choose=choose,
        ping=ping,
        eos_token_ids=frozenset(),
        max_context=512,
        split_prefill=False,
    )
    out: list[int] = []
    gateway_module.block_hashes = forged  # type: ignore[attr-defined]
    try:
        params = SamplingParams(max_new_tokens=tokens)
        async with aclosing(hostile.gateway.generate(text, params)) as stream:
            async for token in stream:
                out.append(token)
    finally:
        gateway_module.block_hashes = real  # type: ignore[attr-defined]
        hostile.gateway = None
    return out


async def refused_huge_frame(hostile: Hostile, peer: str) -> None:
    """Open a tcp link to ``peer`` and write a KVBlock's prefix and well-formed header
    declaring one float32 tensor of 4 GiB (what the wire allows; a session nobody
    opened), and never its payload; return once ``peer`` has closed the link."""
    import msgpack

    from hetmesh.errors import TransportError
    from hetmesh.transport.frames import MAGIC, PREFIX, VERSION, KVBlock

    assert hostile.pool is not None, "open the member with plane=True"
    with trio.fail_after(120):
        while True:  # a stream that a busy connection fails to open is opened again
            await connect(hostile, peer)
            try:
                link = await hostile.pool.get(peer)
                break
            except TransportError:
                await trio.sleep(0.5)
    assert link.backend == "tcp", link.backend
    header = msgpack.packb(["hostile", 0, 0, [["float32", [1 << 30], 4 << 30]]])
    raw = PREFIX.pack(MAGIC, VERSION, KVBlock.TAG, len(header), 4 << 30) + header
    data = bytes(link._sealer.seal_frame(raw, [], len(raw))) if link.encrypted else raw
    await trio.to_thread.run_sync(link.sock.sendall, data)
    with trio.fail_after(60):
        while peer in hostile.pool.links():  # noqa: ASYNC110 - the link's reader drops it
            await trio.sleep(0.1)


@contextlib.asynccontextmanager
async def stalled_shard_requests(
    hostile: Hostile, peer: str, manifest_id: str, count: int
) -> AsyncIterator[None]:
    """``count`` shard requests to ``peer`` held open: the first asks for the largest
    tensor and stops reading after its first bytes, the others never send a request.
    All reset on exit."""
    import json

    from libp2p.custom_types import TProtocol
    from libp2p.peer.id import ID

    from hetmesh.discovery import wire
    from hetmesh.shards.fetch import SHARDS_PROTOCOL, request_bytes
    from hetmesh.shards.manifest import Manifest

    await connect(hostile, peer)
    raw = await request_bytes(
        hostile.discovery, peer, manifest_id, "manifest", "", max_bytes=1 << 20
    )
    assert raw is not None, "the holder answered no manifest"
    manifest = Manifest.from_json(json.loads(raw))
    big = max(manifest.tensors, key=lambda t: t.nbytes)
    host = hostile.discovery.host
    streams = []
    try:
        for i in range(count):
            stream = await host.new_stream(ID.from_base58(peer), [TProtocol(SHARDS_PROTOCOL)])
            streams.append(stream)
            if i == 0:
                request = {"manifest": manifest_id, "kind": "tensor", "name": big.name}
                await wire.write_frame(stream, wire.encode(request))
                await stream.read(1024)  # its reply has begun; then nothing is read
        yield
    finally:
        for stream in streams:
            with contextlib.suppress(Exception):
                await stream.reset()
