"""Deployment artefacts derived from a run config: docker compose files, Helm chart values, health checks."""
