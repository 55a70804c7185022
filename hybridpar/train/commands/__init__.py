"""The run-side commands that are not a run: `hybridpar balance` (a config's balance, measured
and written back), `hybridpar schedule` (a schedule's table and timeline) and `hybridpar plot`
(a run's metrics drawn). Imports the run's config, data and metrics; nothing imports it but
the command line.
"""
