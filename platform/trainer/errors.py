"""The trainer's errors that the controller must tell apart from a crash."""

from __future__ import annotations

from longrun.kinds import FaultKind


class NonFiniteError(RuntimeError):
    """A step produced NaN/inf (`quantity` is "loss" or "gradient norm"); the weights were
    not updated. `step` is the 1-based step that failed."""

    fault_kind = FaultKind.NAN  # how the controller classifies it (controller/workers.py)

    def __init__(self, step: int, quantity: str, value: float):
        self.step, self.quantity, self.value = step, quantity, value
        super().__init__(
            f"{quantity} is {value} at step {step}: training diverged or the weights or data hold "
            "NaN/inf; resume from an earlier checkpoint, lower training.lr or check the data"
        )

    def __reduce__(self):
        # Rebuilt from the constructor's own arguments: the default pickling would call
        # __init__ with the message alone, so the error could not cross process boundaries
        # (a Ray worker raising it to the controller).
        return type(self), (self.step, self.quantity, self.value)


class NonFiniteLossError(NonFiniteError):
    def __init__(self, step: int, loss: float):
        super().__init__(step, "loss", loss)
        self.loss = loss

    def __reduce__(self):
        return type(self), (self.step, self.loss)


class NonFiniteGradientError(NonFiniteError):
    def __init__(self, step: int, grad_norm: float):
        super().__init__(step, "gradient norm", grad_norm)
        self.grad_norm = grad_norm

    def __reduce__(self):
        return type(self), (self.step, self.grad_norm)
