"""Emulated heterogeneous hosts on one Linux machine, for tests and benchmarks.

Network namespaces on a bridge, a ``tc tbf`` rate per link and a CPU quota and
memory limit per host (cgroup v1 or v2) make one machine behave like several
different ones (``netns``, ``cgroups``); ``mesh`` starts real ``hetmesh node
start`` processes on them and talks to the mesh from inside a host (``client``).
Needs root; every entry point says why it cannot run where it cannot. Used by
``tests/integration/testbed/`` and ``bench/testbed.py``/``bench/hetero.py``;
nothing in the node imports it.

``local_mesh`` needs no root: node processes on this machine's loopback, for
``hetmesh demo``, the benches and the tests that run whole nodes.
"""
