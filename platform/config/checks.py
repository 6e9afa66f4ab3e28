"""Checks that need more than one section of a job's config.

Each check reads the config and its `ParallelDims` (built once, by `parallel_dims`) and yields
(dotted path, reason) pairs; a reason says what to change. `cross_section_problems` runs them
all, so one validation reports every problem at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from longrun.config.memory import pipeline_micro_batches
from longrun.health.scaling import shrunk_degrees
from longrun.parallel.dims import ParallelDims, is_power_of_two, parallel_dims
from longrun.parallel.schedules import (
    MULTI_STAGE,
    V_SHAPED,
    ZERO_BUBBLE,
    micro_batches_to_run,
    total_stages,
)

if TYPE_CHECKING:
    from longrun.config.job import JobConfig

Problems = Iterator[tuple[str, str]]


def _world_fills_the_cluster(cfg: JobConfig, dims: ParallelDims) -> Problems:
    cl = cfg.cluster
    if dims.world_size != cl.workers:
        yield "parallelism", (
            f"dp x fsdp x cp x tp x pp = {dims.dp} x {dims.fsdp} x {dims.cp} x {dims.tp} x {dims.pp} = "
            f"{dims.world_size} "
            f"ranks, but the cluster has nodes x workers_per_node = {cl.nodes} x "
            f"{cl.workers_per_node} = {cl.workers} workers; change parallelism.dp to "
            f"{_suggest_dp(dims, cl.workers)} or resize cluster.nodes / cluster.workers_per_node")


def _suggest_dp(dims: ParallelDims, workers: int) -> str:
    inner = dims.world_size // dims.dp
    if workers % inner == 0:
        return str(workers // inner)
    return f"a value with dp x {inner} = {workers} (none exists: {workers} is not a multiple of {inner})"


def _tp_inside_a_node(cfg: JobConfig, dims: ParallelDims) -> Problems:
    per_node = cfg.cluster.workers_per_node
    if dims.tp > per_node or per_node % dims.tp:
        yield "parallelism.tp", (f"tensor parallelism stays inside a node, so tp ({dims.tp}) must "
                                 f"divide cluster.workers_per_node ({per_node})")


def _heads_split_evenly(cfg: JobConfig, dims: ParallelDims) -> Problems:
    m = cfg.model
    heads = m.n_heads // dims.tp if m.n_heads % dims.tp == 0 else m.n_heads  # per TP rank
    if cfg.parallelism.cp_impl == "ulysses" and heads % dims.cp:
        yield "parallelism.cp_impl", (
            f"Ulysses splits the attention heads across the CP group: the {heads} heads of each "
            f"TP rank must be divisible by cp ({dims.cp}); use cp_impl 'usp' or 'ring'")
    # Tensor parallelism splits heads, the feed-forward hidden layer and the vocabulary.
    for what, n in (("model.n_heads", m.n_heads), ("the KV heads (model.n_kv_heads)", m.kv_heads),
                    ("the feed-forward hidden size (model.ffn_dim)", m.hidden_dim),
                    ("model.vocab_size", m.vocab_size)):
        if n % dims.tp:
            yield "parallelism.tp", f"{what} ({n}) must be divisible by tp ({dims.tp})"


def _dynamic_cp_is_a_power_of_two(cfg: JobConfig, dims: ParallelDims) -> Problems:
    if dims.dynamic_cp and not is_power_of_two(dims.cp):
        yield "parallelism.cp", (f"dynamic CP uses power-of-two CP groups; cp ({dims.cp}) must be "
                                 "1, 2, 4, 8, ...")


def _budget_holds_the_widest_share(cfg: JobConfig, dims: ParallelDims) -> Problems:
    # A sequence split over the widest CP group (static cp, or dynamic CP's largest power of
    # two dividing the span) is padded to a multiple of 2 x its size (zigzag halves).
    longest, budget = cfg.model.max_seq_len, cfg.data.micro_batch_tokens
    share = dims.padded_share(longest)
    if budget < share:
        yield "data.micro_batch_tokens", (
            f"a micro-batch of {budget} tokens per rank cannot hold one sequence of "
            f"model.max_seq_len ({longest}) split over {dims.widest_cp} ranks (the widest CP group: "
            f"{share} tokens each); raise micro_batch_tokens to {share} or lower max_seq_len")


def _global_batch_holds_a_micro_batch(cfg: JobConfig, dims: ParallelDims) -> Problems:
    # Every step draws one global batch of whole documents, next-fit, and splits it among the
    # ranks: it must hold at least one full micro-batch and the longest document.
    explicit = cfg.training.global_batch_tokens
    if explicit is None:
        return
    micro, longest = cfg.data.micro_batch_tokens, cfg.model.max_seq_len
    if explicit < micro:
        yield "training.global_batch_tokens", (
            f"the global batch ({explicit} tokens over all ranks) is smaller than one micro-batch "
            f"(data.micro_batch_tokens = {micro}); raise training.global_batch_tokens to at least "
            f"{micro} or lower data.micro_batch_tokens")
    elif explicit < longest:
        yield "training.global_batch_tokens", (
            f"the global batch ({explicit} tokens over all ranks) cannot hold a document of "
            f"model.max_seq_len ({longest}) tokens; raise training.global_batch_tokens to at "
            f"least {longest} or lower max_seq_len")


def _metrics_port_is_free(cfg: JobConfig, dims: ParallelDims) -> Problems:
    port, per_node = cfg.observability.metrics_port, cfg.cluster.workers_per_node
    if port and per_node > 1:
        yield "observability.metrics_port", (
            f"{per_node} workers share a node and cannot all bind port {port}; leave it 0 (each "
            "worker takes a free port and the controller's /sd lists them)")


def _warmup_within_the_run(cfg: JobConfig, dims: ParallelDims) -> Problems:
    tr = cfg.training
    if tr.warmup_steps > tr.steps:
        yield "training.warmup_steps", (f"warmup ({tr.warmup_steps}) is longer than the run "
                                        f"(training.steps = {tr.steps})")
    if tr.lr_schedule == "wsd" and tr.decay_steps is not None and \
            tr.warmup_steps + tr.decay_steps > tr.steps:
        yield "training.decay_steps", (
            f"warmup ({tr.warmup_steps}) and decay ({tr.decay_steps}) steps are longer than the run "
            f"(training.steps = {tr.steps}); lower decay_steps or leave it null for decay_fraction")


def _faults_name_real_ranks(cfg: JobConfig, dims: ParallelDims) -> Problems:
    for i, fault in enumerate(cfg.health.faults):
        if fault.rank >= cfg.cluster.workers:
            yield (f"health.faults[{i}].rank",
                   f"rank {fault.rank} does not exist in a world of {cfg.cluster.workers} ranks")


def _min_nodes_reachable(cfg: JobConfig, dims: ParallelDims) -> Problems:
    # Elastic continuation shrinks only the data-parallel degrees (health/scaling.py), so the
    # fewest nodes the job may run on must be a world those degrees can express.
    least, cl = cfg.recovery.min_nodes, cfg.cluster
    if least is None or dims.world_size != cl.workers:
        return  # not elastic, or the world is already wrong (reported on its own)
    if least > cl.nodes:
        yield "recovery.min_nodes", (
            f"min_nodes ({least}) is more than cluster.nodes ({cl.nodes}): it is the fewest nodes "
            f"the job may shrink to; lower it to at most {cl.nodes}")
        return
    fixed, per_node = dims.cp * dims.tp * dims.pp, cl.workers_per_node
    if shrunk_degrees(dims.dp, dims.fsdp, fixed, least * per_node) is not None:
        return
    fewest = min(n for n in range(1, cl.nodes + 1)
                 if shrunk_degrees(dims.dp, dims.fsdp, fixed, n * per_node) is not None)
    yield "recovery.min_nodes", (
        f"on {least} node(s) the job has {least} x {per_node} = {least * per_node} ranks, but only "
        f"parallelism.dp ({dims.dp}) and parallelism.fsdp ({dims.fsdp}) shrink (cp x tp x pp = "
        f"{fixed} ranks hold the pieces of one replica and stay), and no dp <= {dims.dp} and "
        f"fsdp <= {dims.fsdp} give dp x fsdp x {fixed} = {least * per_node}; raise "
        f"recovery.min_nodes to {fewest} (the fewest nodes this layout can shrink to) or leave it unset")


def _checkpointing_under_compile(cfg: JobConfig, dims: ParallelDims) -> Problems:
    tr = cfg.training
    if tr.activation_checkpointing == "budget" and (
            tr.compile == "none" or (tr.compile == "auto" and cfg.cluster.device == "cpu")):
        # The budget is the compiler's partitioner's: an eager model has no graph to partition,
        # and nothing would be recomputed.
        yield "training.activation_checkpointing", (
            f"budget needs compiled blocks or model (training.compile is {tr.compile!r}"
            f"{', which is none on the CPU' if tr.compile == 'auto' else ''}); set training.compile: "
            "blocks, or use activation_checkpointing: selective or full")
    if tr.compile == "model" and tr.activation_checkpointing not in ("none", "budget"):
        # Seen with packed batches of changing length (issue 40's bench, on the CPU): the
        # recompute inside the compiled whole model ran another compiled graph than the forward
        # and torch.utils.checkpoint stopped the step ("Recomputed values ... have different
        # metadata"; pytorch/pytorch#166926). Compiled blocks checkpoint each block whole.
        yield "training.compile", (
            f"'model' with activation_checkpointing {tr.activation_checkpointing!r} can recompute "
            "through a different compiled graph than the forward and stop the step; use compile: "
            "blocks (each block compiled with its checkpoint) or activation_checkpointing: none")


def _pipeline_runs(cfg: JobConfig, dims: ParallelDims) -> Problems:
    par, tr, m = cfg.parallelism, cfg.training, cfg.model
    multi = tr.pp_schedule in MULTI_STAGE
    if dims.pp == 1:
        if par.pp_layers is not None:
            yield "parallelism.pp_layers", ("blocks per stage need pipeline stages; set "
                                            "parallelism.pp > 1 or remove it")
        return
    if m.tie_embeddings:
        yield "model.tie_embeddings", (
            "a tied embedding lives on the first stage and the output layer on the last; with "
            "pipeline stages set model.tie_embeddings to false")
    if dims.cp_enabled:
        yield "parallelism.cp", (
            "context parallelism with pipeline stages is not supported: each stage would need the CP "
            "plan of every micro-batch in flight. Set parallelism.cp to 1 and dynamic_cp to false, "
            "or parallelism.pp to 1")
    if tr.compile == "model":
        yield "training.compile", ("'model' compiles the whole model, and a pipeline rank holds "
                                   "only its stages' part of it; set it to blocks (each block "
                                   "compiled, in every stage) or none")
    if par.pp_virtual_stages > 1 and not multi:
        yield "parallelism.pp_virtual_stages", (
            f"{tr.pp_schedule} runs one stage per rank; set pp_virtual_stages to 1 or training.pp_schedule "
            "to interleaved_1f1b (or looped_bfs, interleaved_zero_bubble)")
    if tr.pp_schedule in V_SHAPED and par.pp_virtual_stages != 2:
        yield "parallelism.pp_virtual_stages", f"{tr.pp_schedule} holds two stages per rank; set it to 2"
    if tr.pp_schedule in ZERO_BUBBLE and tr.activation_checkpointing != "none":
        yield "training.activation_checkpointing", (
            f"{tr.pp_schedule} computes each block's input and weight gradients apart, which "
            "activation checkpointing's recompute cannot do; set it to none or pick 1f1b or "
            "interleaved_1f1b")
    stages = total_stages(tr.pp_schedule, dims.pp, par.pp_virtual_stages)
    if par.pp_layers is not None:
        if len(par.pp_layers) != stages or sum(par.pp_layers) != m.n_layers:
            yield "parallelism.pp_layers", (
                f"{len(par.pp_layers)} counts summing to {sum(par.pp_layers)}; give {stages} (one per "
                f"stage: pp x stages per rank) summing to model.n_layers ({m.n_layers})")
    elif stages > m.n_layers:
        yield "parallelism.pp", (
            f"{stages} pipeline stages need at least as many transformer blocks; model.n_layers is "
            f"{m.n_layers}: lower parallelism.pp or pp_virtual_stages")
    # Every step runs exactly this many micro-batches per pipeline (the feed packs the global
    # batch into them; the schedule is built once): it must be a count the schedule runs.
    micro = pipeline_micro_batches(tr, cfg.data, dims)
    runs = micro_batches_to_run(tr.pp_schedule, dims.pp, stages, micro)
    if runs == micro:
        return
    rule = (f"{tr.pp_schedule} over {stages} stages needs at least {stages} micro-batches per step "
            "(fewer leave stages idle for the whole step)")
    if multi:
        rule += f" and a multiple of pp ({dims.pp})"
    if tr.global_batch_tokens is None:
        yield "training.grad_accum", (
            f"training.grad_accum ({tr.grad_accum}) is the micro-batches each pipeline runs per step; "
            f"{rule}: raise training.grad_accum to {runs}")
    else:
        per_rank = cfg.data.micro_batch_tokens * dims.span
        yield "training.global_batch_tokens", (
            f"{tr.global_batch_tokens} tokens make {micro} micro-batches of "
            f"{cfg.data.micro_batch_tokens} per pipeline (over a span of {dims.span}); {rule}: raise "
            f"training.global_batch_tokens to {runs * per_rank}")


def _validation_has_its_data(cfg: JobConfig, dims: ParallelDims) -> Problems:
    val = cfg.validation
    if val.path is not None and cfg.data.source == "synthetic":
        yield "validation.path", ("synthetic training data has no files to read a validation path "
                                  "alongside; remove validation.path and set validation.held_out instead")
    if val.interval_steps is not None and val.interval_steps > cfg.training.steps:
        yield "validation.interval_steps", (
            f"{val.interval_steps} is more than training.steps ({cfg.training.steps}), so no validation "
            f"pass would run; set it to at most {cfg.training.steps}")


CHECKS: tuple[Callable[[JobConfig, ParallelDims], Problems], ...] = (
    _world_fills_the_cluster,
    _tp_inside_a_node,
    _metrics_port_is_free,
    _dynamic_cp_is_a_power_of_two,
    _heads_split_evenly,
    _budget_holds_the_widest_share,
    _global_batch_holds_a_micro_batch,
    _warmup_within_the_run,
    _faults_name_real_ranks,
    _min_nodes_reachable,
    _pipeline_runs,
    _checkpointing_under_compile,
    _validation_has_its_data,
)


def cross_section_problems(cfg: JobConfig) -> list[tuple[str, str]]:
    """Every check that needs more than one section. Returns (dotted path, reason) pairs."""
    dims = parallel_dims(cfg)
    return [problem for check in CHECKS for problem in check(cfg, dims)]
