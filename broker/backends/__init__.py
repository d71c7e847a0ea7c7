"""Dramatiq's pluggable backends, in Postgres: results and rate limits."""

#: The results backend's namespace, the first part of every key it stores a result under
#: (Dramatiq's default): an operator's retry forgets the result kept for the rejected run.
RESULTS_NAMESPACE = "dramatiq-results"
