"""Pieces every role shares: tensor codec, config schema, server bootstrap, metrics, stubs."""
