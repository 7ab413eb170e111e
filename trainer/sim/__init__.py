"""The mesh simulator: many StageWorkers in one process with exact delays, its methods, presets, reports, clocks."""
