"""The node daemon: one trio nursery tree wiring discovery, scheduler, transport and stages."""
