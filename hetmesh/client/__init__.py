"""The client SDK: a light peer that talks to a mesh."""
