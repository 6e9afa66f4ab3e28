"""A worker's error reaches the controller without making it import torch (failures.py).

Unpickling an exception imports the module of its class; the first torch-typed error a rank
raised used to load torch into the controller (150 -> 330 MiB, the hour's soak's RSS growth)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import torch.distributed as dist

from longrun.controller.outcomes import describe, fault_kind_of
from longrun.failures import RankFailure, carried
from longrun.trainer import NonFiniteLossError


def test_a_failure_keeps_what_the_controller_reads_of_the_error():
    try:
        raise dist.DistNetworkError("Connection reset by peer while reading the store")
    except dist.DistNetworkError as exc:
        failure = RankFailure.of(exc)
    assert failure.type_name == "torch.distributed.DistNetworkError"
    assert failure.short_name == "DistNetworkError"
    assert "DistNetworkError" in failure.trace and fault_kind_of(failure) == "exception"
    assert describe(3, failure) == ("rank 3 lost its connection to a peer in the middle of a collective "
                                    "(DistNetworkError): a peer's process likely died")
    nan = RankFailure.of(NonFiniteLossError(7, float("nan")))
    assert (fault_kind_of(nan), nan.step) == ("nan", 7)
    assert fault_kind_of(RankFailure.of(ModuleNotFoundError("no module named x"))) == "fatal"
    assert describe(0, RankFailure.of(ValueError("bad\nlast line"))) == "rank 0 raised ValueError: last line"


def test_a_failure_is_read_back_without_torch():
    failure = RankFailure.of(dist.DistBackendError("NCCL communicator was aborted"))
    code = textwrap.dedent(f"""
        import pickle, sys
        e = pickle.loads({pickle.dumps(failure)!r})
        assert "torch" not in sys.modules, "torch imported"
        print(e.type_name, e.fault_kind)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["torch.distributed.DistBackendError", "exception"]
    # The plain exception, for contrast: reading it back needs torch.
    code = f"import pickle, sys; pickle.loads({pickle.dumps(dist.DistBackendError('x'))!r}); " \
           "print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60).stdout.strip() == "True"


def test_a_remote_methods_torch_error_leaves_the_driver_without_torch():
    code = textwrap.dedent("""
        import sys, ray
        from longrun.failures import carried
        ray.init(num_cpus=1, include_dashboard=False, logging_level="error", log_to_driver=False)
        # (RAY_AUTH_MODE=disabled from conftest: this local cluster writes no ~/.ray/auth_token)

        class Worker:
            @carried
            def run(self):
                import torch.distributed as dist
                raise dist.DistNetworkError("the store went away")

        worker = ray.remote(Worker).remote()
        try:
            ray.get(worker.run.remote())
        except ray.exceptions.RayTaskError as exc:
            print(type(exc.cause).__name__, exc.cause.type_name)
        print("torch" in sys.modules)
        ray.shutdown()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    expected = ["RankFailure", "torch.distributed.DistNetworkError", "False"]
    assert done.stdout.split() == expected, done.stderr[-2000:]


def test_carried_passes_results_and_keeps_the_method_name():
    class Worker:
        @carried
        def warm(self) -> float:
            return 1.5

    assert Worker().warm() == 1.5 and Worker.warm.__name__ == "warm"
