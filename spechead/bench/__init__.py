"""Benchmarks: suites (prompt files), methods (the grammar), runners, the harness that runs them side by side,
the statistics and speedup model, the 8B projection, the report, the coverage study, the oracle replay and the
head micro-benchmark. The command lines live in ``spechead.cli``."""
