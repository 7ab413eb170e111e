"""The peer daemon: the composition root that joins the DHT, serves a stage, averages and reports; imports both
protocol/ and trainer/. See docs/layout.md for where each part lives."""
