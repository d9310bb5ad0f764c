"""A copy head planted in the draft's first layer at the start of training (`init_copy_head`).

The default target's greedy replies repeat themselves, and a draft trained from scratch on a CPU budget does not
learn to copy (docs/results/recipe.md): prompt lookup then beats it. One kv head of layer 0 and the query heads
that share it start as an induction head instead:
- fc writes a code of the current token t_m into `rank` reserved residual dimensions: the last aux layer's
  least-varying directions, which fc stops passing through. The code is read from the lowest aux layer (near
  the embeddings, where the current token is plainest) by a ridge probe fitted on the run's first micro-batches.
- The head's key reads that code; its queries read the same code of the input embedding, x_{p+1} at origin p:
  an earlier position m with t_m = x_{p+1} matches.
- Its value reads the embedding input at m, x_{m+1}, mapped to the direction that lm_head (the target's readout
  rows, through the final norm) reads as that token (a ridge map: about the identity for tied embeddings, the
  best linear fit for untied ones), and o_proj writes it into the residual: the token that followed the match,
  which is what lookup proposes.
The match uses only RoPE pairs that turn by at most a radian over `max_length`, so it holds at any distance.
Where nothing matches, softmax would spread the head over whatever scores highest by chance and copy noise. Most
targets park attention on their first token, whose features then have an outsized norm: when the samples show
such sink positions, their keys get a score between a non-match's and a match's and their values are cancelled,
so the head rests there, silent, unless a real match outscores it.
With aux id 0 among the draft's layers (the embeddings) the code is exact: aux_layer_ids [0, 15, 27] for the
default target (docs/results/recipe.md).
Training then moves every weight as usual. The scales below make the planted head dominate where it matches;
they were set on the default target (docs/results/recipe.md).
"""

from __future__ import annotations

import dataclasses

import torch

from wingspan.config import DraftConfig, TrainConfig
from wingspan.errors import ConfigError
from wingspan.models.draft import Eagle3Draft, rope_frequencies
from wingspan.train.distributed import print0

CODE_SHARE = 0.4  # the code's norm in the residual against the last aux layer's
MATCH_SHARPNESS = 10.0  # query scale: a match's attention score over a non-match's
COPY_GAIN = 0.03  # o_proj's scale, times the last aux layer's mean norm (larger ones: more harm where nothing repeats)
PROBE_RIDGE = 1e-2  # the probe's ridge, relative to the mean square of its inputs
SINK_SHARE = 0.6  # the sink's score, from a non-match's mean (0) to a match's (1)
SINK_NORM = 10.0  # a sink position's last-aux norm, times the median position's
MAX_TURN = 1.0  # radians a RoPE pair carrying the match may turn over max_length


def stable_rope_dims(config: DraftConfig, max_length: int) -> list[int]:
    """The head dims (rotate-half pairs d and d + head_dim / 2) whose rotation over `max_length` positions stays
    within MAX_TURN."""
    half = config.head_dim // 2
    inverse_frequencies = rope_frequencies(config)[0]
    pairs = [d for d in range(half) if float(inverse_frequencies[d]) * max_length <= MAX_TURN]
    return pairs + [d + half for d in pairs]


def check_plantable(config: DraftConfig, max_length: int) -> list[int]:
    """The head dims that carry the match (`stable_rope_dims`), or a ConfigError saying why none can."""
    if config.hidden_size != config.target_hidden_size:
        raise ConfigError("init_copy_head: the draft's hidden size must be the target's (fc passes a layer through)")
    dims = stable_rope_dims(config, max_length)
    if len(dims) < 8:
        raise ConfigError(
            f"init_copy_head: only {len(dims)} head dims turn by less than {MAX_TURN} rad over max_length "
            f"{max_length} (rope_theta {config.rope_theta}); the match needs 8; use a shorter max_length"
        )
    return dims


def with_copy_head_default(config: TrainConfig, draft_config: DraftConfig) -> TrainConfig:
    """`config` with an unset `init_copy_head` chosen for the run (printed): on for a new chain draft started from
    the target that can hold the head, the measured recipe (docs/training.md, "Defaults"); off otherwise."""
    if config.init_copy_head is not None:
        return config
    if config.draft_mode == "parallel":
        refusal = "a parallel draft, where it was not measured"
    elif config.init_from or config.init_layers_from_target or not config.init_from_target:
        refusal = "the draft does not start from the target alone (init_from, init_layers_from_target)"
    else:
        try:
            check_plantable(draft_config, config.max_length)
            refusal = None
        except ConfigError as error:
            refusal = str(error).removeprefix("init_copy_head: ")
    print0(f"init_copy_head: {'off, ' + refusal if refusal else 'on, the default for a new draft'}")
    return dataclasses.replace(config, init_copy_head=refusal is None)


def fit_probe(features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """[H, H'] ridge regression from `features` [N, H] to `embeddings` [N, H']."""
    x = features.double()
    ridge = PROBE_RIDGE * float(x.pow(2).mean()) * x.shape[0]
    gram = x.T @ x + ridge * torch.eye(x.shape[1], dtype=x.dtype)
    return torch.linalg.solve(gram, x.T @ embeddings.double()).float()


def sink_positions(last: torch.Tensor) -> torch.Tensor:
    """[N] bool over the last aux layer's features [N, H]: the positions where the target parks its attention,
    whose features' norm is far above the rest (the first token's, in most LLMs)."""
    norms = last.norm(dim=-1)
    return norms > SINK_NORM * norms.median()


@torch.no_grad()
def plant_copy_head(
    draft: Eagle3Draft, aux: torch.Tensor, tokens: torch.Tensor, max_length: int, generator: torch.Generator
) -> tuple[float, int]:
    """Set up kv head 0 of layer 0 as a copy head (the module's docstring), from the target's aux features `aux`
    [N, num_aux * H] over the tokens `tokens` [N] they were computed at, consecutive positions of whole rows.
    The draft must have fc passing the last aux layer through (init_from_target). Returns the probe's accuracy
    (how often the code read back from the features names the current token among the whole vocab, on the
    last tenth of the samples) and the number of sink positions among the samples (0: no sink planted)."""
    config = draft.config
    hidden, head_dim = config.hidden_size, config.head_dim
    aux = aux.float()
    lowest = config.aux_layer_ids.index(min(config.aux_layer_ids))
    low, last = aux[:, lowest * hidden : (lowest + 1) * hidden], aux[:, -hidden:]
    sinks = sink_positions(last)
    dims = check_plantable(config, max_length)
    if sinks.any():  # the slowest-turning pair carries the sink's score
        sink_dim = dims[len(dims) // 2 - 1]
        dims = [d for d in dims if d not in (sink_dim, sink_dim + head_dim // 2)]
    rank = len(dims)
    embed = draft.embed_tokens.weight.float()
    normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)  # input_layernorm(E)
    fitted = int(0.9 * len(tokens))
    probe = fit_probe(low[:fitted], normed[tokens[:fitted]])
    # embeddings -> what lm_head reads as the same token, scaled to the embeddings' norm
    readout_rows = draft.lm_head.weight * draft.norm.weight
    vocab_normed = normed[draft.draft_to_target(torch.arange(config.draft_vocab_size))]
    readout = fit_probe(vocab_normed, readout_rows)
    readout *= vocab_normed.norm(dim=-1).mean() / (vocab_normed @ readout).norm(dim=-1).mean()

    code = torch.linalg.qr(torch.randn(hidden, rank, generator=generator))[0].T  # [rank, H] orthonormal rows
    value = torch.linalg.qr(torch.randn(hidden, head_dim, generator=generator))[0].T  # [head_dim, H]
    # the residual's reserved dims: the last aux layer's least-varying directions
    reserved = torch.linalg.eigh(torch.cov(last.T.double()))[1][:, :rank].float()  # [H, rank]

    read = low @ probe @ code.T  # [N, rank]: each position's code of its current token
    last_norm = float(last.norm(dim=-1).mean())
    scale = CODE_SHARE * last_norm / float(read.norm(dim=-1).mean())
    fc = draft.fc.weight
    fc[:, -hidden:] = torch.eye(hidden) - reserved @ reserved.T
    fc[:, lowest * hidden : (lowest + 1) * hidden] = scale * reserved @ code @ probe.T

    attn = draft.layers[0].self_attn
    kv_rows = slice(0, head_dim)
    attn.k_proj.weight[kv_rows] = 0
    attn.k_proj.weight[dims, hidden:] = reserved.T
    attn.v_proj.weight[kv_rows] = 0
    attn.v_proj.weight[kv_rows, :hidden] = value @ readout.T
    for head in range(config.num_attention_heads // config.num_key_value_heads):  # the heads sharing kv head 0
        rows = slice(head * head_dim, (head + 1) * head_dim)
        attn.q_proj.weight[rows] = 0
        attn.q_proj.weight[[head * head_dim + d for d in dims], :hidden] = MATCH_SHARPNESS * code
        attn.o_proj.weight[:, rows] = COPY_GAIN * last_norm * value.T
    if sinks.any():
        plant_sink(draft, aux, tokens, sinks, normed, dims, sink_dim)

    named = torch.nn.functional.normalize(normed @ code.T, dim=-1)
    guessed = (torch.nn.functional.normalize(read[fitted:], dim=-1) @ named.T).argmax(dim=-1)
    return float((guessed == tokens[fitted:]).float().mean()), int(sinks.sum())


def plant_sink(
    draft: Eagle3Draft,
    aux: torch.Tensor,
    tokens: torch.Tensor,
    sinks: torch.Tensor,
    normed: torch.Tensor,
    dims: list[int],
    sink_dim: int,
) -> None:
    """Give the planted head somewhere to rest where nothing matches: the sink positions' keys score SINK_SHARE
    of the way from a non-match to a match, in head dim `sink_dim`, and their values are cancelled. The key
    reads the direction of the layer's normalised hidden input that is 1 at the sinks and 0 on average
    elsewhere, with the least variance there; the query the direction that is 1 on average, with the least
    variance (the target's features have near-constant directions)."""
    config = draft.config
    hidden, head_dim = config.hidden_size, config.head_dim
    layer = draft.layers[0]
    attn = layer.self_attn
    h = layer.hidden_norm(aux @ draft.fc.weight.T).double()
    at_sinks, elsewhere = h[sinks].mean(0), h[~sinks].mean(0)
    spread = torch.cov(h[~sinks].T) + PROBE_RIDGE / 10 * float(h[~sinks].pow(2).mean()) * torch.eye(hidden).double()
    to_sinks, to_elsewhere = torch.linalg.solve(spread, at_sinks), torch.linalg.solve(spread, elsewhere)
    gram = torch.stack(
        [
            torch.stack([at_sinks @ to_sinks, at_sinks @ to_elsewhere]),
            torch.stack([elsewhere @ to_sinks, elsewhere @ to_elsewhere]),
        ]
    )
    weights = torch.linalg.solve(gram, torch.tensor([1.0, 0.0], dtype=h.dtype))
    key_reads = weights[0] * to_sinks + weights[1] * to_elsewhere
    query_reads = to_elsewhere / (elsewhere @ to_elsewhere)

    # the match's score, query token t_i against key position j, on the first samples
    n = min(2000, len(tokens))
    key = (h.float() @ attn.k_proj.weight[:head_dim, hidden:].T)[:n, dims]
    query = (normed[tokens[:n]] @ attn.q_proj.weight[:head_dim, :hidden].T)[:, dims]
    scores = query @ key.T / head_dim**0.5
    same = tokens[:n, None] == tokens[None, :n]
    match, other = float(scores[same].mean()), float(scores[~same].mean())
    sink_score = other + SINK_SHARE * (match - other)
    at_sink = float((h[sinks] @ key_reads).mean() * (h @ query_reads).mean())
    attn.k_proj.weight[sink_dim, hidden:] = (sink_score * head_dim**0.5 / at_sink * key_reads).float()
    for head in range(config.num_attention_heads // config.num_key_value_heads):
        attn.q_proj.weight[head * head_dim + sink_dim, hidden:] = query_reads.float()
    # a sink's value reads its input token's embedding like any position's; that token is the chat template's
    # second, the same in every row: cancel their mean
    after_sinks = tokens[1:][sinks[:-1]]
    carried = (normed[after_sinks] @ attn.v_proj.weight[:head_dim, :hidden].T).mean(0)
    attn.v_proj.weight[:head_dim, hidden:] -= torch.outer(carried, key_reads.float())
