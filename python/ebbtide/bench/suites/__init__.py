"""One module per capability; each registers its suites with ebbtide.bench.registry.suite."""
