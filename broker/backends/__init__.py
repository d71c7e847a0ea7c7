"""Dramatiq's pluggable backends, in Postgres: results and rate limits."""
