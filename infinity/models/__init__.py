"""Reference models used by the benchmarks, the main job and the tests (plain PyTorch, no infinity)."""
