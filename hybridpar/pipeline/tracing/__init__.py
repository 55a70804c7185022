"""A traced step written out: every rank's events gathered, the Chrome trace, the Gantt chart
and the per-stage bubble table. Imports `schedules` (to simulate the step it measured)."""
