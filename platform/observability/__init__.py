"""Prometheus metrics from controller and workers, target discovery, Grafana dashboards, alerts.

    metrics.py             WorkerMetrics: longrun_train_*, longrun_checkpoint_*, longrun_dynamic_cp_*, ...
    controller_metrics.py  ControllerMetrics: longrun_job_*, faults, restarts, heartbeats, diagnostics
    vocab.py               bounded label values, and why the label is `job`
    server.py              ObservabilityServer: /metrics and /sd (http_sd) on one small HTTP server
    discovery.py           target_groups, write_file_sd
    grafana_model.py       dashboards as dataclasses -> Grafana JSON
    dashboards.py          the overview and performance dashboards; render()
    alerts.py              the alert rules; render_rules()
    queries.py             every shipped PromQL expression; check_queries() against a Prometheus
    grafana.py             `longrun dashboards push`
"""
