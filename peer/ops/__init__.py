"""What an operator sees and runs: metrics, the status/metrics HTTP server, dashboards, logging, child processes."""
