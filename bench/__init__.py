"""Benchmarks and GPU scripts, the top floor: a package only so that the import contracts (pyproject.toml) can
check that nothing below imports it. Each script still runs as ``python bench/<name>.py``."""
