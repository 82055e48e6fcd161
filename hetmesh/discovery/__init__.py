"""The libp2p control plane: host, membership, announcements, liveness, profiling."""
