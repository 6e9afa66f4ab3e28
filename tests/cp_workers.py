"""Worker processes for the context-parallel tests (imported by spawned children).

Every rank builds the same packed batch and the same single-process reference, runs its shard
through context-parallel attention, and reports how far its outputs and gradients are from
the reference at the tokens it holds. The assertions stay in the tests."""

from __future__ import annotations

import traceback

import numpy as np

# Odd lengths, length-1 documents, one document shorter than 2 x cp and one long one.
LENGTHS = [1, 7, 33, 2, 64, 13, 1, 40]


def _join(rank: int, world: int, init_file: str):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # up to 4 ranks share 2 cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return dist


def reference_attention(q, k, v, lengths):
    """Causal attention per document with torch's SDPA on whole, gathered documents."""
    import torch
    import torch.nn.functional as F

    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        o = F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1),
                                           v[sl].transpose(0, 1), is_causal=True, enable_gqa=True)
        outs.append(o.transpose(0, 1))
        start += n
    return torch.cat(outs)


def _local(x, idx, garbage):
    """The rows of `x` a rank holds; padding rows hold garbage (results must not depend on it)."""
    import torch

    pad = idx < 0
    y = x.index_select(0, idx.clamp(min=0))
    y[pad] = torch.randn(y[pad].shape, generator=garbage, dtype=y.dtype) * 50
    return y


def _rel_err(mine, want, idx) -> float:
    """Largest error at the real tokens a rank holds, relative to the reference's largest."""
    real = idx >= 0
    sel = idx[real]
    return float((mine[real].double() - want[sel]).abs().max() / want[sel].abs().max())


FLASH_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def attention_matches_reference(rank: int, world: int, init_file: str, results, cases,
                                kernel: str = "auto", dtype: str = "float32") -> None:
    """cases: list of (impl, cp, zigzag, n_heads, kv_heads, ulysses_size). The shards run in
    `dtype` through the CP block kernel `kernel`, under the profiler: how many times the CPU
    flash op ran forward and backward comes back with the errors. The float64 reference sees
    the inputs rounded to `dtype`, so only the kernel's own error counts."""
    try:
        dist = _join(rank, world, init_file)
        import torch
        from torch.profiler import ProfilerActivity, profile

        from longrun.commgroup import form_groups, single_node_layout
        from longrun.parallel.dims import ParallelDims
        from longrun.trainer.cp.attention import ContextParallelAttention
        from longrun.trainer.cp.batches import cp_groups_for
        from longrun.trainer.cp.layout import ShardLayout

        low = getattr(torch, dtype)
        for case in cases:
            impl, cp, zigzag, h, kvh, u = case
            g = torch.Generator().manual_seed(11)
            total, d = sum(LENGTHS), 16
            q, k, v, dout = (torch.randn(total, n, d, generator=g, dtype=torch.float64).to(low).double()
                             for n in (h, kvh, kvh, h))
            ref_q, ref_k, ref_v = (x.clone().requires_grad_() for x in (q, k, v))
            ref = reference_attention(ref_q, ref_k, ref_v, LENGTHS)
            (ref * dout).sum().backward()

            # commgroup forms the CP groups (and USP's sub-groups) the dims ask for
            formed = form_groups(single_node_layout(ParallelDims(dp=world // cp, cp=cp, cp_impl=impl,
                                                                 heads=h)), rank)
            groups = cp_groups_for(formed, cp)
            assert groups.ulysses_size == u, (case, groups)
            layout = ShardLayout(np.array(LENGTHS), cp, zigzag)
            idx = torch.from_numpy(layout.global_index(groups.rank))
            pad = idx < 0
            garbage = torch.Generator().manual_seed(100 + rank)
            lq, lk, lv = (_local(x, idx, garbage).to(low).requires_grad_() for x in (q, k, v))
            attn = ContextParallelAttention(layout, groups, torch.device("cpu"), kernel)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = attn.attend(lq, lk, lv)
                (out * _local(dout, idx, garbage).to(low)).sum().backward()
            ran = [e.name for e in prof.events()]
            results.put((rank, case, {
                "out": _rel_err(out.detach(), ref.detach(), idx),
                "dq": _rel_err(lq.grad, ref_q.grad, idx), "dk": _rel_err(lk.grad, ref_k.grad, idx),
                "dv": _rel_err(lv.grad, ref_v.grad, idx),
                "pad_kv_grad": float(max(lk.grad[pad].abs().max(), lv.grad[pad].abs().max()))
                if pad.any() else 0.0,
                "pad_out": float(out.detach()[pad].abs().max()) if pad.any() else 0.0,
                "finite": bool(torch.isfinite(out).all() and torch.isfinite(lq.grad).all()),
                "flash_forward": ran.count(FLASH_OPS[0]), "flash_backward": ran.count(FLASH_OPS[1]),
                "dtype": str(out.dtype),
            }))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise


# --- a whole training step ------------------------------------------------------------------

STEP_LENGTHS = [200, 130, 5, 1, 17, 64, 33, 90, 2, 41]
TEST_COST = dict(linear_s_per_token=2e-6, attn_s_per_token2=2e-9, ring_block_s_per_token2=3e-9,
                 p2p_latency_s=2e-4, p2p_s_per_byte=1e-9, micro_batch_overhead_s=1e-3)


def cp_config(world: int, cp: int, dynamic: bool, impl: str = "ring"):
    from longrun.config import config_from_dict

    return config_from_dict({
        "job": {"name": "cp", "seed": 5},
        "cluster": {"device": "cpu", "workers_per_node": world},
        "parallelism": {"dp": world // cp, "cp": cp, "dynamic_cp": dynamic, "cp_impl": impl},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "max_seq_len": 64 * (world if dynamic else cp)},
        "data": {"source": "synthetic", "micro_batch_tokens": 64, "prefetch": 1,
                 "synthetic": {"min_len": 8, "max_len": 256, "mean": 64, "sigma": 1.0}},
        "training": {"steps": 3, "lr": 3e-3, "warmup_steps": 1},
    })


def _planned_step_against_one_process(cfg, setup, docs):
    """One planned step of `docs` under `setup` and the same batch in one process without CP:
    the trainer (gradients in place) and how the two compare."""
    from longrun.data.packing import build_micro_batch
    from longrun.trainer import Trainer
    from longrun.trainer.cp.batches import plan_step

    with Trainer(cfg, "cpu", progress=False) as ref:
        ref_loss, _ = ref.forward_backward([build_micro_batch(docs)])
    trainer = Trainer(cfg, "cpu", context_parallel=setup, progress=False)
    step = plan_step(docs, setup, cfg.data.micro_batch_tokens)
    loss, _ = trainer.forward_backward_planned(step)
    worst = max(float((p.grad - q.grad).abs().max() / q.grad.abs().max())
                for p, q in zip(trainer.model.parameters(), ref.model.parameters(), strict=True))
    sizes = sorted({g.cp for mb in step.plan.micro_batches for g in mb.groups if g.sequences})
    return trainer, {"loss": loss, "ref_loss": ref_loss, "grad_err": worst, "sizes": sizes,
                     "micro_batches": len(step.micro_batches)}


def cp_step_matches_no_cp(rank: int, world: int, init_file: str, results, cases) -> None:
    """cases: (dynamic, static_cp, impl, expected ulysses_size). For each: one planned step on a fixed
    global batch gives the loss and gradients of one process training the whole batch; then
    two real training steps keep every rank's weights equal."""
    try:
        dist = _join(rank, world, init_file)
        import torch

        from longrun.commgroup import form_groups, single_node_layout
        from longrun.trainer.cp.batches import setup_from_parallel_groups
        from longrun.trainer.cp.planner import CostModel

        rng = np.random.default_rng(3)
        for case in cases:
            dynamic, static_cp, impl, u = case
            cfg = cp_config(world, static_cp, dynamic, impl)
            # Documents up to what the largest CP group can hold.
            docs = [rng.integers(0, 256, size=min(n, cfg.model.max_seq_len - 8)) for n in STEP_LENGTHS]
            cost = CostModel.for_model(cfg.model, **TEST_COST)
            formed = form_groups(single_node_layout(cfg.dims), rank)
            setup = setup_from_parallel_groups(formed, cost=cost)
            assert setup.groups[max(setup.groups)].ulysses_size == u, setup.groups
            trainer, report = _planned_step_against_one_process(cfg, setup, docs)
            trainer.optimizer.zero_grad(set_to_none=True)
            trained = trainer.train(steps=2)
            flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
            gathered = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(gathered, flat)
            replicas_equal = all(torch.equal(gathered[0], g) for g in gathered)
            trainer.close()
            results.put((rank, case, report | {"trained_loss": trained.loss,
                                               "replicas_equal": replicas_equal}))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise


def cp_step_over_commgroup(rank: int, world: int, init_file: str, results, url: str) -> None:
    """Dynamic CP on the groups commgroup brings up over Redis (dp 2 x cp 2, sub-groups of 1,
    2 and 4): one planned step equals one process on the whole batch."""
    try:
        import torch

        torch.set_num_threads(1)
        from commgroup_workers import world4_layout

        from longrun.commgroup import init_parallel_groups
        from longrun.trainer.cp.batches import setup_from_parallel_groups
        from longrun.trainer.cp.planner import CostModel

        groups = init_parallel_groups(url, job="cp-commgroup", attempt=0, rank=rank,
                                      layout=world4_layout())
        cfg = cp_config(world, 2, True)
        setup = setup_from_parallel_groups(groups, cost=CostModel.for_model(cfg.model, **TEST_COST),
                                           dims=cfg.dims)  # dynamic CP over the layout's groups
        rng = np.random.default_rng(3)
        docs = [rng.integers(0, 256, size=min(n, cfg.model.max_seq_len - 8)) for n in STEP_LENGTHS]
        trainer, report = _planned_step_against_one_process(cfg, setup, docs)
        trainer.close()
        results.put((rank, "ok", report | {"span": setup.span_size}))
        torch.distributed.barrier()  # nobody tears down while a peer still works
        groups.teardown()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise


def calibration_is_measured_then_reused(rank: int, world: int, init_file: str, results,
                                        directory: str) -> None:
    """load_or_calibrate measures once (every rank gets the same model), saves it, and a
    second call loads the saved one instead of measuring again."""
    try:
        _join(rank, world, init_file)
        from longrun.commgroup import form_groups, single_node_layout
        from longrun.trainer import Trainer
        from longrun.trainer.cp.batches import setup_from_parallel_groups
        from longrun.trainer.cp.calibration import calibration_path, load_or_calibrate
        from longrun.trainer.cp.planner import CostModel

        cfg = cp_config(world, world, False)
        placeholder = CostModel.for_model(cfg.model, **TEST_COST)
        setup = setup_from_parallel_groups(form_groups(single_node_layout(cfg.dims), rank),
                                           cost=placeholder)
        trainer = Trainer(cfg, "cpu", context_parallel=setup, progress=False)
        first = load_or_calibrate(directory, trainer)
        path = calibration_path(directory, trainer)
        second = load_or_calibrate(directory, trainer)
        results.put((rank, "ok", {"first": first.to_json(), "second": second.to_json(),
                                  "installed": setup.cost == second, "saved": path.exists()}))
        trainer.close()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise
