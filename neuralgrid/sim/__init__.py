"""The fleet simulator: replays a workload against a fleet under each matching policy."""
