"""Helpers of the benchmark scripts in scripts/ (importable because scripts/ is on sys.path when
a script there runs)."""
