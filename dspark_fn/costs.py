"""How much a round costs on this machine, and the verify policy built from it.

The cost curve (draft kernel, verify kernel of each width) is timed once per
model, device, batch size and sampling mode at a reference context, and kept
in ``~/.cache/dspark_fn``; ``verify_policy`` turns a width setting into the
``VerifyPolicy`` the driver plans with. Over several ranks every rank times
the kernels together (they hold collectives) and all take rank 0's curve.
"""

import mlx.core as mx
from mlx.utils import tree_flatten

from .rounds import check_width, init_cache, no_proposal, propose, verify
from .sampling import GREEDY, batch_sampling
from .schedule import CostCurve, VerifyPolicy, cached_costs, cost_key, fastest_seconds, monotone, width_buckets
from .sharding import agree
from .types import Params

COST_CAPACITY = 512  # cost curves are measured at this context (a typical chat turn)


def measure_costs(params: Params, batch_size: int, widths, sampling=GREEDY) -> CostCurve:
    """Time the draft kernel and the verify kernel of each width on this machine."""
    cache = init_cache(params, batch_size, COST_CAPACITY)
    cache = cache._replace(length=mx.full((batch_size,), COST_CAPACITY // 2, mx.int32))
    tokens = mx.zeros((batch_size,), mx.int32)
    proposal = propose(params, cache, tokens, sampling)

    def verify_round(width):
        source = proposal if width > 1 else no_proposal(batch_size)
        return verify(params, cache, tokens, source, width, sampling=sampling)

    runs = {width: lambda width=width: verify_round(width) for width in widths}
    seconds = fastest_seconds(runs | {"draft": lambda: propose(params, cache, tokens, sampling)})
    return CostCurve(seconds.pop("draft"), monotone(seconds))


def agreed(costs: CostCurve) -> CostCurve:
    """Rank 0's curve on every rank of the group."""
    widths = sorted(costs.verify)
    values = agree([costs.draft] + [costs.verify[width] for width in widths]).tolist()
    return CostCurve(values[0], dict(zip(widths, values[1:])))


def model_signature(params: Params) -> str:
    """What a verify costs depends on: both specs and every tensor's shape and
    dtype (so a quantized draft is timed apart from its float original)."""
    tensors = tree_flatten((params.target, params.draft))
    return repr((params.spec.target, params.spec.draft, [(k, v.shape, v.dtype) for k, v in tensors]))


def verify_policy(
    params: Params,
    width,
    batch_size: int,
    *,
    sampling=GREEDY,
    confidence_threshold: float = 0.0,
    costs: CostCurve | None = None,
) -> VerifyPolicy:
    """The policy for ``width`` = an int (fixed), None (the whole block) or
    "auto" (draft only when it pays, then Algorithm 1 over a cost curve:
    ``costs``, else measured on first use and cached per model, device,
    batch size and sampling settings)."""
    spec = params.spec
    if not (width is None or width == "auto" or isinstance(width, int)):
        raise ValueError(f"verify width must be an integer, None or 'auto', got {width!r}")
    auto = width == "auto"
    widest = spec.block_size + 1 if width is None or auto else width
    check_width(spec, widest)
    buckets = width_buckets(spec.block_size, widest)
    if auto and costs is None:
        measure = lambda: measure_costs(params, batch_size, buckets, sampling)  # noqa: E731
        if mx.distributed.init().size() > 1:  # a cache hit on one rank only would leave the others timing alone
            costs = agreed(measure())
        else:
            key = cost_key(model_signature(params), batch_size, COST_CAPACITY, batch_sampling(sampling, batch_size)[1])
            costs = cached_costs(key, measure)
    return VerifyPolicy(widest, buckets, confidence_threshold, costs if auto else None)


