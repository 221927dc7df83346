"""The graph contract: every input and output of the exported graphs, by name, shape and dtype.

Export, the ONNX Runtime / TensorRT backends and the engine builder all read the names and shapes
from here, so a graph and the code that binds it cannot drift apart.

Shapes mix fixed sizes (ints) and the named dynamic axes below; the TensorRT optimization profiles
cover exactly these axes. A dtype is "int64", "float32", "bool" or MODEL_DTYPE, the precision the
graph was exported in (fp32, fp16 or bf16): caches, hidden states and logits travel in it;
probabilities, temperatures and noise are always float32.

Target graph (prefill and verify, T tokens):
    input_ids [B,T], positions [B,T], past_key/past_value [L,B,Hkv,S,D], cache_lens [B],
    tree_mask [B,T,T] (bool: new token i sees new token j; causal for prefill and chains, the
    ancestor-or-self mask of a token tree when verifying one, `tree.verify_mask`)
    -> greedy_ids [B,T] (argmax in-graph), logits [B,T,V] (optional), aux_hidden [B,T,A*Ht],
       new_key/new_value [L,B,Hkv,T,D]
Drafter graph (depth K unrolled, W input rows; W <= K+1 after a verify call, more in the drafter's
prefill and after plain decoding steps, whose rows it catches up on in one call):
    input_ids [B,W], aux_hidden [B,W,A*Ht], num_valid [B], past_key/past_value [1,B,Hkv,S,D],
    cache_lens [B] (+ temperature [B], uniform_noise [B,K] when sampling)
    -> draft_ids [B,K] (target vocabulary), draft_token_probs [B,K], draft_probs [B,K,Vd] (sampling),
       new_key/new_value [1,B,Hkv,W+K-1,D]
Drafter graph proposing a tree of N nodes (tree.py: a static TreeShape or a DynamicTree; a chain is the
tree TreeShape.chain(K) and keeps the outputs above): uniform_noise [B,N] (sampling, static trees), and
    -> draft_ids [B,N] (node order: topological), draft_parents [B,N] (-1: a child of the root),
       draft_token_probs [B,N] (each node's probability under its parent's distribution),
       draft_joint_probs [B,N] (the product along its path), draft_probs [B,N,Vd] (sampling: the
       distribution each node was drawn from), new_key/new_value [1,B,Hkv,W+R,D] (R step rows)
The runtime owns the caches: it writes the first num_valid[b] rows of new_key at cache_lens[b] and
rolls back by length alone. Cache slot j always holds position j.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from .config import DrafterConfig, TargetConfig

BATCH, TOKENS, PAST = "batch", "tokens", "past"  # the dynamic axes of the inputs
# The drafter's new K/V axis: its W input rows plus the step rows after step 0 (tree.Speculation.step_rows:
# K-1 for a chain, the nodes with children for a static tree, (depth-1)*top_k for a dynamic one); an axis
# of its own because ONNX has no arithmetic on axis names. Its on-graph name predates trees and is kept:
# the runtime sizes outputs by axis name (backends.output_shapes), so every build made before still binds.
DRAFTER_NEW_ROWS = "tokens_plus_depth_minus_1"
MODEL_DTYPE = "model"
ONNX_OPSET = 17  # TensorRT 10.x parses opsets 9..20; every op used here exists at 17
MAX_DEPTH = 8  # the deepest unrolled drafter graph (speculation depth K)
MAX_TREE_NODES = 64  # the most draft nodes in one speculation tree (the verify call then feeds 65 tokens)

INPUT_IDS, POSITIONS, AUX_HIDDEN, NUM_VALID = "input_ids", "positions", "aux_hidden", "num_valid"
PAST_KEY, PAST_VALUE, CACHE_LENS, TREE_MASK = "past_key", "past_value", "cache_lens", "tree_mask"
TEMPERATURE, UNIFORM_NOISE = "temperature", "uniform_noise"
GREEDY_IDS, LOGITS, NEW_KEY, NEW_VALUE = "greedy_ids", "logits", "new_key", "new_value"
DRAFT_IDS, DRAFT_TOKEN_PROBS, DRAFT_PROBS = "draft_ids", "draft_token_probs", "draft_probs"
DRAFT_PARENTS, DRAFT_JOINT_PROBS = "draft_parents", "draft_joint_probs"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int | str, ...]
    dtype: str  # "int64", "float32", "bool" or MODEL_DTYPE

    @property
    def dynamic_axes(self) -> dict[int, str]:
        return {i: d for i, d in enumerate(self.shape) if isinstance(d, str)}


@dataclass(frozen=True)
class GraphSpec:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    vocab_size: int = 0  # input_ids are target-vocabulary ids below this

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def feeds(self, args) -> dict:
        """Positional graph inputs (in contract order), by name."""
        return dict(zip(self.input_names, args))

    @property
    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """torch.onnx.export's `dynamic_axes` argument."""
        return {t.name: t.dynamic_axes for t in self.inputs + self.outputs if t.dynamic_axes}

    def __getitem__(self, name: str) -> TensorSpec:
        return next(t for t in self.inputs + self.outputs if t.name == name)


# Inputs a graph exported before they existed lacks: the backends feed a graph only the inputs it declares
# (a target graph without tree_mask builds its causal mask in-graph, and runs chains).
OPTIONAL_INPUTS = (TREE_MASK,)


def target_graph(cfg: TargetConfig, num_aux: int, return_logits: bool) -> GraphSpec:
    cache = (cfg.num_layers, BATCH, cfg.num_kv_heads, PAST, cfg.head_dim)
    new_cache = (cfg.num_layers, BATCH, cfg.num_kv_heads, TOKENS, cfg.head_dim)
    inputs = (TensorSpec(INPUT_IDS, (BATCH, TOKENS), "int64"),
              TensorSpec(POSITIONS, (BATCH, TOKENS), "int64"),
              TensorSpec(PAST_KEY, cache, MODEL_DTYPE),
              TensorSpec(PAST_VALUE, cache, MODEL_DTYPE),
              TensorSpec(CACHE_LENS, (BATCH,), "int64"),
              TensorSpec(TREE_MASK, (BATCH, TOKENS, TOKENS), "bool"))
    outputs = (TensorSpec(GREEDY_IDS, (BATCH, TOKENS), "int64"),
               *((TensorSpec(LOGITS, (BATCH, TOKENS, cfg.vocab_size), MODEL_DTYPE),) if return_logits else ()),
               TensorSpec(AUX_HIDDEN, (BATCH, TOKENS, num_aux * cfg.hidden_size), MODEL_DTYPE),
               TensorSpec(NEW_KEY, new_cache, MODEL_DTYPE),
               TensorSpec(NEW_VALUE, new_cache, MODEL_DTYPE))
    return GraphSpec(inputs, outputs, cfg.vocab_size)


def drafter_graph(cfg: DrafterConfig, speculation, sampling: bool) -> GraphSpec:
    """speculation: a tree.Speculation (its `num_nodes` and `is_chain`; tree.py imports this module,
    so it is not imported here)."""
    nodes, tree = speculation.num_nodes, not speculation.is_chain
    cache = (1, BATCH, cfg.num_kv_heads, PAST, cfg.head_dim)
    new_cache = (1, BATCH, cfg.num_kv_heads, DRAFTER_NEW_ROWS, cfg.head_dim)
    inputs = [TensorSpec(INPUT_IDS, (BATCH, TOKENS), "int64"),
              TensorSpec(AUX_HIDDEN, (BATCH, TOKENS, cfg.num_aux * cfg.target_hidden_size), MODEL_DTYPE),
              TensorSpec(NUM_VALID, (BATCH,), "int64"),
              TensorSpec(PAST_KEY, cache, MODEL_DTYPE),
              TensorSpec(PAST_VALUE, cache, MODEL_DTYPE),
              TensorSpec(CACHE_LENS, (BATCH,), "int64")]
    outputs = [TensorSpec(DRAFT_IDS, (BATCH, nodes), "int64"),
               *((TensorSpec(DRAFT_PARENTS, (BATCH, nodes), "int64"),) if tree else ()),
               TensorSpec(DRAFT_TOKEN_PROBS, (BATCH, nodes), "float32"),
               *((TensorSpec(DRAFT_JOINT_PROBS, (BATCH, nodes), "float32"),) if tree else ())]
    if sampling:
        inputs += [TensorSpec(TEMPERATURE, (BATCH,), "float32"),
                   TensorSpec(UNIFORM_NOISE, (BATCH, nodes), "float32")]
        outputs.append(TensorSpec(DRAFT_PROBS, (BATCH, nodes, cfg.draft_vocab_size), "float32"))
    outputs += [TensorSpec(NEW_KEY, new_cache, MODEL_DTYPE), TensorSpec(NEW_VALUE, new_cache, MODEL_DTYPE)]
    return GraphSpec(tuple(inputs), tuple(outputs), cfg.vocab_size)


def required_names(specs) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(inputs, outputs) that every one of `specs` (a graph's variants) has, OPTIONAL_INPUTS left out, in
    the first spec's order."""
    first, *rest = specs

    def every(names):
        return tuple(n for n in names(first) if n not in OPTIONAL_INPUTS and all(n in names(s) for s in rest))
    return every(lambda s: s.input_names), every(lambda s: s.output_names)


# The names the runtime feeds and reads each graph by (inputs, outputs), checked on a graph before it runs
# (`backends.check_bound_names`): those every variant of its spec has, read off the specs above (at sizes
# that do not matter: names do not depend on them), so a renamed or added input or output cannot leave
# them stale; not a target's logits, a tree drafter's parents and joint probabilities, a sampling
# drafter's inputs and probabilities, nor an optional input. (Not the inputs a CUDA graph binds by
# reference: `runtime.backends.Backend.target`.)
def bound_names() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """BOUND_NAMES, read off the specs."""
    size = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1, vocab_size=1, hidden_size=1, num_aux=1,
                           target_hidden_size=1, draft_vocab_size=1)
    return {"target": required_names([target_graph(size, 1, logits) for logits in (False, True)]),
            "drafter": required_names([drafter_graph(size, SimpleNamespace(num_nodes=1, is_chain=chain), sampling)
                                       for chain in (True, False) for sampling in (False, True)])}


BOUND_NAMES = bound_names()


def example_args(spec: GraphSpec, sizes: dict[str, int], generator=None, dtype=None, tree_mask=None) -> tuple:
    """Inputs for `spec`, in contract order, with its dynamic axes at `sizes` ({BATCH, TOKENS, PAST}
    -> int) and MODEL_DTYPE tensors in `dtype`.

    The bookkeeping is a ragged batch either way: cache_lens cycle PAST, PAST // 2; positions continue
    each sequence's cache; num_valid cycle TOKENS, 1. The rest is the export example without a
    generator (zero ids, caches and hidden states; temperature 1; noise 0.5) and random with one
    (ids below the vocabulary size, normal caches and hidden states, temperatures in [0.5, 1.5),
    uniform noise), for checks that must see non-trivial values. The new tokens are causal (a prefill
    or a chain's verify call), or those `tree_mask` [B,T,T] gives (a token tree's, e.g.
    tree.random_verify_mask: the root and TOKENS-1 nodes), each token's position its sequence's
    cache length plus its depth. `dtype` defaults to torch.float32."""
    import torch  # here, not at the top: the command line reads MAX_DEPTH from this module at start-up

    from .layers import causal_mask

    dtype = dtype or torch.float32
    batch, tokens, past = sizes[BATCH], sizes[TOKENS], sizes[PAST]
    cache_lens = torch.tensor([past, past // 2] * batch)[:batch]
    mask = causal_mask(batch, tokens).contiguous() if tree_mask is None else tree_mask
    values = {CACHE_LENS: cache_lens, POSITIONS: cache_lens[:, None] + mask.sum(-1) - 1,
              NUM_VALID: torch.tensor([tokens, 1] * batch)[:batch], TREE_MASK: mask}
    args = []
    for t in spec.inputs:
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in t.shape)
        if t.name in values:
            args.append(values[t.name])
        elif t.name == INPUT_IDS:
            args.append(torch.zeros(shape, dtype=torch.long) if generator is None
                        else torch.randint(0, spec.vocab_size, shape, generator=generator))
        elif t.name == TEMPERATURE:
            args.append(torch.ones(shape) if generator is None else 0.5 + torch.rand(shape, generator=generator))
        elif t.name == UNIFORM_NOISE:
            args.append(torch.full(shape, 0.5) if generator is None else torch.rand(shape, generator=generator))
        else:  # caches and hidden states
            args.append(torch.zeros(shape, dtype=dtype) if generator is None
                        else torch.randn(shape, generator=generator).to(dtype))
    return tuple(args)

