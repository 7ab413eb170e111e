"""The data-parallel axis over the network: the keyed part exchange, background sparse rounds and the sync barrier."""
