"""How well `wingspan quickstart --budget` predicts the target's answers to --prompts: each regeneration batch
of a finished budget run, its predicted seconds beside the time it took.

The batches are rebuilt as the run made them (the same seeded draw of prompts, sorted by length, 32 a batch,
those too long to answer dropped) and charged with the rates of the run's `budget.json`, or of another run's
(`--rates`: a run planned before the probe timed two batches of answers has none of its own). The times are read
from the run's log (the regeneration's progress bar, one mark a batch). It also prints what the typical batch's
time for every answer would have predicted, the model before the answers were charged batch by batch.

    python bench/budget_answers.py runs/budget-45m-mix --log runs/budget-45m-mix.log
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from wingspan.budget import Rates, answers_s, probe_batches
from wingspan.config import TrainConfig
from wingspan.models.target import TargetVocabulary
from wingspan.quickstart import QUICKSTART_RECIPE, answered_prompts, held_out_keys, plan_conversations, prompt_sample


def batch_times(log: str, asked: int) -> list[int]:
    """Seconds of each regeneration batch, from the progress bar's marks `n/asked [mm:ss<` in the log."""
    marks = sorted(
        {
            (int(done), sum(int(x) * 60**i for i, x in enumerate(reversed(clock.split(":")))))
            for done, clock in re.findall(rf"regenerate:.*?(\d+)/{asked} \[([\d:]+)<", log.replace("\r", "\n"))
        }
    )
    return [later[1] - earlier[1] for earlier, later in zip(marks, marks[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the budget run's --out")
    parser.add_argument("--log", type=Path, required=True, help="its console output")
    parser.add_argument("--rates", type=Path, help="another run's budget.json, for its rates")
    args = parser.parse_args()

    plan = json.loads((args.out / "budget.json").read_text())
    rates = Rates(**json.loads((args.rates or args.out / "budget.json").read_text())["rates"])
    request = plan["request"]
    config = TrainConfig(data=["unused"], **QUICKSTART_RECIPE)
    tokenizer = TargetVocabulary.load(config.target).tokenizer
    held_out = held_out_keys(tuple(request["exclude"]), tuple(request["prompts"]) + tuple(request["text"]))
    prompts = tuple(request["prompts"])
    sample, invented = plan_conversations(
        prompts, request["prompt_share"], plan["conversations"], config.seed, held_out
    )

    batches = answered_prompts(tokenizer, sample, 1.0, config).batches(len(sample))
    took = batch_times(args.log.read_text(), len(sample))
    print(f"{len(sample)} prompts asked, {sum(map(len, batches))} answerable; {invented} conversations invented")
    predicted = 0.0
    for number, batch in enumerate(batches):
        seconds = answers_s(rates, len(batch), batch[-1])
        predicted += seconds
        spent = f"{took[number]} s" if number < len(took) else "?"
        print(f"batch {number}: {len(batch)} rows padded to {batch[-1]}: predicted {seconds:.0f} s, took {spent}")
    print(f"all answers: predicted {predicted:.0f} s, took {sum(took)} s")

    everything = answered_prompts(tokenizer, prompt_sample(prompts, None, config.seed, held_out), 1.0, config)
    typical, _ = probe_batches(everything)
    fits = sum(n <= everything.longest for n in everything.lengths) / len(everything.lengths)
    typical_s = answers_s(rates, len(typical), max(everything.lengths[i] for i in typical))
    print(
        f"the typical batch's time for every answer ({fits:.3f} of the prompts short enough): "
        f"{len(sample) * fits * typical_s / len(typical):.0f} s"
    )


if __name__ == "__main__":
    main()
