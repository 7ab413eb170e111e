"""What learns: the GPT split into stages, data, asynchronous optimisers, averaging rules and the mesh simulator.

Imports protocol/ (codecs) only; knows nothing of networks.
"""
