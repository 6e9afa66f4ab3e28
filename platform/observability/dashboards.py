"""longrun's Grafana dashboards: the operator overview and the performance drill-down.

    longrun dashboards render            # writes deploy/grafana/dashboards/*.json
    longrun dashboards push --grafana-url http://grafana:3000 --prometheus-url http://prometheus:9090

Every query selects `job=~"$job"` (and `rank=~"$rank"` where a rank is meaningful): the
variables' "All" value is the regex `.+`, and several picked values become `(a|b)`. See
vocab.py for why the label is `job`. tests/test_observability_* evaluate every query here
against a real Prometheus scraping the real exporters, and check the JSON in deploy/ is a
fresh render.
"""

from __future__ import annotations

import json
from pathlib import Path

from longrun.observability.grafana_model import (
    DEFAULT_DATASOURCE_UID,
    Annotation,
    Dashboard,
    Panel,
    Row,
    Target,
    Variable,
)

DEFAULT_OUT_DIR = Path("deploy/grafana/dashboards")
RATE = "$__rate_interval"
TOKENS_PER_S = "suffix: tok/s"  # Grafana has no token unit; a custom suffix
STRAGGLER_FACTOR = 1.5  # health.straggler_factor's default: the monitor's own line


def sel(metric: str, *, rank: bool = False, **matchers: str) -> str:
    """`metric{job=~"$job"[,rank=~"$rank"][,k="v"...]}`; a value "!v" matches k!="v"."""
    parts = ['job=~"$job"'] + (['rank=~"$rank"'] if rank else []) + [
        f'{k}!="{v[1:]}"' if v.startswith("!") else f'{k}="{v}"' for k, v in matchers.items()]
    return f"{metric}{{{','.join(parts)}}}"


def mean(histogram: str, by: str, window: str = RATE, *, rank: bool = True) -> str:
    """Mean observation of a histogram over `window`, per `by`."""
    return (f"sum by ({by}) (rate({sel(histogram + '_sum', rank=rank)}[{window}])) / "
            f"sum by ({by}) (rate({sel(histogram + '_count', rank=rank)}[{window}]))")


def quantile(q: float, histogram: str, by: str = "job", *, rank: bool = True) -> str:
    return (f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({sel(histogram + '_bucket', rank=rank)}[{RATE}])))")


VARIABLES = (
    Variable("job", "Job", "longrun_job_attempt", "longrun jobs with a live controller"),
    Variable("rank", "Rank", 'longrun_train_step{job=~"$job"}', "ranks of the selected jobs"),
)
ANNOTATIONS = (
    Annotation("Restarts", 'sum by (job, cause) (changes(longrun_job_restarts_total{job=~"$job"}[1m])) > 0',
               "red", "restart", "{{job}}: restart after {{cause}}", "job,cause"),
    Annotation("Faults", 'sum by (job, kind) (changes(longrun_job_faults_total{job=~"$job"}[1m])) > 0',
               "orange", "fault", "{{job}}: {{kind}}", "job,kind"),
    # An elastic job (recovery.min_nodes) continuing on fewer nodes, or back at its configured size.
    Annotation("Resizes",
               'sum by (job, direction) (changes(longrun_elastic_resizes_total{job=~"$job"}[1m])) > 0',
               "blue", "resize", "{{job}}: {{direction}}", "job,direction"),
)
_RUNNING_HINT = "Empty until the job's controller has been scraped."


def overview() -> Dashboard:
    step = "longrun_train_step_duration_seconds"
    return Dashboard(
        uid="longrun-overview", title="longrun / overview",
        description="Is the job training, how fast, and what went wrong. Restarts, faults and "
                    "elastic resizes are marked on every time series.",
        variables=VARIABLES, annotations=ANNOTATIONS,
        items=(
            Row("Job"),
            Panel("State", (Target(sel("longrun_job_state") + " == 1", "{{job}}: {{longrun_job_state}}",
                                   instant=True),), kind="stat", width=6, height=4, text_mode="name",
                  description="The controller's state. RECOVERING is a restart in progress; FAILED means "
                              "the restart budget is spent or the fault cannot be recovered. "
                              + _RUNNING_HINT),
            Panel("Attempt", (Target(f"max by (job) ({sel('longrun_job_attempt')})", "{{job}}",
                                     instant=True),),
                  kind="stat", width=3, height=4, description="0 is the first run; each restart adds one."),
            Panel("Progress", (Target(f"max by (job) ({sel('longrun_job_step')}) / "
                                      f"max by (job) ({sel('longrun_job_planned_steps')} > 0)", "{{job}}",
                                      instant=True),),
                  kind="stat", unit="percentunit", width=4, height=4,
                  description="Newest step reported over the steps configured."),
            Panel("Restarts", (Target(f"sum by (job) ({sel('longrun_job_restarts_total')})", "{{job}}",
                                      instant=True),),
                  kind="stat", width=4, height=4, thresholds=((None, "green"), (1, "orange"), (4, "red")),
                  description="Restarts since the controller started (all causes)."),
            Panel("Evicted nodes", (Target(f"max by (job) ({sel('longrun_job_evicted_nodes')})", "{{job}}",
                                           instant=True),),
                  kind="stat", width=3, height=4, thresholds=((None, "green"), (1, "orange")),
                  description="Nodes the controller excluded after repeated faults or failed diagnostics."),
            Panel("Workers up", (Target(f"sum by (job) ({sel('up', role='worker')})", "{{job}}",
                                        instant=True),),
                  kind="stat", width=4, height=4,
                  description="Worker metrics endpoints Prometheus scraped successfully (found through the "
                              "controller's /sd). Fewer than the world size: a worker is gone or "
                              "unreachable."),
            Row("Goodput"),
            Panel("Goodput", (Target(f"max by (job) ({sel('longrun_goodput_ratio')})", "{{job}}",
                                     instant=True),),
                  kind="stat", unit="percentunit", width=6,
                  thresholds=((None, "red"), (0.8, "orange"), (0.95, "green")),
                  description="Share of the job's wall time that trained steps which count: productive "
                              "seconds (from the workers' step ledger) over the wall time by the clock "
                              "since the job's first controller started. The stacked panel beside it "
                              "says where the rest went."),
            Panel("Time by bucket", (Target(f"sum by (bucket) ({sel('longrun_job_seconds_total')})",
                                            "{{bucket}}"),),
                  unit="s", width=18, stack=True,
                  description="The job's wall time so far, every second in one bucket: productive, redone "
                              "(steps trained again after a fault), startup, restore by source, checkpoint, "
                              "snapshot, validation and data-wait blocking, detection (fault to "
                              "declaration), backoff, controller down (no controller after one died), "
                              "waiting for nodes, preemption save, shutdown. A running attempt is accounted "
                              "up to its newest step."),
            Row("Training"),
            Panel("Throughput", (Target(f"sum by (job) (rate({sel('longrun_train_tokens_total', rank=True)}"
                                        f"[{RATE}]))", "{{job}}"),), unit=TOKENS_PER_S, width=8,
                  description="Tokens trained per second, all selected ranks together."),
            Panel("MFU", (Target(f"avg by (job) ({sel('longrun_train_mfu_ratio', rank=True)})", "{{job}}"),),
                  unit="percentunit", width=8,
                  description="Model FLOPs utilisation (needs a peak-FLOPs figure for the device; empty "
                              "without one). A drop without a restart: stragglers, data stalls, thermal."),
            Panel("Loss", (Target(f"avg by (job) ({sel('longrun_train_loss', rank=True)})", "{{job}}"),
                           Target(f"avg by (job) ({sel('longrun_validation_loss', rank=True)})",
                                  "{{job}} validation")),
                  width=8, description="Training loss of the last step (NaN steps are not exported) and "
                                       "the last validation pass's loss on held-out data (validation "
                                       "section; none when it is off)."),
            Panel("Step time", (Target(quantile(0.5, step), "{{job}} p50"), Target(quantile(0.95, step),
                                                                                "{{job}} p95")),
                  unit="s", width=12, description="Wall time per optimizer step, data wait included."),
            Panel("Steps", (Target(f"max by (job) ({sel('longrun_job_step')})", "{{job}} step"),
                            Target(f"max by (job) ({sel('longrun_job_planned_steps')})", "{{job}} planned")),
                  width=12, description="A step counter that falls back is a restart resuming from the "
                                        "newest checkpoint."),
            Panel("Slower than the median rank allows",
                  (Target(f"max by (job) ({sel('longrun_straggler_slowdown_ratio')})", "{{job}}"),),
                  unit="percentunit", width=12, thresholds=((None, "green"), (0.1, "orange"), (0.3, "red")),
                  description="How much slower the job steps than it would with every rank at the median "
                              "step time: a synchronous job runs at its slowest rank's pace. The panel "
                              "beside it says why; `longrun status` names the nodes, stages and ranks."),
            Panel("Slow ranks by cause",
                  (Target(f"sum by (blame) ({sel('longrun_slow_ranks')})", "{{blame}}"),),
                  unit="none", width=12, stack=True,
                  description="Ranks slower than health.straggler_factor x the median, by what they are "
                              "blamed on: node (its node's ranks slow together: evicted when "
                              "recovery.evict_stragglers is on and a spare node or an elastic shrink can "
                              "take its place), data (its micro-batches cost more in the trainer's cost "
                              "model), stage (an uneven pipeline stage), rank (slow alone with normal data: "
                              "a suspect GPU or process). Only node is acted on."),
            Row("Faults and recovery"),
            Panel("Restarts by cause", (Target(f"sum by (cause) (increase({sel('longrun_job_restarts_total')}"
                                               "[$__range]))", "{{cause}}", instant=True),),
                  kind="bargauge", width=8,
                  description="Restarts in the time range, by the fault that caused them."),
            Panel("Faults by kind", (Target(f"sum by (kind) (increase({sel('longrun_job_faults_total')}"
                                            "[$__range]))", "{{kind}}", instant=True),),
                  kind="bargauge", width=8,
                  description="Faults detected in the time range, acted upon or only reported (stragglers)."),
            Panel("Detection and recovery time",
                  (Target(mean("longrun_fault_detection_seconds", "job", "$__range", rank=False),
                          "{{job}} detection", instant=True),
                   Target(mean("longrun_recovery_duration_seconds", "job", "$__range", rank=False),
                          "{{job}} recovery", instant=True)),
                  kind="stat", unit="s", width=8,
                  description="Mean over the time range: from a fault to its detection, and from detection "
                              "to training again. No value: no fault in the range."),
            Panel("Steps lost per fault",
                  (Target(f"max by (job) ({sel('longrun_job_last_fault_steps_lost')})", "{{job}} last fault"),
                   Target(f"sum by (job) (increase({sel('longrun_job_steps_lost_total')}[$__range]))",
                          "{{job}} in the range")),
                  unit="none", width=8,
                  description="Steps of training redone after faults: the steps since the checkpoint a "
                              "restart resumed from. 0 is the goal (memory snapshots, preemption saves)."),
            Panel("Restore time by source",
                  (Target(f"max by (source) ({sel('longrun_checkpoint_restore_seconds', rank=True)})",
                          "{{source}}"),),
                  unit="s", width=8,
                  description="How long the slowest rank took to restore at the start of an attempt, by "
                              "where it read the state: storage, or a peer's memory."),
            Panel("Job size", (Target(f"max by (job) ({sel('longrun_job_nodes')})", "{{job}} nodes"),
                               Target(f"max by (job) ({sel('longrun_job_world_size')})", "{{job}} ranks")),
                  unit="none", width=8,
                  description="Nodes and ranks the job runs with. An elastic job (recovery.min_nodes) that "
                              "loses a node it cannot replace within recovery.shrink_after_s continues on "
                              "fewer, with the same global batch, and grows back at a checkpoint once the "
                              "configured nodes can be placed again (the Resizes annotation marks each)."),
            Panel("Heartbeat age by rank",
                  (Target(f"time() - max by (rank, node) "
                          f"({sel('longrun_heartbeat_timestamp_seconds', rank=True)})",
                          "rank {{rank}} ({{node}})"),),
                  unit="s", width=24, thresholds=((None, "green"), (30, "red")),
                  description="Seconds since each rank's newest heartbeat, as the controller sees it. Beats "
                              "continue during long collectives; a growing age is a dead or frozen process."),
            Row("Checkpoints"),
            Panel("Age of the last committed checkpoint",
                  (Target("time() - max by (job) "
                          f"({sel('longrun_checkpoint_last_commit_timestamp_seconds')})", "{{job}}"),),
                  unit="s", width=8, thresholds=((None, "green"), (3600, "red")),
                  description="Work a restart now would redo. Saw-tooth: each drop is a commit."),
            Panel("Last committed step", (Target(f"max by (job) ({sel('longrun_checkpoint_last_step')})",
                                                 "{{job}}", instant=True),),
                  kind="stat", width=4),
            Panel("Training stall per checkpoint",
                  (Target(f"max by (job) ({mean('longrun_checkpoint_blocking_seconds', 'job, rank', '15m')})",
                          "{{job}} (mean, 15m)"),),
                  unit="s", width=6,
                  description="How long training waited for a save (the host snapshot), worst rank. "
                              "Everything else of a save runs in the background."),
            Panel("Background write per checkpoint",
                  (Target(f"max by (job) ({mean('longrun_checkpoint_write_seconds', 'job, rank', '15m')})",
                          "{{job}} (mean, 15m)"),),
                  unit="s", width=6,
                  description="Writing a save to storage, worst rank. Longer than the checkpoint interval "
                              "means saves queue (checkpoint.when_busy decides whether training waits)."),
        ),
    )


def performance() -> Dashboard:
    step = "longrun_train_step_duration_seconds"
    phase = "longrun_train_phase_duration_seconds"
    by_rank_step = (f"sum by (job, rank) (rate({sel(step + '_sum')}[{RATE}])) / "
                    f"sum by (job, rank) (rate({sel(step + '_count')}[{RATE}]))")
    straggle = (f"({mean(step, 'job, rank')}) / on (job) group_left quantile by (job) (0.5, {by_rank_step})")
    return Dashboard(
        uid="longrun-performance", title="longrun / performance",
        description="Where a step's time goes, per rank: phases, stragglers, group bring-up and "
                    "dynamic context parallelism.",
        variables=VARIABLES, annotations=ANNOTATIONS,
        items=(
            Row("Where a step's time goes"),
            Panel("Phase time by rank", (Target(mean(phase, "rank, phase"), "rank {{rank}} {{phase}}"),),
                  unit="s", width=12, description="Mean time per phase occurrence, per rank."),
            Panel("Share of wall time by phase",
                  (Target(f"avg by (phase) (sum by (rank, phase) (rate({sel(phase + '_sum', rank=True)}"
                          f"[{RATE}])))", "{{phase}}"),),
                  unit="percentunit", width=12, stack=True,
                  description="Fraction of each second spent in each phase, averaged over ranks. A large "
                              "sync share: communication is not overlapped; a large data share: the input "
                              "pipeline is the bottleneck."),
            Panel("Data wait by rank", (Target(mean("longrun_train_data_wait_seconds", "rank"),
                                               "rank {{rank}}"),),
                  unit="s", width=12),
            Panel("Memory by rank", (Target(f"max by (rank) ({sel('longrun_train_memory_bytes', rank=True)})",
                                            "rank {{rank}}"),),
                  unit="bytes", width=12, description="Peak accelerator memory per step (peak RSS on CPU)."),
            Panel("Training state held by rank",
                  (Target(f"sum by (rank, layout, kind) ({sel('longrun_train_state_bytes', rank=True)})",
                          "rank {{rank}} {{kind}} ({{layout}})"),),
                  unit="bytes", width=12, stack=True,
                  description="Parameters, gradients and optimizer state each rank holds, under the job's "
                              "parallel layout: FSDP and tensor parallelism divide them (compare with "
                              "`longrun config plan`)."),
            Row("Stragglers"),
            Panel("Step time by rank", (Target(mean(step, "rank"), "rank {{rank}}"),), unit="s", width=12),
            Panel("Step time relative to the median rank", (Target(straggle, "rank {{rank}}"),),
                  unit="none", width=12,
                  thresholds=((None, "green"), (1.2, "orange"), (STRAGGLER_FACTOR, "red")),
                  description=f"A rank's mean step time over the median of all ranks. Above "
                              f"{STRAGGLER_FACTOR} for health.straggler_patience steps, the monitor "
                              "reports it as a straggler."),
            Panel("Throughput by rank",
                  (Target(f"sum by (rank) (rate({sel('longrun_train_tokens_total', rank=True)}[{RATE}]))",
                          "rank {{rank}}"),), unit=TOKENS_PER_S, width=24),
            Row("Communication groups"),
            Panel("Group bring-up by phase",
                  (Target(f"max by (phase) ({sel('longrun_group_init_seconds', phase='!total')})",
                          "{{phase}}", instant=True),),
                  kind="bargauge", unit="s", width=12,
                  description="This attempt's world and group creation, slowest rank per phase: store "
                              "connect, arrival of all ranks, world init, every parallel group."),
            Panel("Group bring-up total by rank",
                  (Target(f"max by (rank) ({sel('longrun_group_init_seconds', rank=True, phase='total')})",
                          "rank {{rank}}", instant=True),),
                  kind="bargauge", unit="s", width=12),
            Row("Dynamic context parallelism"),
            Panel("CP group sizes",
                  (Target(f"sum by (le) (increase({sel('longrun_dynamic_cp_group_size_bucket', rank=True)}"
                          f"[{RATE}]))", "{{le}}", heatmap=True),),
                  kind="heatmap", unit="short", width=12,
                  description="How often the planner chose each CP group size (micro-batches per interval)."),
            Panel("Mean CP group size", (Target(mean("longrun_dynamic_cp_group_size", "job"), "{{job}}"),),
                  width=12),
            Panel("Predicted vs measured step time",
                  (Target(f"avg by (job) ({sel('longrun_dynamic_cp_predicted_step_seconds', rank=True)})",
                          "{{job}} predicted"),
                   Target(f"avg by (job) ({sel('longrun_dynamic_cp_measured_step_seconds', rank=True)})",
                          "{{job}} measured")),
                  unit="s", width=12),
            Panel("Cost model error", (Target(
                f"avg by (job) ({sel('longrun_dynamic_cp_measured_step_seconds', rank=True)}) / "
                f"avg by (job) ({sel('longrun_dynamic_cp_predicted_step_seconds', rank=True)})", "{{job}}"),),
                  unit="none", width=12, thresholds=((None, "green"), (1.25, "orange")),
                  description="Measured over predicted. Far from 1: recalibrate the CP cost model."),
        ),
    )


def all_dashboards() -> list[Dashboard]:
    return [overview(), performance()]


def dashboard_bytes(dashboard: Dashboard, datasource_uid: str = DEFAULT_DATASOURCE_UID) -> bytes:
    """The JSON file of a dashboard: sorted keys, two-space indent, a final newline."""
    return (json.dumps(dashboard.to_json(datasource_uid), indent=2, sort_keys=True) + "\n").encode()


def render(out_dir: str | Path = DEFAULT_OUT_DIR) -> list[Path]:
    """Write every dashboard to `out_dir/<uid>.json` (same bytes every time); returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for dashboard in all_dashboards():
        path = out / f"{dashboard.uid}.json"
        path.write_bytes(dashboard_bytes(dashboard))
        paths.append(path)
    return paths
