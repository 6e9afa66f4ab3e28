"""Prometheus metrics from controller and workers; Grafana dashboards."""
