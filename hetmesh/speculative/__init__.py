"""Speculative decoding: several tokens per trip through a session's pipeline.

A gateway asks a :class:`~hetmesh.speculative.drafter.Drafter` for up to ``k``
tokens that are likely to follow a session's history and sends them with the
session's last token as one step; every stage computes the ``k + 1`` positions
in one forward, and the last stage keeps the longest prefix of the drafts that
its own choices agree with, plus its own next token. A
:class:`~hetmesh.speculative.drafter.Budget` picks ``k`` from what it measures.

Pure: nothing here imports trio or libp2p.
"""
