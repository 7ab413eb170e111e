"""What crosses the wire between asyncmesh peers: messages, framing, tensor codecs and validation.

Imports nothing else of asyncmesh. See docs/protocol.md for the wire format.
"""
