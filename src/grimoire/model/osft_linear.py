"""OSFT's per-matrix stage: one ``nn.Linear`` weight as frozen and trainable SVD factors.

Paper: Nayak et al., "Sculpting Subspaces: Constrained Full Fine-Tuning in LLMs for Continual
Learning", arXiv 2504.07097. :class:`OSFTLinear` holds a weight ``W`` (``[N, M]`` =
``[out_features, in_features]``) split by its SVD, computed in ``upcast_dtype``,
``W = U diag(S) V^T`` with ``m = min(N, M)`` components sorted by singular value::

    W = U_h diag(S_h) V_h^T  +  U_l diag(S_l) V_l^T
        frozen (buffers)        trainable (parameters)
    U_h [N, k], S_h [k], V_h [M, k]      U_l [N, r], S_l [r], V_l [M, r]
    k = floor(m * (1 - R)),  r = m - k,  R = unfreeze_rank_ratio in [0, 1]

The high-singular-value subspace holds what the model already knows and is never updated. The
low part is trained, but only inside the orthogonal complement of the frozen subspaces: gradients
of ``U_l`` / ``V_l`` are projected with ``G <- G - U_h (U_h^T G)`` (``V`` likewise) before the
optimizer step, and the factors themselves are re-projected after it, because Adam's per-element
scaling of a projected gradient is no longer orthogonal to ``U_h``. With ``U_h^T U_l = 0`` and
``V_h^T V_l = 0`` we get ``U_h^T W = diag(S_h) V_h^T`` and ``W V_h = U_h diag(S_h)``: the frozen
singular triplets stay singular triplets of the trained ``W``, exactly.

Design decisions:

* ``U_l``, ``S_l``, ``V_l`` are ordinary ``nn.Parameter`` s, so any optimizer works unchanged. We
  do not special-case weight decay: decoupled decay multiplies the low factors by a scalar, which
  keeps them orthogonal to the frozen subspace and shrinks only the trainable part of ``W`` (the
  frozen part is made of buffers and never decays). Exclude them from decay if you prefer.
* Factors are stored in the original weight's dtype and device; SVD, gradient projection and the
  dense merge run in ``upcast_dtype``. In bf16 the stored ``U_h`` is orthonormal only to ~1e-2,
  so the invariance above holds to that precision; ``reproject`` stops the error accumulating.
* Memory: a square layer costs ~2x its dense weight (``U`` and ``V`` are both ``m``-wide), plus
  the dense ``W_eff`` rebuilt transiently in each forward.

Which linears become :class:`OSFTLinear`, and the trainer hook, are :mod:`grimoire.model.osft`'s.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from fractions import Fraction
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grimoire.errors import ConfigError

FROZEN_FACTORS = ("U_h", "S_h", "V_h")
TRAINABLE_FACTORS = ("U_l", "S_l", "V_l")
FACTOR_NAMES = FROZEN_FACTORS + TRAINABLE_FACTORS


def num_frozen_components(min_dim: int, unfreeze_rank_ratio: float) -> int:
    """Number of frozen singular components ``k = floor(min_dim * (1 - R))``.

    Evaluated in exact rational arithmetic on the ratio's decimal form: in binary floating point
    ``10 * (1 - 0.9) == 0.9999999999999998``, which would floor to 0 instead of 1.
    """
    check_unfreeze_rank_ratio(unfreeze_rank_ratio)
    return math.floor(min_dim * (1 - Fraction(repr(float(unfreeze_rank_ratio)))))


def check_unfreeze_rank_ratio(ratio: float) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise ConfigError([f"unfreeze_rank_ratio must be a number in [0, 1], got {ratio!r}"])


@contextlib.contextmanager
def _no_autocast(device_type: str) -> Iterator[None]:
    # The dense weight is a sum of m rank-1 terms; rebuilding it in bf16 under autocast would
    # lose far more precision than a bf16 matmul with the finished weight does.
    try:
        ctx = torch.autocast(device_type=device_type, enabled=False)
    except RuntimeError:  # device type without autocast support
        ctx = contextlib.nullcontext()
    with ctx:
        yield


def _remove_component(x: Tensor, basis: Tensor, compute_dtype: torch.dtype) -> Tensor:
    """``x - B (B^T x)`` for an orthonormal ``basis`` B ``[D, k]`` and ``x`` ``[D, r]``.

    Under FSDP2 ``x`` (a parameter or its gradient) is a row-sharded DTensor while the frozen
    basis is a whole buffer on every rank: ``B^T x`` sums over all rows, so ``x`` is gathered,
    projected, and each rank keeps its own rows again (no further communication).
    """
    if hasattr(x, "full_tensor"):
        from torch.distributed.tensor import DTensor, distribute_tensor

        dx = cast(DTensor, x)
        out = _remove_component(dx.full_tensor(), basis, compute_dtype)
        return distribute_tensor(out, dx.device_mesh, dx.placements, src_data_rank=None)
    b = basis.to(compute_dtype)
    x_c = x.to(compute_dtype)
    return (x_c - b @ (b.T @ x_c)).to(x.dtype)


def merge_factors(
    u_h: Tensor, s_h: Tensor, v_h: Tensor, u_l: Tensor, s_l: Tensor, v_l: Tensor
) -> Tensor:
    """``U_h diag(S_h) V_h^T + U_l diag(S_l) V_l^T`` (either part may have rank 0)."""
    if u_l.shape[-1] == 0:
        return (u_h * s_h) @ v_h.T
    low = (u_l * s_l) @ v_l.T
    return low if u_h.shape[-1] == 0 else torch.addmm(low, u_h * s_h, v_h.T)


class OSFTLinear(nn.Module):
    """Drop-in ``nn.Linear`` with weight ``W_eff = U_h diag(S_h) V_h^T + U_l diag(S_l) V_l^T``.

    ``forward(x) = x @ W_eff^T + bias`` with ``W_eff`` rebuilt (autocast off) in the factors'
    dtype; the matmul with ``x`` follows the ambient autocast like ``nn.Linear``. Shapes:
    ``U_h [N, k]``, ``S_h [k]``, ``V_h [M, k]`` (persistent buffers, so checkpoints restore them);
    ``U_l [N, r]``, ``S_l [r]``, ``V_l [M, r]`` (parameters; ``requires_grad=False`` when r = 0).
    """

    # The buffers, registered in __init__ (nn.Module's __getattr__ would type them loosely).
    U_h: Tensor
    S_h: Tensor
    V_h: Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_frozen: int,
        bias: nn.Parameter | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        m = min(in_features, out_features)
        if not 0 <= num_frozen <= m:
            raise ValueError(f"num_frozen must be in [0, {m}], got {num_frozen}")
        self.in_features, self.out_features = in_features, out_features
        self.num_frozen, self.num_trainable = num_frozen, m - num_frozen
        k, r = num_frozen, m - num_frozen

        def empty(*shape: int) -> Tensor:
            return torch.empty(*shape, device=device, dtype=dtype)

        self.register_buffer("U_h", empty(out_features, k))
        self.register_buffer("S_h", empty(k))
        self.register_buffer("V_h", empty(in_features, k))
        # Registered even when empty (r = 0) so every R gives the same state_dict layout.
        self.U_l = nn.Parameter(empty(out_features, r), requires_grad=r > 0)
        self.S_l = nn.Parameter(empty(r), requires_grad=r > 0)
        self.V_l = nn.Parameter(empty(in_features, r), requires_grad=r > 0)
        self.bias = bias

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        unfreeze_rank_ratio: float,
        upcast_dtype: torch.dtype = torch.float32,
        svd_device: torch.device | str | None = None,
        decompose: bool = True,
    ) -> OSFTLinear:
        """Wrap ``linear``, reusing its bias Parameter; SVD its weight unless not ``decompose``."""
        w = linear.weight
        k = num_frozen_components(min(w.shape), unfreeze_rank_ratio)
        module = cls(w.shape[1], w.shape[0], k, linear.bias, device=w.device, dtype=w.dtype)
        if decompose:
            module.set_from_weight(w, upcast_dtype, svd_device)
        return module

    @torch.no_grad()
    def set_from_weight(
        self,
        weight: Tensor,
        upcast_dtype: torch.dtype = torch.float32,
        svd_device: torch.device | str | None = None,
    ) -> None:
        """Fill the factors from the SVD of ``weight`` ``[N, M]``, computed in ``upcast_dtype``."""
        w = weight.detach().to(device=svd_device or weight.device, dtype=upcast_dtype)
        u, s, vh = torch.linalg.svd(w, full_matrices=False)  # s sorted in descending order
        v, k = vh.T, self.num_frozen
        for name, value in zip(
            FACTOR_NAMES, (u[:, :k], s[:k], v[:, :k], u[:, k:], s[k:], v[:, k:])
        ):
            target = getattr(self, name)
            target.copy_(value.to(device=target.device, dtype=target.dtype))
        # The SVD's U_l is orthogonal to U_h only up to roundoff; project it once now, exactly as
        # `reproject` will after each step, so the first step does not carry a roundoff "jump".
        self.reproject(upcast_dtype)

    def factors(self) -> dict[str, Tensor]:
        """The six factor tensors by name (live references, not copies)."""
        return {name: getattr(self, name) for name in FACTOR_NAMES}

    def dense_weight(self, dtype: torch.dtype | None = None) -> Tensor:
        """``U_h diag(S_h) V_h^T + U_l diag(S_l) V_l^T`` ``[N, M]``, computed in ``dtype``.

        Differentiable w.r.t. the trainable factors; ``dtype`` defaults to the factors' dtype.
        """
        dtype = dtype or self.U_l.dtype
        with _no_autocast(self.U_l.device.type):
            factors = (self.U_h, self.S_h, self.V_h, self.U_l, self.S_l, self.V_l)
            return merge_factors(*(t.to(dtype) for t in factors))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.dense_weight(), self.bias)

    @torch.no_grad()
    def project_gradients(self, compute_dtype: torch.dtype = torch.float32) -> None:
        """``grad(U_l) -= U_h (U_h^T grad(U_l))`` and likewise for ``V_l``, in place."""
        for low, high in ((self.U_l, self.U_h), (self.V_l, self.V_h)):
            if low.grad is not None and low.numel() and high.numel():
                low.grad.copy_(_remove_component(low.grad, high, compute_dtype))

    @torch.no_grad()
    def reproject(self, compute_dtype: torch.dtype = torch.float32) -> None:
        """``U_l -= U_h (U_h^T U_l)`` and likewise for ``V_l``, in place."""
        for low, high in ((self.U_l, self.U_h), (self.V_l, self.V_h)):
            if low.numel() and high.numel():
                low.copy_(_remove_component(low, high, compute_dtype))

    @torch.no_grad()
    def merged_weight(self, upcast_dtype: torch.dtype = torch.float32) -> Tensor:
        """Dense weight for saving: summed in ``upcast_dtype``, returned in the factors' dtype."""
        return self.dense_weight(upcast_dtype).to(self.U_l.dtype)

    def to_linear(self, upcast_dtype: torch.dtype = torch.float32) -> nn.Linear:
        """A plain ``nn.Linear`` with the merged weight and this module's bias Parameter."""
        # Built on meta so nn.Linear's random init is skipped; real tensors are assigned below.
        linear = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        linear.weight = nn.Parameter(self.merged_weight(upcast_dtype))
        if self.bias is not None:  # built with bias=False: None already otherwise
            linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"frozen_rank={self.num_frozen}, trainable_rank={self.num_trainable}, "
            f"bias={self.bias is not None}"
        )


__all__ = [
    "FACTOR_NAMES",
    "FROZEN_FACTORS",
    "TRAINABLE_FACTORS",
    "OSFTLinear",
    "check_unfreeze_rank_ratio",
    "num_frozen_components",
]
