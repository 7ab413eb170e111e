"""Who is in the swarm and who does what: identity keys, DHT records, stage choice, next-hop routing, reachability."""
