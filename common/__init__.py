"""Shared by every plane: config, the wire protocol and its codec, model resolution."""
