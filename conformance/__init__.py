"""dsv4.conformance: cases, goldens, tolerances, runner, reports and the dsv4-conformance CLI."""
