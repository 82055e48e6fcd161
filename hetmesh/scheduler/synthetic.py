"""Synthetic heterogeneous meshes for benchmarks, tests and ``hetmesh plan`` demos.

Device classes carry *measured-like* figures (sustained, not datasheet) for a
datacenter GPU, a consumer GPU, a laptop GPU and two CPU-only machines; link
classes span 100 Mbit/s to 100 Gbit/s. Every draw takes an explicit
``random.Random``: the same seed gives the same mesh.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hetmesh.resources import Backend, DeviceProfile, LinkProfile

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class DeviceClass:
    name: str
    backend: Backend
    memory_bytes: int
    matmul_flops: float
    memory_bandwidth_bps: float


@dataclass(frozen=True, slots=True)
class LinkClass:
    name: str
    bandwidth_bps: float  # bytes/s
    rtt_s: float


DEVICE_CLASSES: dict[str, DeviceClass] = {
    "datacenter-gpu": DeviceClass("datacenter-gpu", "cuda", 80 * GIB, 4.0e14, 2.6e12),
    "consumer-gpu": DeviceClass("consumer-gpu", "cuda", 24 * GIB, 1.2e14, 0.85e12),
    "laptop-gpu": DeviceClass("laptop-gpu", "cuda", 8 * GIB, 2.5e13, 2.5e11),
    "cpu-server": DeviceClass("cpu-server", "cpu", 128 * GIB, 1.5e12, 1.0e11),
    "cpu-desktop": DeviceClass("cpu-desktop", "cpu", 32 * GIB, 4.0e11, 3.5e10),
}

LINK_CLASSES: dict[str, LinkClass] = {
    "100mbit": LinkClass("100mbit", 12.5e6, 0.02),
    "1gbit": LinkClass("1gbit", 1.25e8, 1.0e-3),
    "10gbit": LinkClass("10gbit", 1.25e9, 2.0e-4),
    "100gbit": LinkClass("100gbit", 1.25e10, 2.0e-5),
}


def draw_device(
    rng: random.Random, peer_id: str, cls: DeviceClass, device: str = ""
) -> DeviceProfile:
    """A device of ``cls`` with jittered free memory (70-100%) and speeds (±20%)."""
    dev = device or ("cpu" if cls.backend == "cpu" else "cuda:0")
    return DeviceProfile(
        peer_id=peer_id,
        device=dev,
        backend=cls.backend,
        name=cls.name,
        memory_total_bytes=cls.memory_bytes,
        memory_free_bytes=int(cls.memory_bytes * rng.uniform(0.7, 1.0)),
        matmul_flops=cls.matmul_flops * rng.uniform(0.8, 1.2),
        memory_bandwidth_bps=cls.memory_bandwidth_bps * rng.uniform(0.8, 1.2),
    )


def link_pair(a: str, b: str, cls: LinkClass) -> list[LinkProfile]:
    return [
        LinkProfile(src=a, dst=b, rtt_s=cls.rtt_s, bandwidth_bps=cls.bandwidth_bps),
        LinkProfile(src=b, dst=a, rtt_s=cls.rtt_s, bandwidth_bps=cls.bandwidth_bps),
    ]


def random_mesh(
    rng: random.Random, num_devices: int, *, classes: tuple[str, ...] = ()
) -> tuple[list[DeviceProfile], list[LinkProfile]]:
    """``num_devices`` peers of random classes, every pair linked by a random link class."""
    names = classes or tuple(DEVICE_CLASSES)
    devices = [
        draw_device(rng, f"peer-{i:04d}", DEVICE_CLASSES[rng.choice(names)])
        for i in range(num_devices)
    ]
    links: list[LinkProfile] = []
    link_names = tuple(LINK_CLASSES)
    for i in range(num_devices):
        for j in range(i + 1, num_devices):
            cls = LINK_CLASSES[rng.choice(link_names)]
            links += link_pair(devices[i].peer_id, devices[j].peer_id, cls)
    return devices, links


def site_mesh(
    rng: random.Random, num_devices: int
) -> tuple[list[DeviceProfile], list[LinkProfile]]:
    """A large mesh of sites: datacenter racks (multi-GPU peers on 10-100 Gbit) and homes
    (consumer and laptop GPUs, CPUs on 1 Gbit). Links between sites are not listed: the
    planner assumes its default (100 Mbit/s) for them, as for any unmeasured pair.
    """
    devices: list[DeviceProfile] = []
    links: list[LinkProfile] = []
    site = 0
    while len(devices) < num_devices:
        peers: list[str] = []
        if rng.random() < 0.3:
            link_cls = LINK_CLASSES[rng.choice(("10gbit", "100gbit"))]
            for _ in range(rng.randint(1, 4)):
                peer = f"s{site:03d}-p{len(peers):02d}"
                peers.append(peer)
                for g in range(rng.choice((1, 2, 4, 8))):
                    devices.append(
                        draw_device(rng, peer, DEVICE_CLASSES["datacenter-gpu"], f"cuda:{g}")
                    )
        else:
            link_cls = LINK_CLASSES["1gbit"]
            home = ("consumer-gpu", "laptop-gpu", "cpu-desktop", "cpu-server")
            for _ in range(rng.randint(2, 24)):
                peer = f"s{site:03d}-p{len(peers):02d}"
                peers.append(peer)
                devices.append(draw_device(rng, peer, DEVICE_CLASSES[rng.choice(home)]))
        for i, a in enumerate(peers):
            for b in peers[i + 1 :]:
                links += link_pair(a, b, link_cls)
        site += 1
    kept = devices[:num_devices]
    peers_kept = {d.peer_id for d in kept}
    return kept, [x for x in links if x.src in peers_kept and x.dst in peers_kept]


__all__ = [
    "DEVICE_CLASSES",
    "LINK_CLASSES",
    "DeviceClass",
    "LinkClass",
    "draw_device",
    "link_pair",
    "random_mesh",
    "site_mesh",
]
