"""What the tests share: apps and detectors, proxies, fakes, timings, the repository's paths."""
