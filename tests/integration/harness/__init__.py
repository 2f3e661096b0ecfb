"""The tests' own tools do what the other tests rely on: harness, fault proxy, TLS fixture."""
