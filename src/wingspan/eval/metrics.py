"""Acceptance metrics of speculative decoding, for the evaluation, the comparison with vLLM and the study."""

from __future__ import annotations


def acceptance_length(rounds: int, accepted: int) -> float | None:
    """tau: tokens per verification round, the accepted drafts plus the target's own ("bonus") token, over
    `rounds` rounds that accepted `accepted` drafts in all; vLLM's 1 + accepted / drafts. None without a round."""
    return (rounds + accepted) / rounds if rounds else None


def acceptance_per_position(accepted_per_round: list[int], drafted_per_round: list[int]) -> list[float]:
    """Rate at which draft position j (0-based) is accepted, over the rounds that proposed it."""
    rates = []
    for j in range(max(drafted_per_round, default=0)):
        proposed = [a for a, d in zip(accepted_per_round, drafted_per_round) if d > j]
        rates.append(sum(a > j for a in proposed) / len(proposed))
    return rates
