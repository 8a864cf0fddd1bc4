"""`ModelArgs`: everything by which one family's decoder differs from another's, as data (see
decoder.py), and the rope scaling it may carry."""

from __future__ import annotations

import math
from dataclasses import dataclass

ROPE_TYPES = ("llama3", "linear", "yarn", "longrope", "proportional")


@dataclass
class RopeScaling:
    """Rope frequency scaling (HF `rope_scaling` / `rope_parameters`), by `rope_type`:

    llama3    low frequencies divided by `factor`, high ones kept, smooth between
              (`low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`)
    linear    every frequency divided by `factor`
    yarn      interpolation blended with extrapolation over a ramp
              set by `beta_fast` / `beta_slow`; cos/sin scaled by `attention_factor`
    longrope  per-frequency `short_factor` (up to `original_max_position_embeddings`
              positions) or `long_factor` (beyond); cos/sin scaled by `attention_factor`
    proportional  (full layers) the first `partial` of the head's frequency pairs
              rotate at the frequencies of the whole head dim, the rest not at all; all
              divided by `factor`

    `attention_factor` None means the published default for the type (derived from `factor`).
    """

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    partial: float = 1.0  # proportional: the fraction of frequency pairs that rotate
    # yarn: with both set, cos/sin are scaled by m(mscale) / m(mscale_all_dim),
    # m(x) = 0.1 x ln(factor) + 1; and MLA's scores by m(mscale_all_dim) ** 2
    mscale: float = 0.0
    mscale_all_dim: float = 0.0

    def cos_sin_scale(self) -> float:
        """The factor cos and sin are multiplied by (yarn, longrope; 1 otherwise)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.rope_type == "yarn" and self.mscale and self.mscale_all_dim:
            return self.yarn_mscale(self.mscale) / self.yarn_mscale(self.mscale_all_dim)
        if self.rope_type == "yarn":
            return self.yarn_mscale(1.0)
        if self.rope_type == "longrope" and self.factor > 1:
            return math.sqrt(
                1 + math.log(self.factor) / math.log(self.original_max_position_embeddings)
            )
        return 1.0

    def yarn_mscale(self, m: float) -> float:
        """YaRN's attention scale 0.1 m ln(factor) + 1 (1 when not stretched)."""
        return 0.1 * m * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


LAYER_KINDS = ("full", "sliding", "linear")


@dataclass
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    # None -> dim // n_heads (canonical: set only when it differs; read it through `hd`)
    head_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 4096  # HF max_position_embeddings
    qkv_bias: bool = False  # biases on the q/k/v projections
    tie_embeddings: bool = False
    # The checkpoint's pad_token_id: as transformers' padding_idx, lookups of it give its
    # embedding row no gradient (a zero pad row used as bos would otherwise get ~1e27: a zero
    # hidden state passes each RMSNorm with slope 1/sqrt(eps)). None: every row trains.
    pad_id: int | None = None
    # Tokens a query sees in a sliding layer, itself included (None: no sliding layers).
    sliding_window: int | None = None
    # Per layer "full" or "sliding"; None: every layer sliding when sliding_window is set, else
    # every layer full.
    layer_types: tuple[str, ...] | None = None
    family: str = "llama"  # the HF family save_hf writes (models/families/; the registry's default)
    qk_norm: bool = False  # RMSNorm over each q and k head before rope
    norm_plus_one: bool = False  # norms scale by (1 + w), in fp32
    embed_scale: bool = False  # embeddings multiplied by sqrt(dim)
    activation: str = "silu"  # "silu" (SwiGLU) | "gelu_tanh" (GeGLU)
    sandwich_norms: bool = False  # norms after attention and after the MLP too
    pre_norms: bool = True  # norms before attention and the MLP (False: the sandwich's only)
    norm_weight_fp32: bool = False  # the norm weight multiplies in fp32, then the cast back
    qk_norm_whole: bool = False  # the q/k norms span the whole projection, not a head
    nope_layers: tuple[int, ...] = ()  # layers without rope (NoPE)
    attn_output_gate: bool = False  # o = attn * sigmoid(gate from q_proj)
    # Gated DeltaNet on the "linear" layers (models/linear_attention.py)
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv: int = 4  # the causal convolution's kernel
    linear_fused: bool = False  # fused in_proj_qkvz / in_proj_ba, grouped per key head
    query_pre_attn_scalar: float | None = None  # scores scaled by this**-0.5, not hd
    attn_softcap: float | None = None  # scores -> c * tanh(scores / c)
    final_softcap: float | None = None  # logits -> c * tanh(logits / c)
    local_rope_theta: float | None = None  # sliding layers' rope base (no scaling)
    rotary_dim: int | None = None  # partial rotary: leading dims rotated; None: hd
    fused_projections: bool = False  # one qkv and one gate_up projection
    # Mixture of experts (see moe.py). n_experts 0: a dense model.
    n_experts: int = 0  # routed experts per MoE layer
    top_k: int = 0  # experts per token
    moe_ffn_dim: int = 0  # each expert's hidden width
    norm_topk: bool = True  # top-k weights renormalised to sum 1 (norm_topk_prob)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP (mlp_only_layers)
    router_aux_coef: float = 0.0  # the checkpoint's router_aux_loss_coef (--router-aux-coef)
    shared_ffn_dim: int = 0  # a shared expert beside the routed ones; 0: none
    shared_expert_gate: bool = False  # ... scaled per token by sigmoid(x . gate)
    # Full layers with a head size and kv heads of their own, values from the key
    # projection there; values RMS-normed (no weight); the last `kv_shared_layers` layers attend
    # over the keys and values of the last earlier layer of their kind (and may have an MLP
    # twice as wide); a small embedding per layer fed into each block; a stored scalar per block
    global_head_dim: int | None = None  # full layers' head dim (None: hd)
    global_kv_heads: int | None = None  # full layers' kv heads (None: n_kv_heads)
    kv_from_k: bool = False  # full layers: v = the key projection (before k's norm and rope)
    v_norm: bool = False
    kv_shared_layers: int = 0
    wide_shared_mlp: bool = False
    ple_dim: int = 0  # per-layer input width (0: none)
    ple_vocab: int = 0  # ... and its vocabulary
    layer_scalar: bool = False
    # A learned sink logit per head in every softmax's denominator; a bias on o_proj
    attn_sinks: bool = False
    o_bias: bool = False
    # ... and its experts: biases on the router and on both projections, a clamped SwiGLU
    expert_bias: bool = False
    swiglu_limit: float = 0.0  # 0: the plain activation
    swiglu_alpha: float = 1.702
    # Experts beside the MLP: every layer keeps its dense MLP beside the experts, each output
    # normed, their sum normed; the router reads the un-normed residual (see `MLPAndExperts`)
    mlp_beside_experts: bool = False
    # Multi-head latent attention (models/mla.py; kv_rank > 0): keys and values of
    # every head from one shared latent of kv_rank (normed) per token, plus one rope key of
    # `rotary_dim` shared by the heads; queries through a latent of q_rank (0: one projection).
    # hd is the q/k head dim (nope part + rotary_dim rope part), v_head_dim the values'.
    kv_rank: int = 0
    q_rank: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rope dims come in pairs (x0, x1), (x2, x3) ...
    # Sigmoid routers: sigmoid scores, a correction bias that only picks experts,
    # picks limited to the `topk_groups` best of `n_groups` groups, weights times `routed_scale`
    router_score: str = "softmax"  # "softmax" | "sigmoid"
    n_groups: int = 1
    topk_groups: int = 1
    routed_scale: float = 1.0

    @property
    def hd(self) -> int:
        """Resolved head dimension."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    def layer_kind(self, index: int) -> str:
        """ "full" or "sliding" for layer `index`."""
        if self.layer_types is not None:
            return self.layer_types[index]
        return "sliding" if self.sliding_window is not None else "full"

    def rope(self, index: int) -> bool:
        """Does layer `index` rotate its queries and keys?"""
        return index not in self.nope_layers and self.layer_kind(index) != "linear"

    def window(self, index: int) -> int:
        """Sliding window of layer `index` (0: none)."""
        return (self.sliding_window or 0) if self.layer_kind(index) == "sliding" else 0

    def head_dim_of(self, kind: str) -> int:
        """Head dimension of the layers of `kind`."""
        return self.global_head_dim or self.hd if kind == "full" else self.hd

    def kv_heads_of(self, kind: str) -> int:
        """Key/value heads of the layers of `kind`."""
        return self.global_kv_heads or self.n_kv_heads if kind == "full" else self.n_kv_heads

    def kv_mode(self, index: int) -> str | None:
        """None, "store" (a later layer attends over this layer's keys and values) or "reuse"
        (this layer attends over those of the last "store" layer of its kind)."""
        first = self.n_layers - self.kv_shared_layers
        if not self.kv_shared_layers:
            return None
        if index >= first:
            return "reuse"
        kind = self.layer_kind(index)
        later = [i for i in range(index + 1, first) if self.layer_kind(i) == kind]
        return None if later else "store"

    def kv_source(self, index: int) -> int:
        """The layer whose keys and values layer `index` attends over: itself, or for a
        "reuse" layer the "store" layer of its kind."""
        if self.kv_mode(index) != "reuse":
            return index
        kind = self.layer_kind(index)
        first = self.n_layers - self.kv_shared_layers
        return max(i for i in range(first) if self.layer_kind(i) == kind)

    def ffn_dim_of(self, index: int) -> int:
        """MLP width of layer `index`."""
        wide = self.wide_shared_mlp and self.kv_mode(index) == "reuse"
        return self.ffn_dim * (2 if wide else 1)

    def is_moe(self, index: int) -> bool:
        """Is layer `index` a mixture-of-experts layer?"""
        return self.n_experts > 0 and index not in self.dense_layers

    @property
    def attn_scale(self) -> float:
        """Multiplier of the attention scores."""
        if self.query_pre_attn_scalar is not None:
            return self.query_pre_attn_scalar**-0.5
        rs = self.rope_scaling
        if self.kv_rank and rs is not None and rs.rope_type == "yarn" and rs.mscale_all_dim:
            return self.hd**-0.5 * rs.yarn_mscale(rs.mscale_all_dim) ** 2
        return self.hd**-0.5
