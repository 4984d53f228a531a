"""The Nemotron-H family (mlx-lm ``nemotron_h``) as a pure target forward.

A stack of blocks named by ``hybrid_override_pattern``, one character each:
``M`` a Mamba-2 mixer (``layers/mamba2.py``), ``*`` attention without
positional encoding, ``-`` a ReLU² MLP, ``E`` a mixture of ReLU² experts
(sigmoid router choosing the top groups, then the top experts, by the
score plus ``e_score_correction_bias``; optional latent projections around
the experts and a shared expert). Every block is ``x + mixer(rms_norm(x))``.

Cache entries, one per block: Mamba-2 state dicts, attention K/V slot
buffers, and an empty tuple for the stateless MLP and MoE blocks.
Parameters are mlx-lm's tree (``backbone.*``, ``lm_head``).
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from ..cache import causal_mask, kv_buffers, positions_from, write_rows
from ..interfaces import Layout, TargetAdapter
from ..layers import mamba2
from ..layers.moe import expert_matmul
from .base import decoder_layers, stopping_at_prompt_end

BLOCKS = {"M": "Mamba-2", "*": "attention", "-": "MLP", "E": "MoE"}
MOE_KEYS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclass(frozen=True)
class RouterSpec:
    top_k: int
    num_groups: int  # expert groups; the top ``top_groups`` by their two best scores stay eligible
    top_groups: int
    norm_topk_prob: bool
    routed_scaling: float


@dataclass(frozen=True)
class NemotronHSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    pattern: str  # one block character per layer
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mamba: mamba2.Mamba2Spec
    router: RouterSpec | None  # None without MoE blocks


def config_problems(args) -> list:
    """What in mlx-lm's parsed arguments this adapter cannot run."""
    problems = []
    unknown = sorted(set(args.hybrid_override_pattern) - set(BLOCKS))
    if unknown:
        problems.append(f"block types {unknown} in hybrid_override_pattern (known: {BLOCKS})")
    if args.mamba_num_heads % args.n_groups:
        problems.append(f"mamba_num_heads={args.mamba_num_heads} not divisible by n_groups={args.n_groups}")
    if args.num_attention_heads % args.num_key_value_heads:
        problems.append(f"num_attention_heads={args.num_attention_heads} not divisible by "
                        f"num_key_value_heads={args.num_key_value_heads}")
    if "E" in args.hybrid_override_pattern:
        problems += moe_problems(args)
    return problems


def moe_problems(args) -> list:
    missing = [key for key in MOE_KEYS if getattr(args, key) is None]
    if missing:
        return [f"MoE blocks ('E') without {missing}"]
    problems = []
    experts, groups, top_groups = args.n_routed_experts, args.n_group or 1, args.topk_group or 1
    if not 1 <= args.num_experts_per_tok <= experts:
        problems.append(f"num_experts_per_tok={args.num_experts_per_tok} outside 1..n_routed_experts={experts}")
    if groups > 1 and (experts % groups or experts // groups < 2):
        problems.append(f"n_routed_experts={experts} not split into n_group={groups} groups of at least two "
                        f"(a group is ranked by its two best experts)")
    if not 1 <= top_groups <= groups:
        problems.append(f"topk_group={top_groups} outside 1..n_group={groups}")
    return problems


def router_spec(args) -> RouterSpec:
    return RouterSpec(
        top_k=args.num_experts_per_tok,
        num_groups=args.n_group or 1,
        top_groups=args.topk_group or 1,
        norm_topk_prob=bool(args.norm_topk_prob),
        routed_scaling=float(args.routed_scaling_factor or 1.0),
    )


def spec_from_config(config: dict) -> NemotronHSpec:
    """The target spec, read with mlx-lm's defaults; unsupported configs are refused with the reason."""
    from mlx_lm.models.nemotron_h import ModelArgs

    args = ModelArgs.from_dict(config)
    problems = config_problems(args)
    if problems:
        raise ValueError("nemotron_h config not supported: " + "; ".join(problems))
    pattern = "".join(args.hybrid_override_pattern)
    return NemotronHSpec(
        model_type=config["model_type"],
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=len(pattern),
        pattern=pattern,
        eps=args.layer_norm_epsilon,
        num_heads=args.num_attention_heads,
        num_kv_heads=args.num_key_value_heads,
        head_dim=args.head_dim or args.hidden_size // args.num_attention_heads,
        mamba=mamba2.Mamba2Spec(
            num_heads=args.mamba_num_heads,
            head_dim=args.mamba_head_dim,
            state_size=args.ssm_state_size,
            num_groups=args.n_groups,
            conv_kernel=args.conv_kernel,
            eps=args.layer_norm_epsilon,
            time_step_limit=tuple(float(t) for t in args.time_step_limit),
        ),
        router=router_spec(args) if "E" in pattern else None,
    )


def init_kv(spec: NemotronHSpec, batch: int, capacity: int, dtype=mx.float32) -> list:
    """Per block: Mamba-2 state, K/V buffers ``[B, H_kv, C, D]``, or ``()`` (no state)."""

    def entry(block: str):
        if block == "M":
            return mamba2.init_state(spec.mamba, batch, dtype)
        if block == "*":
            return kv_buffers(batch, spec.num_kv_heads, capacity, spec.head_dim, dtype)
        return ()

    return [entry(block) for block in spec.pattern]


def attention(spec: NemotronHSpec, p: dict, x, keys, values, start, positions):
    """Causal attention (no positional encoding) writing this call's K/V into the buffers first."""
    q = ops.split_heads(ops.linear(p["q_proj"], x), spec.num_heads)
    keys = write_rows(keys, ops.split_heads(ops.linear(p["k_proj"], x), spec.num_kv_heads), start)
    values = write_rows(values, ops.split_heads(ops.linear(p["v_proj"], x), spec.num_kv_heads), start)
    mask = causal_mask(positions, keys.shape[2])
    out = ops.attention(q, keys, values, mask, spec.head_dim**-0.5)
    return ops.linear(p["o_proj"], ops.merge_heads(out)), (keys, values)


def relu2_mlp(p: dict, x: mx.array) -> mx.array:
    return ops.linear(p["down_proj"], nn.relu2(ops.linear(p["up_proj"], x)))


def route(router: RouterSpec, gate: dict, x: mx.array):
    """``(experts [..., k], weights [..., k] float32)``: the top-k experts by
    biased sigmoid score among the best groups, weighted by their unbiased score."""
    scores = mx.sigmoid(ops.linear(gate, x).astype(mx.float32))
    choice = scores + gate["e_score_correction_bias"]
    if router.top_groups < router.num_groups:
        grouped = choice.reshape(*choice.shape[:-1], router.num_groups, -1)
        group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1, keepdims=True)
        dropped = router.num_groups - router.top_groups
        worst = mx.argpartition(group_scores, kth=dropped - 1, axis=-2)[..., :dropped, :]
        choice = mx.put_along_axis(grouped, worst, mx.array(0.0), axis=-2).reshape(choice.shape)
    experts = mx.argpartition(-choice, kth=router.top_k - 1, axis=-1)[..., : router.top_k]
    weights = mx.take_along_axis(scores, experts, axis=-1)
    if router.top_k > 1 and router.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return experts, weights * router.routed_scaling


def moe(router: RouterSpec, p: dict, x: mx.array) -> mx.array:
    """Routed ReLU² experts (in the latent space when there is one) plus the shared expert."""
    experts, weights = route(router, p["gate"], x)
    rows = ops.linear(p["fc1_latent_proj"], x) if "fc1_latent_proj" in p else x
    hidden = nn.relu2(expert_matmul(rows[..., None, None, :], p["switch_mlp"]["fc1"], experts))
    out = expert_matmul(hidden, p["switch_mlp"]["fc2"], experts)[..., 0, :]
    y = (out * weights[..., None]).sum(axis=-2).astype(out.dtype)
    if "fc2_latent_proj" in p:
        y = ops.linear(p["fc2_latent_proj"], y)
    if "shared_experts" in p:
        y = y + relu2_mlp(p["shared_experts"], x)
    return y


def forward(spec: NemotronHSpec, params: dict, kv: list, tokens, start, taps: tuple, keep=None):
    """Run ``tokens [B, L]`` at positions ``start[b] + i``: ``(final-normed hidden [B, L, d], taps [B, L, F], kv)``.
    Mamba-2 entries come back pending, or committed after ``keep [B]`` rows when given."""
    backbone = params["backbone"]
    positions = positions_from(start, tokens.shape[1])
    h = ops.embed(backbone["embeddings"], tokens, spec.hidden_size)

    def step(index, layer, entry, h):
        block, x, mixer = spec.pattern[index], ops.rms_norm(h, layer["norm"]["weight"], spec.eps), layer["mixer"]
        if block == "M":
            out, entry = mamba2.mixer(spec.mamba, mixer, x, entry, keep)
        elif block == "*":
            out, entry = attention(spec, mixer, x, *entry, start, positions)
        elif block == "-":
            out = relu2_mlp(mixer, x)
        else:
            out = moe(spec.router, mixer, x)
        return h + out, entry

    h, features, new_kv = decoder_layers(h, backbone["layers"], kv, step, taps)
    return ops.rms_norm(h, backbone["norm_f"]["weight"], spec.eps), features, new_kv


ADAPTER = TargetAdapter(
    model_types=("nemotron_h",),
    layout=Layout(root="backbone", embedding="embeddings"),  # and an untied lm_head
    spec_from_config=spec_from_config,
    init_kv=init_kv,
    forward=forward,
    prompt_forward=stopping_at_prompt_end(forward),
)
