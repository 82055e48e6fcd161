"""Three node processes serve SmolLM2 split by the planner, exactly as one process does."""

from __future__ import annotations

import pytest
import trio

from tests.integration.api.api_mesh import WEIGHTS  # the shared mesh's format
from tests.integration.node.mesh_nodes import (
    SECRET,
    encode,
    generate_ids,
    open_probe_peer,
    reference_ids,
    view_of,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.model]

PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
]


@pytest.fixture
def mesh3(shared_mesh3):
    """The three serving nodes, shared with test_api_mesh.py (tests/integration/shared_mesh.py)."""
    return shared_mesh3.nodes


async def test_three_nodes_split_the_model_and_match_the_reference(mesh3, default_model_dir):
    view = await view_of(mesh3[0])
    stages = sorted(
        (s["start"], s["end"], p["peer_id"]) for p in view["peers"] for s in p["record"]["stages"]
    )
    assert len({peer for _, _, peer in stages}) == 3  # every node holds a part
    bounds = [0] + [b for _, b, _ in stages]
    assert [a for a, _, _ in stages] == bounds[:-1]  # contiguous from unit 0 ...
    assert bounds[-1] == 32  # ... to the end: embedding + 30 layers + head
    for i, prompt in enumerate(PROMPTS):
        ids = encode(default_model_dir, prompt)
        gateway = mesh3[i % 3].addr  # requests may enter at any node
        got = await generate_ids(gateway, ids, max_new_tokens=20)
        assert got == reference_ids(default_model_dir, ids, 20, WEIGHTS), prompt


async def test_a_conversation_of_several_turns_over_libp2p(mesh3, default_model_dir):
    from hetmesh.client.mesh import TokenEvent, open_mesh_client
    from hetmesh.partition.text import encode_messages, load_tokenizer

    turns = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    ids = encode_messages(load_tokenizer(default_model_dir), turns)
    got = []
    async with open_mesh_client(mesh3[2].addr, mesh_secret=SECRET) as mesh:
        async for event in mesh.stream(messages=turns, max_new_tokens=12):
            if isinstance(event, TokenEvent) and event.token_id >= 0:
                got.append(event.token_id)
    assert got == reference_ids(default_model_dir, ids, 12, WEIGHTS)


def _stages(view):
    """(start, end) -> the view's peer entry serving it."""
    return {
        (s["start"], s["end"]): p
        for p in view["peers"]
        for s in p["record"]["stages"]
        if s.get("ready")
    }


async def test_bad_input_gets_clear_errors_while_a_generation_carries_on(mesh3, default_model_dir):
    import torch

    from hetmesh.errors import InvalidRequest
    from hetmesh.transport import Activations, Error

    ids = encode(default_model_dir, PROMPTS[0])
    expected = reference_ids(default_model_dir, ids, 40, WEIGHTS)
    stages = _stages(await view_of(mesh3[0]))
    (_, first), (middle_range, middle) = sorted(stages.items())[:2]
    result: dict[str, list[int]] = {}
    async with trio.open_nursery() as nursery:

        async def carry_on() -> None:
            result["ids"] = await generate_ids(mesh3[1].addr, ids, max_new_tokens=40)

        nursery.start_soon(carry_on)
        with pytest.raises(InvalidRequest, match="context"):
            await generate_ids(mesh3[0].addr, [42] * 2100, max_new_tokens=4)
        for bad in (0, -3, 10**9):
            with pytest.raises(InvalidRequest, match="max_new_tokens"):
                await generate_ids(mesh3[2].addr, ids, max_new_tokens=bad)
        with pytest.raises(InvalidRequest, match="vocabulary"):
            await generate_ids(mesh3[2].addr, [5, 10**6], max_new_tokens=4)

        async with open_probe_peer() as probe:
            await probe.dial(first)
            await probe.dial(middle)
            # an activation for a session nobody opened
            await probe.pool.send(
                first["peer_id"],
                Activations(
                    session_id="no-such-session",
                    step=0,
                    positions=(0,),
                    tensors=(torch.tensor([1], dtype=torch.int64),),
                ),
            )
            with trio.fail_after(10):
                reply = await probe.inbox.receive()
            assert isinstance(reply, Error)
            assert "unknown session" in reply.message
            # hidden states of the wrong width and dtype for a session we opened
            opened = await probe.control(
                middle["peer_id"],
                {
                    "op": "open",
                    "session_id": "probe",
                    "start": middle_range[0],
                    "end": middle_range[1],
                    "next_peer": probe.peer_id,
                    "gateway": probe.peer_id,
                    "max_tokens": 8,
                    "sampling": {},
                },
            )
            assert opened["ok"], opened
            for bad_tensor in (torch.zeros(1, 7), torch.zeros(1, 576, dtype=torch.int64)):
                await probe.pool.send(
                    middle["peer_id"],
                    Activations(session_id="probe", step=0, positions=(0,), tensors=(bad_tensor,)),
                )
                with trio.fail_after(10):
                    reply = await probe.inbox.receive()
                assert isinstance(reply, Error)
                assert "hidden states" in reply.message
            closed = await probe.control(middle["peer_id"], {"op": "close", "session_id": "probe"})
            assert closed["ok"]
            unknown = await probe.control(middle["peer_id"], {"op": "frobnicate"})
            assert unknown["ok"] is False
            assert "unknown session operation" in unknown["message"]
    assert result["ids"] == expected


# A node's RSS grows for its first ~50 sessions (allocator and runtime warm-up: +4 to
# +9 % of ~700 MB, in steps), then more slowly but not evenly: 30 sessions after the
# warm-up added up to +19 and +22 MB (~3 %) to a node in some runs, a few hundred KB
# in others. So the bound applies once warm, with room for that: MEASURED more
# sessions may add GROWTH_BOUND (8 %, ~55 MB) to a node, which still fails on a leak
# of ~2 MB a session. KV accounting, the leak a stage is most likely to have, is
# checked exactly: every stage's KV in use is back to 0.
WARM_UP = 50
MEASURED = 30
GROWTH_BOUND = 0.08


async def test_no_leak_after_eighty_sessions(mesh3, default_model_dir):
    import random

    import psutil

    rng = random.Random(7)
    # prompts of 3 to ~50 tokens (each a prefix of the others: the prefix cache takes part)
    # and 1 to 8 new tokens: the leaks looked for are per session, and at twice these
    # lengths this was the suite's heaviest test (31 s against 24 s now, quiet)
    base = encode(default_model_dir, "Write a short poem about rivers and the sea. " * 4)
    jobs = [
        (base[: rng.randint(3, len(base))], rng.randint(1, 8)) for _ in range(WARM_UP + MEASURED)
    ]
    procs = [psutil.Process(n.proc.pid) for n in mesh3]

    async def run(batch):
        async with trio.open_nursery() as nursery:
            for prompt, n in batch:
                nursery.start_soon(
                    lambda p=prompt, k=n: generate_ids(mesh3[len(p) % 3].addr, p, max_new_tokens=k)
                )

    def rss() -> list[int]:
        return [p.memory_info().rss for p in procs]

    # four at a time: the stages budget KV cache for four concurrent sessions
    for i in range(0, WARM_UP, 4):
        await run(jobs[i : min(i + 4, WARM_UP)])
    warm = rss()
    for i in range(WARM_UP, WARM_UP + MEASURED, 4):
        await run(jobs[i : min(i + 4, WARM_UP + MEASURED)])
    after = rss()

    async def kv_in_use() -> int:
        view = await view_of(mesh3[0])
        return sum(p["record"]["load"]["kv_bytes_used"] for p in view["peers"])

    for _ in range(30):  # announcements carry the figure about once a second
        if await kv_in_use() == 0:
            break
        await trio.sleep(0.5)
    else:
        raise AssertionError(f"KV bytes still in use: {await kv_in_use()}")
    for before, now in zip(warm, after, strict=True):
        assert now <= before * (1 + GROWTH_BOUND), (before, now)


async def _stranger(
    port: int, source: str, opening: bytes, connected: list[int], hold: trio.Event
) -> None:
    """One connection from a stranger: ``opening`` (maybe nothing), then silence."""
    sock = trio.socket.socket()
    with sock:
        try:
            await sock.bind((source, 0))
            await sock.connect(("127.0.0.1", port))
            if opening:
                await sock.send(opening)
            if len(opening) > 16:  # a data frame's head: then stream its payload
                chunk = bytes(1 << 20)
                for _ in range(32):
                    await sock.send(chunk)
        except OSError:
            pass  # refused or reset at once: what a capped listener may do
        connected.append(port)
        await hold.wait()


async def test_two_hundred_strangers_cost_no_memory_and_stall_no_generation(
    mesh3, default_model_dir
):
    """200 unauthenticated connections to a stage node's data-plane and probe ports:
    silent, a few bytes, or a 4 GiB frame head followed by 32 MiB of its payload.
    Its RSS stays within 50 MiB of its baseline and a generation through it
    meanwhile matches the reference (before the fix: +483 MiB)."""
    import msgpack
    import psutil

    from hetmesh.transport.frames import MAGIC, PREFIX, VERSION, Activations

    target = mesh3[1]
    proc = psutil.Process(target.proc.pid)
    view = await view_of(target)
    (me,) = [p for p in view["peers"] if p["peer_id"] == target.addr.rsplit("/", 1)[-1]]
    probe_port = me["record"]["probe_port"]
    libp2p_port = int(target.addr.split("/")[4])
    listening = {
        c.laddr.port: c.fd
        for c in proc.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port not in (probe_port, libp2p_port)
    }
    # the data plane's listener opens at start-up; a torchdist link's rendezvous store
    # (transport/torchdist.py) may listen too, later, so on a higher descriptor
    data_port = min(listening, key=lambda port: listening[port])

    ids = encode(default_model_dir, "The capital of France is")
    expected = reference_ids(default_model_dir, ids, 16, WEIGHTS)
    assert await generate_ids(mesh3[0].addr, ids, max_new_tokens=16) == expected  # warm
    baseline = proc.memory_info().rss

    header = msgpack.packb(["s", 0, [0], [["float32", [1 << 30], 4 << 30]]])
    huge = PREFIX.pack(MAGIC, VERSION, Activations.TAG, len(header), 4 << 30) + header
    openings = [b"", b"HM\x01", huge]
    hold = trio.Event()
    connected: list[int] = []
    got: list[int] = []
    async with trio.open_nursery() as nursery:
        for i in range(200):
            port = data_port if i % 2 else probe_port
            source = f"127.0.0.{2 + i % 5}"
            nursery.start_soon(_stranger, port, source, openings[i % 3], connected, hold)
        with trio.fail_after(60):  # all 200 are in before the generation starts
            while len(connected) < 200:  # noqa: ASYNC110 - the strangers' own tasks count
                await trio.sleep(0.01)
        with trio.fail_after(240):
            got = await generate_ids(mesh3[0].addr, ids, max_new_tokens=16)
        grown = proc.memory_info().rss - baseline
        hold.set()
    print(
        f"stage node RSS {baseline / 2**20:.0f} MiB, +{grown / 2**20:.1f} MiB under 200 strangers"
        f" (data port {data_port} of listeners {listening}, probe {probe_port})"
    )
    assert got == expected
    assert grown < 50 << 20, f"RSS grew {grown / 2**20:.0f} MiB"
    assert target.proc.poll() is None
    # and the strangers did not cost it the mesh: a generation after them is fine too
    assert await generate_ids(mesh3[0].addr, ids, max_new_tokens=16) == expected


async def test_a_member_off_the_route_cannot_feed_close_or_cancel_a_session(
    mesh3, default_model_dir
):
    """Over real links: one member opens a session on the first stage; another, with
    its own data-plane link, feeds, closes and cancels it and is refused each time;
    the owner's session is untouched (it still computes, and only it closes it)."""
    import torch

    from hetmesh.transport import Activations, Cancel, Error

    (_, first), *_ = sorted(_stages(await view_of(mesh3[0])).items())
    (start, end) = next(
        (s["start"], s["end"]) for s in first["record"]["stages"] if s["start"] == 0
    )
    stage = first["peer_id"]
    tokens = torch.tensor([1, 504, 3458], dtype=torch.int64)
    async with open_probe_peer() as owner, open_probe_peer() as intruder:
        await owner.dial(first)
        await intruder.dial(first)
        opened = await owner.control(
            stage,
            {
                "op": "open",
                "session_id": "owned",
                "start": start,
                "end": end,
                "next_peer": owner.peer_id,
                "gateway": owner.peer_id,
                "max_tokens": 8,
                "sampling": {},
            },
        )
        assert opened["ok"], opened
        feed = Activations(session_id="owned", step=0, positions=(0, 1, 2), tensors=(tokens,))
        for frame in (feed, Cancel(session_id="owned")):
            await intruder.pool.send(stage, frame)
            with trio.fail_after(30):
                reply = await intruder.inbox.receive()
            assert isinstance(reply, Error), reply
            assert reply.session_id == "owned"
            assert owner.peer_id in reply.message  # names whose session it is
        closed = await intruder.control(stage, {"op": "close", "session_id": "owned"})
        assert closed["ok"] is False
        assert "belongs to gateway" in closed["message"]
        # untouched: the owner's first step still starts at position 0 and computes
        await owner.pool.send(stage, feed)
        with trio.fail_after(60):
            out = await owner.inbox.receive()
        assert isinstance(out, Activations), out
        assert out.positions == (0, 1, 2)
        assert tuple(out.tensors[0].shape) == (3, 576)
        closed = await owner.control(stage, {"op": "close", "session_id": "owned"})
        assert closed["ok"], closed


async def test_a_hostile_member_cannot_replan_or_stop_the_mesh(mesh3, default_model_dir):
    """A member with the secret forges plans and absurd announcements while the mesh serves:
    every generation equals the reference, no node dies, no node's plan changes."""
    from tests.integration.node.hostile import attack

    ids = encode(default_model_dir, PROMPTS[1])
    expected = reference_ids(default_model_dir, ids, 16, WEIGHTS)
    before = {p["peer_id"]: p["record"]["extra"] for p in (await view_of(mesh3[0]))["peers"]}
    assert len(before) == 3
    boss = min(before)
    assert before[boss]["plan_signature"]["signer"] == boss
    got: list[list[int]] = []
    async with trio.open_nursery() as nursery:
        done = trio.Event()

        async def serve_meanwhile() -> None:
            while not done.is_set():
                got.append(await generate_ids(mesh3[1].addr, ids, max_new_tokens=16))

        nursery.start_soon(serve_meanwhile)
        reached, hostile = await attack(mesh3, before)
        done.set()
    assert reached >= 10, reached  # every phase was heard (or refused) by the mesh
    assert got
    assert all(g == expected for g in got), got
    assert all(n.proc.poll() is None for n in mesh3)  # every node alive
    for node in mesh3:  # each saw a forged plan and said it ignored it
        assert f"ignoring the plan {hostile} announces" in node.log()
    view = await view_of(mesh3[0])
    after = {p["peer_id"]: p for p in view["peers"] if p["peer_id"] in before}
    assert {p["health"] for p in after.values()} <= {"self", "alive"}
    logs = "".join(n.log() for n in mesh3)
    for peer, extra in before.items():  # each node still follows the plan it did ...
        now = after[peer]["record"]["extra"]
        assert now["plan_signature"]["signer"] == boss
        if now["plan"] != extra["plan"]:
            # ... or one its coordinator made on its own evidence: on a loaded machine a
            # stage's served steps can fall far behind its claim, and the coordinator
            # replans on the measured times (logged). Never a plan with the hostile in it.
            assert "on measured step times" in logs, (peer, extra["plan"], now["plan"])
            assert hostile not in str(now["plan"]), now["plan"]


async def test_the_prefix_cache_skips_shared_prefixes_and_keeps_the_reference_output(
    mesh3, default_model_dir
):
    """Two requests with one long system prompt, then the first conversation's next
    turn: the later ones start their prefill after the blocks every stage holds cached,
    and every output still equals the single-process reference."""
    gateway = mesh3[1]
    system = encode(
        default_model_dir,
        "You are a patient assistant. You explain things to children in short, "
        "friendly sentences, and you give one small example with every answer. "
        "You never use difficult words, and you end with a question for the child.",
    )
    first = system + encode(default_model_dir, " Why is the sky blue?")
    second = system + encode(default_model_dir, " What makes a rainbow?")
    assert len(system) >= 32

    async def skipped() -> int:
        view = await view_of(gateway)
        me = next(p for p in view["peers"] if p["health"] == "self")
        return int(me["record"]["extra"]["gateway"].get("prefix_tokens_skipped", 0))

    async def skipped_at_least(count: int) -> int:
        for _ in range(60):  # announcements carry the counter about once a second
            now = await skipped()
            if now >= count:
                return now
            await trio.sleep(0.5)
        raise AssertionError(f"the gateway skipped {now} prompt tokens, expected {count}")

    before = await skipped()
    got_first = await generate_ids(gateway.addr, first, max_new_tokens=10)
    assert got_first == reference_ids(default_model_dir, first, 10, WEIGHTS)
    got_second = await generate_ids(gateway.addr, second, max_new_tokens=10)
    assert got_second == reference_ids(default_model_dir, second, 10, WEIGHTS)
    after_second = await skipped_at_least(before + len(system) // 16 * 16)

    # the next turn: the first request, its answer (all but the last token were fed)
    # and a new question; the stages named those blocks when the first session closed
    turn = first + got_first + encode(default_model_dir, " And why is it red at sunset?")
    got_turn = await generate_ids(gateway.addr, turn, max_new_tokens=10)
    assert got_turn == reference_ids(default_model_dir, turn, 10, WEIGHTS)
    await skipped_at_least(after_second + (len(first) + len(got_first) - 1) // 16 * 16)

    # `hetmesh status` shows every stage's pool and its prefix hits
    from hetmesh.cli.status_view import summarize

    for _ in range(60):
        rows = summarize(await view_of(gateway))["kv"]
        if len(rows) >= 3 and all(r["prefix_hit_rate"] > 0 for r in rows):
            break
        await trio.sleep(0.5)
    else:
        raise AssertionError(f"status shows no prefix hits on some stage: {rows}")
    assert all(r["blocks_free"] + r["blocks_in_use"] > 0 for r in rows)
