"""What a running worker reports: metrics, health probes, traces."""
